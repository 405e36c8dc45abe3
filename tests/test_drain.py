"""``Runtime.drain``: an owner that is about to stop records the calls that return, starts none.

Before, an owner that stopped (a command past its ``--timeout``, a server on SIGTERM) closed
at once: every call under way was abandoned (recovery records it unknown, a host must find
out what happened), even one that returned a millisecond later, and a dispatch permission
committed just before the close was recorded for a call never made (unknown as well).
Draining first records what returns within the grace and commits the next Steps with their
Effects declared but without a dispatch permission; the next owner makes those calls.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.events import EffectDeclared, EffectDispatched, EffectSettled
from tests.kernel_programs import CallLog, GatedCall, chain_program


def kinds(url: str, tree_id: Any) -> list[str]:
    store = EventStore(url, create=False)
    try:
        return [type(r.event).__name__ for r in store.read(tree_id)]
    finally:
        store.close()


def test_a_draining_owner_records_the_call_that_returns_and_starts_no_new_one(
    durable_store_url: str, tmp_path: Any,
) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    call = GatedCall(log, at=1)
    program = chain_program(call, name="drain.chain")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as owner:
        handle = owner.start(program, {"n": 4}, start_id="drain-1")
        assert call.entered.wait(30)
        drained: list[bool] = []
        draining = threading.Thread(target=lambda: drained.append(owner.drain(10.0)))
        draining.start()
        time.sleep(0.2)  # the drain has begun: the permission for the third call must not be granted
        call.release.set()
        draining.join(30)
        assert drained == [True]
    events = kinds(durable_store_url, handle.tree_id)
    # The second call's outcome is recorded, the third call is declared and never started.
    assert events.count("EffectSettled") == 2 and events.count("EffectDispatched") == 2, events
    assert events.count("EffectDeclared") == 3 and events[-1] == "EffectDeclared", events
    assert [c["index"] for c in log.calls()] == [0, 1]

    # The next owner makes the third call (it was never made): no unknown outcome at all.
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as next_owner:
        assert len(next_owner.recover(handle.tree_id)) == 1
        result = next_owner.result(handle.tree_id, timeout=30)
    assert result.status == "completed" and result.output == {"total": 4, "effects": 4}
    assert [c["index"] for c in log.calls()] == [0, 1, 2, 3]
    store = EventStore(durable_store_url, create=False)
    try:
        settled = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectSettled)]
        declared = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectDeclared)]
        dispatched = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectDispatched)]
    finally:
        store.close()
    assert [e.status for e in settled] == ["succeeded"] * 4
    assert len(declared) == len(dispatched) == 4


def test_a_call_that_does_not_return_within_the_grace_is_still_abandoned_and_recorded_unknown(
    durable_store_url: str, tmp_path: Any,
) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    call = GatedCall(log, at=1)
    program = chain_program(call, name="drain.chain")
    try:
        with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as owner:
            handle = owner.start(program, {"n": 4}, start_id="drain-2")
            assert call.entered.wait(30)
            began = time.monotonic()
            assert owner.drain(0.3) is False
            assert time.monotonic() - began < 5
    finally:
        call.release.set()
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as next_owner:
        next_owner.recover(handle.tree_id)
        tree = next_owner.wait_idle(handle.tree_id, timeout=30)
    [unknown] = [e for p in tree.processes.values() for e in p.unknown_effects()]
    assert unknown.diagnostic is not None and unknown.diagnostic.code == "engine.dispatch.interrupted"
    assert [c["index"] for c in log.calls()] == [0, 1]  # the abandoned call is not made again


def test_a_draining_runtime_takes_no_run_over_and_says_so(durable_store_url: str, tmp_path: Any) -> None:
    # recover(tree) on a draining runtime said "owned by another live runtime" (engine.tree.owned):
    # untrue, nobody owned it; the runtime asked was the one refusing, because it was draining.
    log = CallLog(tmp_path / "calls.jsonl")
    call = GatedCall(log, at=1)
    program = chain_program(call, name="drain.recover")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as owner:
        handle = owner.start(program, {"n": 3}, start_id="drain-2")
        assert call.entered.wait(30)
        owner.drain(0.0)  # the call stays in flight: the run is left to the next owner
    call.release.set()
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as other:
        assert other.drain(0.0)
        before = kinds(durable_store_url, handle.tree_id)
        try:
            other.recover(handle.tree_id)
        except AgentfoldError as exc:
            refused = exc
        else:
            raise AssertionError("a draining runtime took the run over")
        assert refused.code == "engine.runtime.draining" and refused.http_status == 503, refused.to_json()
        assert "draining" in str(refused) and "another live runtime" not in str(refused)
        assert kinds(durable_store_url, handle.tree_id) == before  # nothing appended
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as next_owner:
        assert len(next_owner.recover(handle.tree_id)) == 1  # a runtime that is not draining takes it
    assert "WriterActivated" in kinds(durable_store_url, handle.tree_id)[len(before):]
