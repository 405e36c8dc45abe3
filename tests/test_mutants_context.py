"""What an Interaction shows its model, as the mutation audit of 2026-12-05 ("context") found undefended.

Each test failed with a planted bug (or, for the first, the product's own behaviour before
its fix) that the rest of the suite let through; the audit's report lists them. Real
runtimes on SQLite files in ``tmp_path``, real Programs; the model is a ScriptedModel that
records every request it received. What is asserted is what a user observes: the messages
the model received, ``agentfold replay`` (in-process ``main``) and the run's outcome.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.program import Program
from tests.audit.support import cli
from tests.interaction.tools import WAIT, CallLog, ProbeTool, call, chat_input, final, tool_round
from tests.test_mutants_inter import asking  # a tool that asks a human before it acts


def interaction(name: str, model: ScriptedModel, tools: list[Any] = (), **options: Any) -> Program:  # type: ignore[assignment]
    return compile_interaction(InteractionConfig(name=name, model=model, tools=list(tools), **options))


def record(tmp_path: Path, program: Program, given: Any) -> tuple[str, Any]:
    """Run ``program`` to its end on a SQLite file; the store URL and the run's handle."""
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, given)
            assert handle.result(WAIT).status == "completed"
            return url, handle
    finally:
        store.close()


def replay_contexts(capsys: pytest.CaptureFixture[str], url: str, handle: Any, program: Program) -> list[dict[str, Any]]:
    """``agentfold replay TREE --at N --json`` at every position: the root's working context."""
    sources = ProgramSources(programs=(program,))
    contexts = []
    position = 1
    while True:
        ran = cli(capsys, "replay", str(handle.tree_id), "--at", str(position), "--json", "--store", url, sources=sources)
        if ran.code == 2 and "audit.position_out_of_range" in ran.stderr:
            break
        assert ran.code == 0, ran.stderr
        context = ran.json()["working_context"].get(str(handle.root_process_id))
        if context is not None:
            contexts.append(context)
        position += 1
    return contexts


class DropOldest:
    """A context processor that drops the oldest message of what it is given."""

    def prepare_context(self, request: Any) -> list[dict[str, Any]]:
        messages = list(request.messages)
        return messages[1:] if len(messages) > 1 else messages


# ---------------------------------------------------------------------------
# replay: next_model_request


def test_replay_never_shows_a_next_model_request_a_context_processor_has_yet_to_prepare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/audit.md: ``next_model_request`` is what the next model request would contain
    when the history up to the position determines it, else ``null``. With a context
    processor bound, what the model receives is the processor's output: before it is
    prepared (ready to call, preparation in flight, a completed round), the history does not
    determine it. At every position, what replay shows as the next model request is either
    ``null`` or exactly the messages the model received in that call."""
    log = CallLog()
    model = ScriptedModel([tool_round(call("t1", "probe")), final("done")])
    program = interaction("test.context.processed", model, [ProbeTool("probe", log)], context_processor=DropOldest())
    url, handle = record(tmp_path, program, chat_input("a long history", "the question"))
    received = [list(r.messages) for r in model.requests]
    assert len(received) == 2 and len(received[0]) == 1  # the processor did reduce what the model saw

    contexts = replay_contexts(capsys, url, handle, program)
    shown = []
    for context in contexts:
        if context["phase"] == "completed" or context["next_model_request"] is None:
            continue
        # The call the shown request is for: the one in flight, else the next one.
        upcoming = context["model_call_count"] - (1 if context["phase"] == "awaiting_model" else 0)
        shown.append((context["phase"], upcoming))
        assert context["next_model_request"]["messages"] == received[upcoming], context["phase"]
    assert {phase for phase, _ in shown} == {"awaiting_model"}  # both in-flight calls are shown
    assert sorted({call for _, call in shown}) == [0, 1]



class HeldProcessor:
    """A context processor that keeps the context as it is; its first preparation is held
    open until the test releases it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def prepare_context(self, request: Any) -> list[dict[str, Any]]:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.release.wait(WAIT), "the test never released the preparation"
        return list(request.messages)


