"""A long conversation's snapshots: written, read back and verified past an event's size bound.

A snapshot holds the whole folded tree. With 64 KiB tool results it passes 16 MiB (the
largest an event's state may inflate to) after ~130 rounds; with 1 KiB ones after ~4,500.
Snapshots used to be read with the event bound: every load then logged the newest snapshot
unreadable and folded the whole history, and ``audit verify`` failed the healthy store
(``snapshot.mismatch: ... malformed``), while the next append wrote another such snapshot.
Now a snapshot is read up to ``MAX_SNAPSHOT_BYTES``, and a tree too large even for that is
not snapshotted again (loads go on from the last snapshot under the bound).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import agentfold.adapters.eventstore as eventstore_module
import agentfold.adapters.runtime as runtime_module
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import MAX_SNAPSHOT_BYTES, MAX_STATE_BYTES, stored_json
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ModelRequest
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.program import Program
from tests.audit.support import cli

RESULT_BYTES = 64 * 1024


class Fetch:
    """A tool returning ``RESULT_BYTES`` of text that differs per call."""

    name = "fetch"
    description = "Fetch a page."
    parameters = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        line = f"{invocation.call.id} lorem ipsum dolor sit amet {len(invocation.call.id)} "
        return ToolOutput.text((line * (RESULT_BYTES // len(line) + 1))[:RESULT_BYTES])


class Rounds:
    """A model asking for one ``fetch`` per call, ``rounds`` times, then answering."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def call(self, request: ModelRequest) -> dict[str, Any]:
        n = request.model_call_sequence
        if n > self.rounds:
            return {"message": {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
                    "finish_reason": "stop"}
        return {"message": {"role": "assistant", "tool_calls": [{"id": f"c{n}", "name": "fetch", "arguments": "{}"}]},
                "finish_reason": "tool_calls"}


def long_run(url: str, rounds: int, snapshot_every: int = 1000) -> tuple[EventStore, Program, Any]:
    program = compile_interaction(InteractionConfig(name="test.long", model=Rounds(rounds), tools=[Fetch()]))
    store = EventStore(url)
    with Runtime(store, Catalog([program]), snapshot_every=snapshot_every) as runtime:
        handle = runtime.start(program, {"messages": [{"role": "user", "content": "read everything"}]})
        assert handle.result(timeout=300).status == "completed"
        runtime.wait_idle(handle.tree_id)
    return store, program, handle.tree_id


def test_a_snapshot_larger_than_an_events_bound_is_read_back_and_the_store_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'long.db'}"
    store, program, tree_id = long_run(url, 160)
    try:
        [row] = store.snapshots.select_events(tree_id.uuid, desc=True, limit=1)
        inflated = len(stored_json(row.state, MAX_SNAPSHOT_BYTES))
        assert MAX_STATE_BYTES < inflated < MAX_SNAPSHOT_BYTES, inflated  # the case this test is about
        with caplog.at_level(logging.WARNING, logger="agentfold.store"):
            loaded = store.load(tree_id, Catalog([program]).resolve)
        assert loaded.snapshot_version == row.originator_version  # used, not skipped
        assert not [r for r in caplog.records if "snapshot" in r.getMessage()]
        plain = store.load(tree_id, Catalog([program]).resolve, use_snapshot=False)
        assert loaded.state.to_json() == plain.state.to_json() and loaded.digest == plain.digest
    finally:
        store.close()
    ran = cli(capsys, "audit", "verify", "--all", "--json", "--store", url, sources=ProgramSources(programs=(program,)))
    assert ran.code == 0, ran.out + ran.err
    assert ran.json()["ok"] is True


def test_a_tree_too_large_to_snapshot_is_not_snapshotted_and_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past ``MAX_SNAPSHOT_BYTES`` (here lowered to 1 MiB, so a short run reaches it) no
    snapshot is written: one warning each time, and a load folds on from the last one."""
    bound = 1 << 20
    monkeypatch.setattr(eventstore_module, "MAX_SNAPSHOT_BYTES", bound)
    monkeypatch.setattr(runtime_module, "MAX_SNAPSHOT_BYTES", bound)
    url = f"sqlite:///{tmp_path / 'bounded.db'}"
    with caplog.at_level(logging.WARNING, logger="agentfold.store"):
        store, program, tree_id = long_run(url, 40, snapshot_every=100)
    try:
        rows = store.snapshots.select_events(tree_id.uuid)
        assert rows  # the early, smaller ones were written
        assert all(len(stored_json(r.state, MAX_SNAPSHOT_BYTES)) <= bound for r in rows)
        assert [r for r in caplog.records if "no snapshot at version" in r.getMessage()]
        # Once too large, the tree only grows: its owner stops serializing snapshots (one warning).
        assert len([r for r in caplog.records if "no snapshot at version" in r.getMessage()]) == 1
        loaded = store.load(tree_id, Catalog([program]).resolve)
        assert loaded.snapshot_version == max((r.originator_version for r in rows), default=0)
        plain = store.load(tree_id, Catalog([program]).resolve, use_snapshot=False)
        assert loaded.state.to_json() == plain.state.to_json()
    finally:
        store.close()


def test_a_reduced_context_too_large_for_a_settlement_fails_before_the_model_is_called(tmp_path: Path) -> None:
    """Scope 2.8: the smallest success envelope of a model call must fit the payload limit,
    else the call settles failed before it is made. With a context policy the settlement
    carries the reduced messages; past 4 MiB it used to be made, then left unknown, and no
    resolution could carry those messages either: the run was stuck. Now it fails, definite,
    with ``interaction.host.failed``, and the model is not called for it."""
    calls: list[int] = []

    class Counting(Rounds):
        def call(self, request: ModelRequest) -> dict[str, Any]:
            calls.append(request.model_call_sequence)
            return super().call(request)

    def label(messages: Any) -> list[dict[str, Any]]:  # rewrites the first message, differently each call
        first, *rest = messages
        note = f"[{len(messages)} messages so far] read everything"
        return [{**first, "content": [{"type": "text", "text": note}]}, *rest]

    program = compile_interaction(InteractionConfig(name="test.reduced_long", model=Counting(200), tools=[Fetch()],
                                                    context_policy=label))
    store = EventStore(f"sqlite:///{tmp_path / 'reduced.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "read everything"}]})
            tree = runtime.wait_idle(handle.tree_id)
            assert tree.unknown_ids == set()
            result = handle.result(timeout=60)
    finally:
        store.close()
    assert result.status == "failed"
    failure = result.termination["failure"]
    assert failure["code"] == "interaction.host.failed", failure
    assert "do not fit a settlement" in failure["message"] and "above the limit of 4194304" in failure["message"], failure
    # Every model call but the refused one was made; the refused one never reached the model.
    assert calls == list(range(1, len(calls) + 1)) and 60 < len(calls) < 80
