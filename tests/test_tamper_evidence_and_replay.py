"""Promises of docs/guarantees.md that the rest of the suite did not defend (found by mutation).

* "History is tamper-evident": every stored event, whatever its type, is covered by the digest
  chain; the earlier tamper tests only ever changed an ``EffectSettled`` event, so a reader that
  skipped the check for another type (the run's ``ProcessTerminated``, which holds its output)
  went unnoticed.
* "A load that starts from a snapshot verifies the events after the snapshot, chained from the
  digest the snapshot recorded": the tamper tests loaded with snapshots off, so a load that
  trusted the events after a snapshot went unnoticed.
* "With replay policy ``never`` ... A host cannot replay it either": the refusal's code was
  checked, but not that the dispatcher was left alone, so a replay that called the dispatcher
  and only then refused went unnoticed.

Real SQLite files changed with plain SQL (``tests.audit.support.Sql``), the ``agentfold``
command run as a child process, and dispatcher calls counted where they are made.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import EngineCode, Rejected
from agentfold.domain.ids import TreeID
from agentfold.domain.program import Descriptor, Program
from agentfold.domain.requests import EffectRequest, Settlement
from tests.audit.support import Sql
from tests.bad_input_programs import Pair
from tests.kernel_programs import IMPL, chain_program, config_digest
from tests.test_cli import agentfold

#: The stored timestamp member of an event's state (``YYYY-MM-DDTHH:MM:SS.ffffffZ``).
TIMESTAMP = re.compile(rb'"timestamp":"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.)(\d{6})Z"')


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'agentfold.db'}"


def record_chain(url: str, *, snapshot_every: int) -> TreeID:
    """A completed chain of three dispatcher Effects (15 events: the layout of tests/audit/test_verify.py)."""
    program = chain_program(name="mutants.chain")
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0, snapshot_every=snapshot_every) as runtime:
            handle = runtime.start(program, {"n": 3}, start_id="mutants-chain")
            result = handle.result(timeout=60)
            assert result.status == "completed"
            assert result.output == {"total": 3, "effects": 3}
            return handle.tree_id
    finally:
        store.close()


def shift_timestamp(state: bytes) -> bytes:
    """The same event with its timestamp one microsecond later (one changed byte of its content)."""
    match = TIMESTAMP.search(state)
    assert match is not None, state[:200]
    micros = f"{(int(match.group(2)) + 1) % 1_000_000:06d}".encode()
    return state[: match.start(2)] + micros + state[match.end(2) :]


def first_position_of(sql: Sql, tree_id: TreeID, event_type: str) -> tuple[int, str, bytes]:
    return next((v, t, s) for v, t, s in sql.rows(tree_id) if t.split(":")[-1].split("@")[0] == event_type)


def assert_load_reports(url: str, tree_id: TreeID, position: int) -> None:
    """``EventStore.load`` (what the runtime and every command fold) and ``agentfold show``
    both report the store corrupt at ``position``, and show prints no state."""
    store = EventStore(url)
    try:
        with pytest.raises(CorruptStream) as loaded:
            store.load(tree_id)
        assert loaded.value.code == "store.corrupt"
        assert (loaded.value.position, loaded.value.rule) == (position, "integrity.digest_chain"), loaded.value
    finally:
        store.close()
    shown = agentfold("show", str(tree_id), "--json", store=url)
    assert shown.code == 1, shown
    assert shown.stdout == ""
    error = shown.error()
    assert error["code"] == "store.corrupt" and f"at position {position}" in error["message"], error


# ---------------------------------------------------------------------------
# Every event type is covered by the digest chain


CHAIN_EVENT_TYPES = [
    "TreeStarted", "StepCommitted", "EffectDeclared", "EffectDispatched", "EffectSettled", "ProcessTerminated",
]


@pytest.mark.parametrize("event_type", CHAIN_EVENT_TYPES)
def test_a_changed_event_of_any_type_is_reported_corrupt_at_its_position_on_load(
    tmp_path: Path, event_type: str
) -> None:
    url = sqlite_url(tmp_path)
    tree_id = record_chain(url, snapshot_every=0)
    sql = Sql(url)
    position, topic, state = first_position_of(sql, tree_id, event_type)
    sql.set_row(tree_id, position, topic, shift_timestamp(state))
    assert_load_reports(url, tree_id, position)


def test_a_forged_output_of_a_finished_run_is_reported_corrupt_not_shown(tmp_path: Path) -> None:
    """The run's output lives in its ProcessTerminated event: changing it with SQL must not
    change what a user reads, it must make the tree unreadable (store.corrupt) where it was changed."""
    url = sqlite_url(tmp_path)
    tree_id = record_chain(url, snapshot_every=0)
    sql = Sql(url)
    position, topic, state = first_position_of(sql, tree_id, "ProcessTerminated")
    assert state.count(b'"total":3') == 1
    sql.set_row(tree_id, position, topic, state.replace(b'"total":3', b'"total":300'))
    assert_load_reports(url, tree_id, position)
    verify = agentfold("audit", "verify", str(tree_id), "--json", store=url)
    assert verify.code == 1, verify
    report = verify.json()
    assert report["first_error"]["position"] == position
    assert report["first_error"]["rule"] == "integrity.digest_chain"


# ---------------------------------------------------------------------------
# A load from a snapshot verifies the events after it


def snapshot_versions(sql: Sql, tree_id: TreeID) -> list[int]:
    rows = sql._run(
        "SELECT originator_version FROM agentfold_snapshots WHERE originator_id = ?", (sql._id(tree_id),)
    )
    return sorted(int(v) for (v,) in rows)


def test_a_load_from_a_snapshot_reports_a_changed_event_after_the_snapshot(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    tree_id = record_chain(url, snapshot_every=4)
    sql = Sql(url)
    (snapshot,) = snapshot_versions(sql, tree_id)
    last = sql.rows(tree_id)[-1][0]
    assert snapshot < last  # there are events after the snapshot
    store = EventStore(url)
    try:
        assert store.load(tree_id).snapshot_version == snapshot  # the load really starts from it
    finally:
        store.close()

    # The event right after the snapshot: the third call's recorded result.
    position = snapshot + 1
    _, topic, state = next(r for r in sql.rows(tree_id) if r[0] == position)
    assert topic.endswith("EffectSettled") and state.count(b'"value":1') == 1
    sql.set_row(tree_id, position, topic, state.replace(b'"value":1', b'"value":7'))
    assert_load_reports(url, tree_id, position)


def test_a_load_from_a_snapshot_reports_a_changed_last_event(tmp_path: Path) -> None:
    """Also the last event (nothing after it would notice a broken link)."""
    url = sqlite_url(tmp_path)
    tree_id = record_chain(url, snapshot_every=4)
    sql = Sql(url)
    (snapshot,) = snapshot_versions(sql, tree_id)
    position, topic, state = sql.rows(tree_id)[-1]
    assert snapshot < position
    sql.set_row(tree_id, position, topic, shift_timestamp(state))
    assert_load_reports(url, tree_id, position)


# ---------------------------------------------------------------------------
# A `never` Effect is not replayed: the dispatcher is not called


class CountedPair:
    """tests.bad_input_programs.pair_program with its dispatcher calls counted: the first call
    succeeds, the second raises (its outcome is unknown)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def call(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        with self.lock:
            self.calls.append({"effect_id": str(request.effect_id), "payload": request.payload})
        if request.payload["call"] == "boom":
            raise ConnectionError("the tool's connection dropped mid-call")
        return Settlement.succeeded({"value": 1})

    def program(self) -> Program:
        name = "mutants.pair"
        return Program(Descriptor(name), Pair(), IMPL, config_digest(name), dispatcher=FunctionDispatcher(self.call))


@pytest.fixture
def pair_runtime(tmp_path: Path) -> Iterator[tuple[Runtime, CountedPair]]:
    counted = CountedPair()
    store = EventStore(sqlite_url(tmp_path))
    with Runtime(store, Catalog([counted.program()]), poll_interval=0) as runtime:
        yield runtime, counted
    store.close()


def test_replaying_a_never_effect_is_refused_without_calling_its_dispatcher(
    pair_runtime: tuple[Runtime, CountedPair],
) -> None:
    runtime, counted = pair_runtime
    handle = runtime.start(counted.program(), None, start_id="mutants-pair")
    tree = runtime.wait_idle(handle.tree_id)
    (unknown,) = tree.root.unknown_effects()
    assert unknown.replay == "never"
    assert [c["payload"]["call"] for c in counted.calls] == ["ok", "boom"]
    version = runtime.store.head(handle.tree_id).version  # type: ignore[union-attr]

    with pytest.raises(Rejected) as caught:
        runtime.replay_unknown_effect(unknown.effect_id)
    assert caught.value.code == "engine.effect.replay_forbidden"

    # At most once, ever: the refused replay made no call and recorded nothing.
    assert [c["payload"]["call"] for c in counted.calls] == ["ok", "boom"]
    assert runtime.store.head(handle.tree_id).version == version  # type: ignore[union-attr]
    after = runtime.capture(handle.tree_id).root.effect(unknown.effect_id)
    assert after is not None and after.unknown and after.resolved_by is None
    assert after.diagnostic is not None and after.diagnostic.code == EngineCode.DISPATCH_FAILED

    # The host can still resolve it, and the run finishes without another call.
    runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 2}))
    assert runtime.result(handle.tree_id, timeout=30).status == "completed"
    assert len(counted.calls) == 2