def test_replay_of_a_model_call_in_flight_shows_what_was_sent_not_the_steer_that_arrived_since(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/audit.md: while a model call is in flight, ``next_model_request`` is that call's
    request. A steer that arrives while the context is being prepared is consumed with the
    preparation and queued (``pending_steer``) for the call after the one it prepared: at
    every position of that call in flight, replay shows exactly the messages the model
    received in it, without the steer, and the steer reaches the model in the next call."""
    processor = HeldProcessor()
    model = ScriptedModel([final("first answer"), final("steered answer")])
    program = interaction("test.context.steer-in-flight", model, context_processor=processor)
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, chat_input("plan a trip"))
            assert processor.entered.wait(WAIT)
            assert Host(runtime).steer(str(handle.root_process_id), "prefer trains", signal_id="signal:steer-trains")
            processor.release.set()
            assert handle.result(WAIT).status == "completed"
    finally:
        store.close()
    first, second = (list(r.messages) for r in model.requests)
    assert "prefer trains" not in repr(first) and "prefer trains" in repr(second[-1])

    contexts = replay_contexts(capsys, url, handle, program)
    steered_in_flight = [c for c in contexts if c["phase"] == "awaiting_model" and c["model_call_count"] == 1
                         and c["model_request"] is not None and c["pending_steer"]]
    assert steered_in_flight, "no position shows the steer queued while call 1 was in flight"
    for context in steered_in_flight:
        assert [p["signal_id"] for p in context["pending_steer"]] == ["signal:steer-trains"]
        assert context["model_request"]["messages"] == first
        assert context["next_model_request"]["messages"] == first


# ---------------------------------------------------------------------------
# Chat history given by the host


def test_a_failed_tool_result_in_the_given_history_reaches_the_model_as_an_error(tmp_path: Path) -> None:
    """docs/interaction.md (chat values): a tool result carries ``"is_error": true`` when the
    call failed. An Interaction started on a history that holds an earlier failed tool call
    (and a succeeded one) sends the model that history as given: the failed result is still
    an error, the succeeded one is not, each under its own call id."""
    history = [
        {"role": "user", "content": "book the hotel"},
        {"role": "assistant", "tool_calls": [{"id": "c0", "name": "book"}, {"id": "c1", "name": "weather"}]},
        {"role": "tool", "tool_results": [
            {"id": "c0", "name": "book", "output": {"content": [{"type": "text", "text": "error: sold out"}]},
             "is_error": True},
            {"id": "c1", "name": "weather", "output": {"content": [{"type": "text", "text": "sunny"}]}},
        ]},
        {"role": "user", "content": "what now?"},
    ]
    model = ScriptedModel([final("try another hotel")])
    program = interaction("test.context.history", model)
    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {"messages": history}).result(WAIT)
    finally:
        store.close()
    assert result.status == "completed"
    [request] = model.requests
    [tool] = [m for m in request.messages if m["role"] == "tool"]
    assert [(r["id"], r.get("is_error", False)) for r in tool["tool_results"]] == [("c0", True), ("c1", False)]


def test_the_model_receives_the_given_messages_in_the_given_order_system_messages_included(tmp_path: Path) -> None:
    """docs/interaction.md: an Interaction's input is its messages; the first model request
    holds them as given (normalized, never reordered): a system message that comes after a
    user message stays there, and a later one too."""
    given = [
        {"role": "user", "content": "hello"},
        {"role": "system", "content": "answer in French"},
        {"role": "user", "content": "what is the weather?"},
        {"role": "system", "content": "be brief"},
    ]
    model = ScriptedModel([final("il fait beau")])
    program = interaction("test.context.order", model)
    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            assert runtime.start(program, {"messages": given}).result(WAIT).status == "completed"
    finally:
        store.close()
    [request] = model.requests
    assert [(m["role"], m["content"][0]["text"]) for m in request.messages] == [
        (m["role"], m["content"]) for m in given]


# ---------------------------------------------------------------------------
# A round recovered from a snapshot


def test_a_round_recovered_from_a_snapshot_shows_the_model_every_result_once_in_call_order(tmp_path: Path) -> None:
    """A round [missing tool, ask]: the first call gets its rejected result at once, the second
    waits for a human. The runtime snapshots the tree after every append and closes; a new
    runtime recovers the tree from that snapshot, the answer arrives, and the model's next
    request holds one tool message with both results, in call order, each under its own call
    id, the rejected one still an error: nothing the snapshot held is lost or repeated."""
    log = CallLog()
    model = ScriptedModel([tool_round(call("c0", "missing"), call("c1", "ask")), final("done")])
    program = interaction("test.context.snapshot-round", model, [asking(log)])
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program]), snapshot_every=1) as runtime:
            handle = runtime.start(program, chat_input("go"), start_id="snapshot-round")
            runtime.wait_idle(handle.tree_id, WAIT)
            [wait] = Host(runtime).pending(str(handle.tree_id))
        [row] = store.snapshots.select_events(handle.tree_id.uuid, desc=True, limit=1)
        assert row.originator_version == store.load(handle.tree_id, Catalog([program]).resolve).state.version
        with Runtime(store, Catalog([program])) as runtime:
            [recovered] = runtime.recover("snapshot-round")
            assert Host(runtime).answer(wait["process_id"], wait["wait_id"], {"ok": True})
            assert recovered.result(WAIT).status == "completed"
    finally:
        store.close()
    assert len(model.requests) == 2
    tool = model.requests[1].messages[-1]
    assert tool["role"] == "tool"
    assert [(r["id"], r["name"], r.get("is_error", False), r["output"]["content"][0]["text"])
            for r in tool["tool_results"]] == [
        ("c0", "missing", True, 'error: tool "missing" is not available'),
        ("c1", "ask", False, "approved=True"),
    ]
    assert log.count("ask") == 2  # asked once, answered once: the recovery re-ran nothing


def test_a_steer_queued_in_a_round_survives_recovery_from_a_snapshot_and_follows_the_tool_message(
    tmp_path: Path,
) -> None:
    """A round [probe, ask]: while ``probe`` runs (held) and ``ask`` waits for a human, a steer
    arrives; the Interaction takes it in with ``probe``'s result and queues it for its next
    model request. The tree is snapshotted there (``snapshot_every=1``) and the runtime closes;
    a new runtime recovers it from that snapshot, the answer arrives, and the model's next
    request holds the tool message, then the steer, once."""
    log = CallLog()
    probe = ProbeTool("probe", log)
    gate = probe.hold("c0")
    model = ScriptedModel([tool_round(call("c0", "probe"), call("c1", "ask")), final("done")])
    program = interaction("test.context.snapshot-steer", model, [probe, asking(log)])
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program]), snapshot_every=1) as runtime:
            handle = runtime.start(program, chat_input("go"), start_id="snapshot-steer")
            assert gate.entered.wait(WAIT)
            assert Host(runtime).steer(str(handle.root_process_id), "also book a taxi", signal_id="signal:taxi")
            gate.release.set()
            runtime.wait_idle(handle.tree_id, WAIT)
            [wait] = Host(runtime).pending(str(handle.tree_id))
        loaded = store.load(handle.tree_id, Catalog([program]).resolve)
        assert loaded.snapshot_version == loaded.state.version  # the recovery below starts from the snapshot
        with Runtime(store, Catalog([program])) as runtime:
            [recovered] = runtime.recover("snapshot-steer")
            assert Host(runtime).answer(wait["process_id"], wait["wait_id"], {"ok": True})
            assert recovered.result(WAIT).status == "completed"
    finally:
        store.close()
    assert len(model.requests) == 2
    *_, assistant, tool, steer = model.requests[1].messages
    assert [c["id"] for c in assistant["tool_calls"]] == ["c0", "c1"]
    assert [r["id"] for r in tool["tool_results"]] == ["c0", "c1"]
    assert steer == {"role": "user", "content": [{"type": "text", "text": "also book a taxi"}]}
    assert repr(model.requests[1].messages).count("also book a taxi") == 1


def test_deferred_tools_advertised_before_a_snapshot_are_still_offered_to_the_model_after_recovery(
    tmp_path: Path,
) -> None:
    """docs/interaction.md: a tool result may advertise deferred tools, which every later
    model request offers (after the ordinary tools). Round 1's ``finder`` advertises
    ``alpha``; round 2's ``ask`` waits for a human; the tree is snapshotted there and a new
    runtime recovers it from that snapshot: the model request after the answer still offers
    ``alpha``, as the one before the recovery did."""
    log = CallLog()
    finder = ProbeTool("finder", log, advertise=lambda invocation, output: ["alpha"])
    model = ScriptedModel([tool_round(call("c1", "finder")), tool_round(call("c2", "ask")), final("done")])
    program = interaction("test.context.snapshot-advertised", model, [finder, asking(log)],
                          deferred_tools=[ProbeTool("alpha", log)])
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program]), snapshot_every=1) as runtime:
            handle = runtime.start(program, chat_input("go"), start_id="snapshot-advertised")
            runtime.wait_idle(handle.tree_id, WAIT)
            [wait] = Host(runtime).pending(str(handle.tree_id))
        loaded = store.load(handle.tree_id, Catalog([program]).resolve)
        # The recovery below starts from a snapshot taken while round 2 waits (the interval
        # grows with the tree, so not necessarily at its last position), long after round 1.
        assert loaded.snapshot_version is not None and loaded.snapshot_version > loaded.state.version * 3 // 4
        with Runtime(store, Catalog([program])) as runtime:
            [recovered] = runtime.recover("snapshot-advertised")
            assert Host(runtime).answer(wait["process_id"], wait["wait_id"], {"ok": True})
            assert recovered.result(WAIT).status == "completed"
    finally:
        store.close()
    assert [[t["name"] for t in r.tools] for r in model.requests] == [
        ["finder", "ask"], ["finder", "ask", "alpha"], ["finder", "ask", "alpha"]]
