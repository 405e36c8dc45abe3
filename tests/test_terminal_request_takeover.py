"""A cancel (kill, deadline) that takes over a run nobody drives (docs/team.md, "Cancellation";
docs/concepts.md, "Control"; docs/cli.md, "cancel").

When every call the takeover makes again is a timer, the request is applied in the takeover's
own append, right after the activation and before any other Step; otherwise it is recorded
first (the call is not made again). Found by the review of 65e56a9, which applied it after the
takeover's Steps: a tool call planned but never started (left by a command whose ``--timeout``
ran out) was made by the ``cancel`` itself; a cancel sent again after the owner that recorded the
first one died was refused (the Steps had ended the run on the takeover's copy) and the run was
left undriven; an overdue timer re-armed by the takeover fired before it was stopped, or not.
Real stores (SQLite, PostgreSQL) and the real console script.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import FirstSuccessConfig, compile_deadline, compile_first_success
from agentfold.domain.events import ControlRequested, EffectSettled, WriterActivated
from agentfold.domain.program import Replay
from tests.interaction.support import open_runtime
from tests.interaction.tools import WAIT, wait_until
from tests.kernel_programs import CallLog, GatedCall, chain_program
from tests.team.test_timers import soon
from tests.test_cli import agentfold, ok, sqlite_url
from tests.test_cli_interaction import write


def test_cancel_never_makes_a_call_that_was_planned_but_not_started(tmp_path: Path) -> None:
    """``run --timeout 0`` leaves the second tool call declared, not started; ``cancel`` ends the
    run without making it (it made it, then canceled the run)."""
    store = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    doc = {
        "name": "charge-then-answer",
        "side_effect_log": str(log),
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "c1", "name": "lookup", "arguments": "{}"},
                {"id": "c2", "name": "charge_card", "arguments": '{"amount": 100}'}]}},
            {"finish_reason": "stop", "message": {"content": "charged"}},
        ]},
        "tools": [{"name": "lookup", "description": "Look up.", "result": {"output": "found"}},
                  {"name": "charge_card", "description": "Charge the card.", "result": {"output": "charged 100"}}],
    }
    ran = agentfold("run", str(write(tmp_path, doc)), "--timeout", "0", "--json", store=store)
    assert ran.code == 1, ran.stdout + ran.stderr  # cli.drive_failed: calls left for the next owner
    [tree] = ok(agentfold("trees", "--json", store=store)).json()["trees"]
    shown = ok(agentfold("show", tree["tree_id"], "--json", store=store)).json()
    before = [json.loads(line)["call_id"] for line in log.read_text().splitlines()] if log.exists() else []
    assert "c2" not in before
    canceled = ok(agentfold("cancel", shown["root_id"], "--json", store=store)).json()
    assert canceled["tree"]["status"] == "canceled", canceled
    after = [json.loads(line)["call_id"] for line in log.read_text().splitlines()] if log.exists() else []
    assert "c2" not in after, after  # never made: "Effects not yet started never start"
    assert after == before


def test_a_cancel_sent_again_after_the_recording_owner_died_carries_it_out(durable_store_url: str) -> None:
    """docs/cli.md, "cancel": when the owner died before carrying a recorded cancellation out, a
    cancel sent again says "already canceling" (False), takes the run over and carries it out."""
    deadline = compile_deadline("test.deadline")
    store = EventStore(durable_store_url)
    try:
        with open_runtime(store, deadline) as runtime:
            handle = runtime.start(deadline, soon(3600), start_id="resent-cancel")
            wait_until(lambda: runtime.timers_waiting() == 1, "the timer to wait")
        with open_runtime(store, deadline, adopt_on_admit=False) as recorder:  # recorded, not carried out
            assert recorder.cancel(handle.root_process_id, "first") is True
        with open_runtime(store, deadline, poll_interval=0) as command:
            assert command.cancel(handle.root_process_id, "again") is False  # already canceling
            assert command.result(handle.tree_id, WAIT).status == "canceled"
        events = [r.event for r in store.read(handle.tree_id)]
        assert sum(isinstance(e, ControlRequested) for e in events) == 1
        assert sum(isinstance(e, WriterActivated) for e in events) == 1
        # The documented exception (docs/team.md): recorded by an owner that did not carry it out,
        # the timer of the ending Process is not waited for again: unknown, evidence only.
        [settled] = [e for e in events if isinstance(e, EffectSettled)]
        assert (settled.status, settled.diagnostic.code) == ("unknown", "engine.dispatch.interrupted")
    finally:
        store.close()


def test_a_canceled_overdue_timer_is_stopped_never_fired(durable_store_url: str) -> None:
    """A Deadline whose instant passed while nobody drove it, canceled by a command: its timer,
    made again by the takeover, is stopped before it is armed (failed), every time. It fired
    (succeeded) or was stopped depending on which thread came first."""
    deadline = compile_deadline("test.deadline")
    store = EventStore(durable_store_url)
    try:
        handles = []
        with open_runtime(store, deadline) as runtime:
            for i in range(4):
                handles.append(runtime.start(deadline, soon(1.0 + 0.1 * i), start_id=f"overdue-{i}"))
            wait_until(lambda: runtime.timers_waiting() == 4, "the timers to wait")
        time.sleep(1.6)  # every instant passed while nobody drove the runs
        with open_runtime(store, deadline, poll_interval=0) as command:
            for handle in handles:
                assert command.cancel(handle.root_process_id, "too late") is True
                assert command.result(handle.tree_id, WAIT).status == "canceled"
        for handle in handles:
            [settled] = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectSettled)]
            assert (settled.status, settled.diagnostic) == ("failed", None), settled
    finally:
        store.close()


def accept_none(key: str, outcome: Any) -> bool:
    """No candidate's outcome is accepted: the race goes on until a host ends it."""
    return False


