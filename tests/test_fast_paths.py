"""The hot path's shortcuts give exactly what the general code gives.

* ``TreeEvent.model_construct`` (the kernel builds every event with it) must build the
  same event as validation does, and refuse a missing or unknown field instead of
  silently dropping it (pydantic's own ``model_construct`` drops unknown fields).
* ``event_body`` (every stored event's JSON) must give exactly pydantic's
  ``model_dump(mode="json", exclude_defaults=True)``, value for value and byte for byte.
* ``TreeHead.with_digest`` must keep every other field of the index row.
* SQLite connections keep the statements of an append prepared.
* Both pools (SQLite and PostgreSQL) hand one thread's consecutive appends the same
  connection, so a PostgreSQL tree's appends stay on one server process.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.recorders import SQLITE_STATEMENT_CACHE, TreeHead
from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.errors import Failure, FailureKind
from agentfold.domain.events import (
    EVENT_TYPES,
    CheckpointCommitted,
    ControlRequested,
    EffectDeclared,
    EffectResolved,
    EffectSettled,
    OutputRef,
    ProcessTerminated,
    SignalAdmitted,
    StepCommitted,
    TreeEvent,
    TreeStarted,
    event_body,
    event_from_body,
)
from agentfold.domain.ids import EffectAttemptID, ProcessID, SignalID, WaitID
from agentfold.domain.ids import effect_id as derive_effect_id
from tests.audit.support import record_demo

PID = ProcessID("process:" + "a1" * 16)


def test_constructed_events_equal_validated_ones_and_dump_the_same() -> None:
    eid = derive_effect_id(PID, 3, 0)
    cases = [
        StepCommitted.model_construct(process_id=PID, step=3, consumed=1, kind="continue", facts={"n": 1}, effects=1),
        EffectDeclared.model_construct(
            process_id=PID, effect_id=eid, step=3, index=0, target="dispatcher", payload={"x": [1, 2]}
        ),
    ]
    for event in cases:
        body = event_body(event)
        validated = event_from_body(type(event).__name__, body)
        assert validated == event
        assert event_body(validated) == body
        assert validated.model_dump() == event.model_dump()
    # defaults are filled in and only the given fields count as set
    step = cases[0]
    assert step.wait_id is None and step.reason is None
    assert step.model_fields_set == {"process_id", "step", "consumed", "kind", "facts", "effects"}


def test_constructing_an_event_with_an_unknown_or_missing_field_raises() -> None:
    with pytest.raises(TypeError, match="unknown fields \\['stpe'\\]"):
        StepCommitted.model_construct(process_id=PID, stpe=1, step=1, consumed=0, kind="continue")
    with pytest.raises(TypeError, match="needs consumed"):
        StepCommitted.model_construct(process_id=PID, step=1, kind="continue")


def test_every_event_type_constructs_with_its_defaults() -> None:
    # Shared default instances are only safe when they are immutable.
    for cls in EVENT_TYPES.values():
        for name, field in cls.model_fields.items():
            if field.is_required():
                continue
            default = field.get_default(call_default_factory=True)
            assert _immutable(default), f"{cls.__name__}.{name} has a mutable default {default!r}"
    assert TreeStarted.model_construct.__func__ is StepCommitted.model_construct.__func__  # type: ignore[attr-defined]


def _immutable(value: object) -> bool:
    if value is None or isinstance(value, (str, int, frozenset)):
        return True
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    if dataclasses.is_dataclass(value):
        return bool(value.__dataclass_params__.frozen) and all(  # type: ignore[attr-defined]
            _immutable(getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    config = getattr(value, "model_config", None)
    if isinstance(config, dict) and config.get("frozen"):
        return all(_immutable(getattr(value, n)) for n in type(value).model_fields)  # type: ignore[attr-defined]
    return False


def _assert_body_is_pydantics(event: TreeEvent) -> None:
    expected = event.model_dump(mode="json", exclude_defaults=True)
    body = event_body(event)
    assert body == expected, type(event).__name__
    assert canonical_bytes(body) == canonical_bytes(expected), type(event).__name__


def test_event_bodies_are_pydantics_dump_for_every_event_of_a_recorded_run(tmp_path: Path) -> None:
    # The bundled scenario: a tree start, tool children, settlements, a human input wait
    # and its answer, terminations with output references.
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    tree_id = record_demo(tmp_path, url)
    store = EventStore(url)
    try:
        events = [recorded.event for recorded in store.read(tree_id)]
    finally:
        store.close()
    assert {"TreeStarted", "ProcessStarted", "SignalAdmitted", "EffectSettled", "ProcessTerminated"} <= {
        type(e).__name__ for e in events
    }
    for event in events:
        _assert_body_is_pydantics(event)


def test_event_bodies_are_pydantics_dump_for_nested_values_tuples_and_defaults() -> None:
    eid = derive_effect_id(PID, 2, 1)
    failure = Failure(FailureKind.EXTERNAL, "engine.dispatch.interrupted", "the owner stopped")
    cases: list[TreeEvent] = [
        EffectSettled.model_construct(
            process_id=PID, effect_id=eid, status="unknown", attempt_id=EffectAttemptID("attempt:" + "b2" * 16),
            diagnostic=failure,
        ),
        EffectSettled.model_construct(process_id=PID, effect_id=eid, status="succeeded", payload={"a": [1, 2.5, None]}),
        EffectSettled.model_construct(process_id=PID, effect_id=eid, status="failed", payload=0),
        ProcessTerminated.model_construct(
            process_id=PID, status="failed", cause="external_failure", reason="r", failure=failure,
            unresolved_effect_ids=(eid,),
        ),
        ProcessTerminated.model_construct(
            process_id=PID, status="completed", cause="completion", output_of=OutputRef(effect_id=eid, path=("a", "b"))
        ),
        ProcessTerminated.model_construct(process_id=PID, status="completed", cause="completion", output=False),
        EffectDeclared.model_construct(
            process_id=PID, effect_id=eid, step=2, index=1, target="dispatcher", payload=[], replay="same_identity",
            capabilities=("net", "fs"),
        ),
        EffectDeclared.model_construct(process_id=PID, effect_id=eid, step=2, index=1, target="framework", capabilities=()),
        StepCommitted.model_construct(
            process_id=PID, step=1, consumed=0, kind="wait", facts="", effects=0, wait_id=WaitID("wait:k"), reason=None
        ),
        SignalAdmitted.model_construct(process_id=PID, signal_id=SignalID("s-1"), payload={"x": ""}, source="parent"),
        EffectResolved.model_construct(process_id=PID, effect_id=eid, status="failed", payload=None, resolved_by="replay"),
        CheckpointCommitted.model_construct(process_id=PID, step=4, kind="x.y", acknowledges={"n": 1}),
        ControlRequested.model_construct(process_id=PID, control="cancel", reason="", owner="parent"),
    ]
    for event in cases:
        _assert_body_is_pydantics(event)


def test_a_head_with_its_digest_keeps_every_other_field() -> None:
    head = TreeHead(
        tree_id="tree:1", start_id="start:1", root_process_id=str(PID), program="p", status="running",
        classification="progress", version=7, head_digest="", unknown_effect_ids=("effect:x",),
        created_at="2026-01-01T00:00:00.000000Z", updated_at="2026-01-02T00:00:00.000000Z",
        new_processes=(str(PID),),
    )
    digested = head.with_digest("sha256:" + "0" * 64)
    expected = dataclasses.replace(head, head_digest="sha256:" + "0" * 64)
    assert [getattr(digested, f.name) for f in dataclasses.fields(TreeHead)] == [
        getattr(expected, f.name) for f in dataclasses.fields(TreeHead)
    ]


def test_sqlite_connections_cache_the_statements_of_an_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # eventsourcing passes cached_statements=True (a cache of one statement); every
    # connection of the store must be opened with a real cache, in WAL mode.
    opened: list[dict[str, object]] = []
    real_connect = sqlite3.connect

    def spy(*args: object, **kwargs: object) -> sqlite3.Connection:
        opened.append(kwargs)
        return real_connect(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite3, "connect", spy)
    store = EventStore(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        store.recorder.select_heads()
        with store.factory.datastore.transaction(commit=False) as cursor:
            cursor.execute("PRAGMA journal_mode")
            assert str(cursor.fetchone()[0]).lower() == "wal"
    finally:
        store.close()
    assert opened, "the store opened no SQLite connection through sqlite3.connect"
    assert {k.get("cached_statements") for k in opened} == {SQLITE_STATEMENT_CACHE}
    assert SQLITE_STATEMENT_CACHE >= 16


def test_the_sqlite_pool_hands_out_the_most_recently_used_connection(tmp_path: Path) -> None:
    # One writer thread must keep using one connection (its page cache stays valid), even
    # once a second connection exists.
    store = EventStore(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        pool = store.factory.datastore.pool
        first = pool.get_connection(is_writer=False)
        second = pool.get_connection(is_writer=False)
        assert first is not second
        pool.put_connection(first)
        pool.put_connection(second)
        for _ in range(3):
            again = pool.get_connection(is_writer=True)
            assert again is second
            pool.put_connection(again)
    finally:
        store.close()


def test_the_postgres_pool_hands_out_the_most_recently_used_connection(pg_database: str) -> None:
    # psycopg_pool by itself rotates through every pooled connection (oldest first): each
    # append of one tree then ran on another server process, with colder caches.
    store = EventStore(pg_database)
    try:
        datastore = store.factory.datastore
        with datastore.get_connection() as a, datastore.get_connection() as b:
            held = {a.info.backend_pid, b.info.backend_pid}
        assert len(held) == 2
        pids = []
        for _ in range(6):
            with datastore.get_connection() as conn:
                pids.append(conn.info.backend_pid)
        assert len(set(pids)) == 1, pids
    finally:
        store.close()


def test_the_runtime_clock_reads_like_strftime_across_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    import time as time_module
    from datetime import UTC, datetime

    import agentfold.adapters.runtime as runtime_module

    # The cached text of a second must change with the second (and the date), and the
    # microseconds keep their six digits.
    readings = [1_764_547_199_999_999_000, 1_764_547_200_000_000_000, 1_764_547_200_000_042_000, 1_764_633_600_500_000_000]
    for ns in readings:
        monkeypatch.setattr(time_module, "time_ns", lambda ns=ns: ns)
        expected = datetime.fromtimestamp(ns / 1e9, UTC).replace(microsecond=(ns // 1000) % 1_000_000)
        assert runtime_module.utc_now() == expected.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_the_cancel_flag_behaves_like_an_event() -> None:
    import threading
    import time as time_module

    from agentfold.adapters.dispatch import DispatchContext

    context = DispatchContext()
    assert not context.cancelled.is_set()
    assert context.cancelled.wait(0.01) is False
    waiter_saw: list[bool] = []
    waiter = threading.Thread(target=lambda: waiter_saw.append(context.cancelled.wait(5.0)))
    waiter.start()
    time_module.sleep(0.05)
    started = time_module.monotonic()
    context.cancelled.set()
    waiter.join(5.0)
    assert waiter_saw == [True] and time_module.monotonic() - started < 1.0
    assert context.cancelled.is_set() and context.cancelled.wait(0) is True
    # set before anyone waits: a later wait returns at once
    other = DispatchContext()
    other.cancelled.set()
    assert other.cancelled.wait(5.0) is True