def test_cancelling_a_deadline_beside_a_sibling_call_made_again_stops_the_timer_failed(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Found by the review of 661d921: a race of a same_identity worker (its call in flight) and
    a Deadline, whose owner went away; a host cancels the Deadline only. The cancel was recorded
    first because the takeover makes the worker's call again, so the timer was unknown, though
    the worker is not ended by the cancel (its call is made again either way). Only calls of
    the Processes the request ends decide it."""
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log)
    worker = chain_program(gate, replay=Replay.SAME_IDENTITY, name="test.si_worker")
    deadline = compile_deadline("test.deadline")
    race = compile_first_success(FirstSuccessConfig(
        name="test.race_si", candidates=[worker, deadline], accept=accept_none, max_candidates=2,
        description="A same_identity worker against a Deadline."))
    programs = (race, worker, deadline)
    store = EventStore(durable_store_url)
    try:
        runtime = Runtime(store, Catalog(list(programs)))
        try:
            handle = runtime.start(race, [{"key": "w", "program": "test.si_worker", "input": {"n": 1}},
                                          {"key": "d", "program": "test.deadline", "input": soon(3600)}],
                                   start_id="race-si")
            assert gate.entered.wait(WAIT)
            wait_until(lambda: runtime.timers_waiting() == 1, "the timer to wait")
        finally:
            runtime.close(timeout=0.5)  # the owner goes away with the worker's call and the timer in flight
            gate.release.set()
        assert log.count() == 1
        with open_runtime(store, *programs, poll_interval=0) as command:
            tree = command.capture(handle.tree_id)
            [d] = [p for p in tree.processes.values() if str(p.child_key) == "d"]
            assert command.cancel(d.process_id, "no longer needed") is True
            wait_until(lambda: log.count() == 2, "the worker's call, made again (its Process goes on)")
            tree = command.wait_idle(handle.tree_id, timeout=WAIT)
        [d] = [p for p in tree.processes.values() if str(p.child_key) == "d"]
        assert d.status == "canceled" and not d.unknown_effects()
        [settled] = [r.event for r in store.read(handle.tree_id)
                     if isinstance(r.event, EffectSettled) and r.event.process_id == d.process_id]
        assert settled.status == "failed", settled
    finally:
        store.close()
