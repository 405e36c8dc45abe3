"""FirstSuccess and Deadline across real process death (Scope ``coordination``: Restore).

A child process (``python -m tests.team.competition_programs``, see its ``main``) runs the
tree on a durable store and ends with ``os._exit(75)`` at a chosen point; this process then
recovers the tree from the store alone (a new Runtime, ``WriterActivated``) and checks what a
user observes: the result, the stored events, and the calls, which the module-level functions
log to a file (``AGENTFOLD_TEAM_LOG``) so that those made by the dead process count too.

* The Deadline's timer has replay policy ``same_identity``: recovery dispatches it again under
  the same Effect id and it fires at the original absolute instant, not after a restarted
  delay, with no unknown Effect.
* A FirstSuccess cut after its candidates started and before its winner was chosen finishes
  with the right winner; a candidate's call is never made again, nor is ``accept`` run again
  for an outcome already judged.
* A FirstSuccess cut after its completion was committed is not judged again: same output,
  ``accept`` not called again, the losers canceled. A losing Deadline whose timer was still
  in flight at that cut keeps its timer Effect unknown, as evidence: a new owner never
  re-dispatches an Effect of a Process that is stopping (kernel spec 3.8: the replay policy is
  forced to ``never`` under a terminal intent), and the run's outcome no longer depends on it.

The child computes the Deadline's instant itself (now + seconds) and logs its input, so the
interpreter's start does not eat into the time left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.domain.coordination import parse_instant
from agentfold.domain.events import (
    EffectDeclared,
    EffectDispatched,
    EffectSettled,
    ProcessTerminated,
    StepCommitted,
    WriterActivated,
)
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import Settlement
from tests.interaction.support import child_by_key, open_runtime, recover
from tests.interaction.tools import WAIT, wait_until
from tests.team import competition_programs as C
from tests.team import programs as P

ROOT = Path(__file__).resolve().parents[2]
CRASH_EXIT = 75
#: How late a timer may fire (its dispatcher return) after its instant, or after its
#: re-dispatch when recovery began after the instant: slack for a loaded machine. A restarted
#: delay in test a fires at least 2 s late (the child held the timer 2 s of its 4 s).
TIMER_LATE = 1.0
#: How late after the instant (or the recovery, if later) this process may see the result.
RESULT_LATE = 2.0


def crash(store_url: str, name: str, start_id: str, seconds: float, mode: str, **env: str) -> None:
    """Run the tree in a child process and require that it died on purpose (exit 75)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.team.competition_programs", store_url, name, start_id, str(seconds), mode],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **env},
    )
    assert done.returncode == CRASH_EXIT, (
        f"the child exited {done.returncode}, not {CRASH_EXIT}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    )


def unknown(tree: Any) -> list[tuple[str, Any]]:
    """(child key of the Process, effect id) of every unknown Effect in the tree."""
    return [(str(p.child_key), r.effect_id) for p in tree.processes.values() for r in p.unknown_effects()]


def of_type(records: list[Any], kind: type, **fields: Any) -> list[Any]:
    """The stored records whose event is a ``kind`` with these field values."""
    return [r for r in records if isinstance(r.event, kind)
            and all(getattr(r.event, k) == v for k, v in fields.items())]


def finish(runtime: Any, tree_id: Any) -> tuple[Any, float, Any]:
    """The recovered run's result, when it was seen, and its settled tree (no unknown Effect)."""
    result = runtime.result(tree_id, WAIT)
    seen_at = time.time()
    tree = runtime.wait_idle(tree_id)
    assert unknown(tree) == []
    return result, seen_at, tree


def assert_completed_on_time(result: Any, seen_at: float, instant: float, recovered_at: float) -> None:
    """Completed, not before the instant, and not later than the instant (or the recovery,
    when it began after the instant) plus slack: a restarted delay would be later."""
    assert result.status == "completed", result.termination
    assert instant <= seen_at < max(instant, recovered_at) + RESULT_LATE, (
        f"the result came {seen_at - instant:+.3f}s from the instant")


def recover_deadline(url: str, start_id: str) -> tuple[list[Any], Any, float, float, Any, list[Any]]:
    """Recover the dead child's Deadline run here: (its records before, result, when seen,
    when recovery began, the settled tree, its records after). It was still running."""
    tree_id = TreeID.for_start(start_id)  # type: ignore[arg-type]
    store = EventStore(url)
    try:
        stored = store.read(tree_id)
        with open_runtime(store, C.build("deadline")) as runtime:
            assert runtime.capture(tree_id).root.status == "running"
            recovered_at = time.time()
            recover(runtime, tree_id)
            result, seen_at, tree = finish(runtime, tree_id)
        return stored, result, seen_at, recovered_at, tree, store.read(tree_id)
    finally:
        store.close()


def started_input() -> Any:
    [value] = P.entries("input")
    return value


def check_timer_replayed(records: list[Any], process_id: Any, instant: float, *, child_entered: bool = True) -> None:
    """The Deadline ``process_id`` has one timer Effect, dispatched twice under that id (once
    by the dead process, once by the recovery, after ``WriterActivated``), settled once,
    succeeded (never unknown), fired in this process at its original instant: never before
    it, and within ``TIMER_LATE`` of it (or of the re-dispatch, when recovery began after the
    instant). ``child_entered``: the dead child is known to have entered the dispatcher
    (otherwise it may have died before its dispatch thread ran: at most one call there)."""
    [declared] = of_type(records, EffectDeclared, process_id=process_id)
    effect_id = declared.event.effect_id
    assert declared.event.target == "dispatcher" and declared.event.replay == "same_identity"
    dispatched = of_type(records, EffectDispatched, effect_id=effect_id)
    assert len(dispatched) == 2, [r.event for r in dispatched]
    first, second = dispatched
    assert first.event.attempt_id != second.event.attempt_id
    [activated] = of_type(records, WriterActivated)
    assert first.position < activated.position < second.position
    assert second.event.incarnation_id == activated.event.incarnation_id
    [settled] = of_type(records, EffectSettled, effect_id=effect_id)
    assert settled.event.status == "succeeded"
    assert C.timestamp(settled.timestamp) >= instant  # committed after the instant, not before
    # Outside the process: the dead child's dispatcher was entered (attempt 1), then this
    # process's (attempt 2), with the same effect id and the same absolute instant; only the
    # second one returned (fired).
    calls = P.entries("timer")
    there = [c for c in calls if c["pid"] != os.getpid()]
    [here] = [c for c in calls if c["pid"] == os.getpid()]
    assert len(there) == 1 if child_entered else len(there) <= 1
    assert all(c["effect"] == str(effect_id) and c["deadline"] == here["deadline"] for c in calls)
    assert here["attempt"] == str(second.event.attempt_id)
    assert all(c["attempt"] == str(first.event.attempt_id) for c in there)
    [fired] = P.entries("timer-returned")
    assert fired["status"] == "succeeded" and fired["pid"] == os.getpid()
    due = max(instant, here["at"])
    assert instant <= fired["at"] < due + TIMER_LATE, (
        f"the timer fired {fired['at'] - instant:+.3f}s from its instant (re-dispatched at "
        f"{here['at'] - instant:+.3f}s)"
    )


# ---------------------------------------------------------------------------
# a. A Deadline whose process died while its timer waited


def test_a_deadline_cut_while_its_timer_waits_fires_at_its_original_instant(durable_store_url: str) -> None:
    """The child starts a Deadline for now + 4 s, lets its timer wait for 2 s (its dispatch
    permission committed, the dispatcher inside its wait), and dies. Recovery here dispatches
    the timer again under the same Effect id: the run completes with the instant in canonical
    UTC text, not before the instant and not after a restarted 4 s delay (which would end
    about 2 s late); two dispatch attempts of one Effect, no unknown Effect."""
    start_id = "start:deadline-cut"
    crash(durable_store_url, "deadline", start_id, 4.0, "timer-waits:2.0")
    given = started_input()
    instant = C.timestamp(given)
    [entered] = P.entries("timer")
    assert entered["deadline"] == parse_instant(given) and entered["deadline"].endswith("Z")
    assert P.entries("timer-returned") == []  # the dead child's timer never fired
    [died] = P.entries("died-after")
    assert died["at"] - entered["at"] >= 2.0 and died["at"] < instant  # it died while its timer waited
    stored, result, seen_at, recovered_at, tree, records = recover_deadline(durable_store_url, start_id)
    assert len(of_type(stored, EffectDispatched)) == 1 and of_type(stored, EffectSettled) == []
    assert_completed_on_time(result, seen_at, instant, recovered_at)
    assert result.output == parse_instant(given) == entered["deadline"]
    check_timer_replayed(records, tree.root.process_id, instant)
    assert len(of_type(records, EffectDeclared)) == 1  # no second timer was declared
    assert of_type(records, EffectSettled, status="unknown") == []
    [done] = of_type(records, ProcessTerminated)
    assert done.event.status == "completed" and done.event.cause == "completion"


def test_a_deadline_cut_after_its_timer_fired_and_before_it_was_recorded_fires_again(durable_store_url: str) -> None:
    """Crash point ``in-dispatch:1`` on a timer: the child dies right after its timer fired,
    before the outcome was recorded. Recovery dispatches the timer again under the same Effect
    id; its instant has passed, so it fires at once: completed, no unknown Effect."""
    start_id = "start:deadline-fired"
    crash(durable_store_url, "deadline", start_id, 0.5, "crash:in-dispatch:1")
    instant = C.timestamp(started_input())
    [fired] = P.entries("timer-returned")
    assert fired["status"] == "succeeded" and fired["pid"] != os.getpid() and fired["at"] >= instant
    stored, result, seen_at, recovered_at, _, records = recover_deadline(durable_store_url, start_id)
    assert of_type(stored, EffectSettled) == []  # the child died before recording it
    assert_completed_on_time(result, seen_at, instant, recovered_at)
    [declared] = of_type(records, EffectDeclared)
    first, second = of_type(records, EffectDispatched, effect_id=declared.event.effect_id)
    [activated] = of_type(records, WriterActivated)
    assert first.position < activated.position < second.position
    [settled] = of_type(records, EffectSettled)
    assert settled.event.status == "succeeded" and settled.event.attempt_id == second.event.attempt_id
    there, here = P.entries("timer-returned")  # each owner's timer fired once
    assert (there["pid"], here["pid"]) == (fired["pid"], os.getpid()) and here["status"] == "succeeded"


# ---------------------------------------------------------------------------
# b. A race cut after its candidates started and before its winner was chosen


@pytest.mark.parametrize("cut", ["after_an_outcome", "inside_a_call"])
def test_a_race_cut_before_its_winner_finishes_with_the_right_winner_after_recovery(
    durable_store_url: str, cut: str
) -> None:
    """Candidates: ``a`` a gate nobody answers, ``b`` a transform of "reject" (``accept``
    rejects its output), ``d`` a Deadline a few seconds away. All three start in the child, then:

    * after_an_outcome: ``b`` (``test.echo``) is called, its outcome judged (rejected) and the
      competition waits again; the child dies right after that append, ``d``'s timer waiting.
    * inside_a_call: the child dies inside ``b``'s call (``test.crashing``), before any outcome.
      Recovery finds that call unknown (never made again); the host resolves it with the
      output the call produced; the competition judges it (rejected) and waits on.

    Either way ``d``'s timer is dispatched again under its id and fires at its original
    instant; ``d`` wins (index 2), ``a`` is canceled, ``b``'s outcome is kept. ``b``'s call ran
    once in all (in the dead child), and ``accept`` once per outcome: "b", then "d"."""
    name, seconds, call, text = {
        "after_an_outcome": ("race-reject", 3.0, "echo", "echo: reject"),
        "inside_a_call": ("race-crash", 5.0, "crashing", "done: reject"),
    }[cut]
    start_id = f"start:race-cut-{cut}"
    if cut == "after_an_outcome":
        crash(durable_store_url, name, start_id, seconds, "after:outcomes")
        [died] = P.entries("died-after")
        assert died["facts"] == {"op": "outcomes"}  # an outcome recorded, no winner yet
        assert P.entries("accept") == ["b"]
    else:
        crash(durable_store_url, name, start_id, seconds, "run", AGENTFOLD_TEAM_CRASH="worker")
        assert P.entries("accept") == []
    assert P.entries(call) == ["reject"]
    given = started_input()
    instant = C.timestamp(given[2]["input"])
    tree_id = TreeID.for_start(start_id)  # type: ignore[arg-type]
    program = C.build(name)
    store = EventStore(durable_store_url)
    try:
        with open_runtime(store, program) as runtime:
            stored = runtime.capture(tree_id)
            assert not stored.root.terminal and "winner" not in stored.root.state
            b_status = "completed" if cut == "after_an_outcome" else "running"
            assert [child_by_key(stored, k).status for k in "abd"] == ["waiting", b_status, "running"]
            recovered_at = time.time()
            recover(runtime, tree_id)
            if cut == "inside_a_call":
                wait_until(lambda: unknown(runtime.capture(tree_id)) != [], "b's call to be found unknown")
                [(key, effect_id)] = unknown(runtime.capture(tree_id))
                assert key == "b" and P.entries(call) == ["reject"]
                runtime.resolve_unknown_effect(effect_id, Settlement.succeeded({"output": text}))
                assert time.time() < instant, "the deadline passed before the host resolved b's call"
            result, seen_at, tree = finish(runtime, tree_id)
        records = store.read(tree_id)
    finally:
        store.close()
    assert_completed_on_time(result, seen_at, instant, recovered_at)
    output = result.output
    assert output["winner"] == 2
    a, b, d = output["candidates"]
    assert set(a) == {"start"} and a["start"]["key"] == "a"
    assert b["outcome"]["key"] == "b" and b["outcome"]["result"]["status"] == "completed"
    assert b["outcome"]["result"]["output"] == text
    assert d["outcome"]["key"] == "d" and d["outcome"]["result"]["status"] == "completed"
    assert d["outcome"]["result"]["output"] == parse_instant(given[2]["input"])
    assert [child_by_key(tree, k).status for k in "abd"] == ["canceled", "completed", "completed"]
    # Nothing ran twice: b's call only in the dead child; accept once per outcome.
    assert P.entries(call) == ["reject"]
    assert P.entries("accept") == ["b", "d"]
    # The dead child may not have entered d's timer yet (its dispatch thread not scheduled).
    check_timer_replayed(records, child_by_key(tree, "d").process_id, instant, child_entered=False)
    root = tree.root.process_id
    judged = [r.event.facts for r in of_type(records, StepCommitted, process_id=root)
              if r.event.facts.get("op") == "outcomes"]
    assert judged == [{"op": "outcomes"}, {"op": "outcomes", "winner": 2}]


# ---------------------------------------------------------------------------
# c. A race cut right after its completion was committed


def race_cut_after_completion(store_url: str) -> tuple[dict[str, Any], Any, Any, Any, list[Any]]:
    """Candidates: ``a`` a gate nobody answers, ``b`` an echo of "win", ``d`` a Deadline a
    minute away. ``b`` wins in the child, which dies right after the append holding the
    competition's completion (``a``'s cancellation is in it; ``d``'s timer is still in flight).
    Returns what the child committed, the stored root before recovery, the result, the tree
    and the stored records after recovery."""
    start_id = "start:race-cut-after-completion"
    crash(store_url, "race-win", start_id, 60.0, "after:root-terminated")
    [died] = P.entries("died-after")
    assert died["status"] == "completed" and died["output"]["winner"] == 1
    assert P.entries("echo") == ["win"] and P.entries("accept") == ["b"]
    tree_id = TreeID.for_start(start_id)  # type: ignore[arg-type]
    program = C.build("race-win")
    store = EventStore(store_url)
    try:
        with open_runtime(store, program) as runtime:
            before = runtime.capture(tree_id)
            assert before.root.status == "completed"
            assert [child_by_key(before, k).status for k in "abd"] == ["canceled", "completed", "running"]
            recover(runtime, tree_id)
            result = runtime.result(tree_id, WAIT)
            tree = runtime.wait_idle(tree_id)
        records = store.read(tree_id)
    finally:
        store.close()
    return died, before.root, result, tree, records


def test_a_race_cut_after_its_completion_is_not_judged_again(durable_store_url: str) -> None:
    """After recovery the result is the committed one (winner ``b``, index 1), ``accept`` was
    not called again (one call in all, in the dead child), ``b``'s call ran once, the root
    took no further Step, and both losers are canceled (``d``'s timer never fired)."""
    died, root_before, result, tree, records = race_cut_after_completion(durable_store_url)
    assert result.status == "completed" and result.output == died["output"] == root_before.output
    assert result.output["winner"] == 1
    assert result.output["candidates"][1]["outcome"]["result"]["output"] == "echo: win"
    assert P.entries("accept") == ["b"] and P.entries("echo") == ["win"]
    root = tree.root.process_id
    assert len(of_type(records, StepCommitted, process_id=root)) == 4  # declare, starts, wait, outcomes
    assert len(of_type(records, ProcessTerminated, process_id=root)) == 1
    assert [child_by_key(tree, k).status for k in "abd"] == ["canceled", "completed", "canceled"]
    assert all(c["status"] != "succeeded" for c in P.entries("timer-returned"))


def test_a_losing_deadline_cut_by_the_crash_keeps_its_timer_unknown_as_evidence(durable_store_url: str) -> None:
    """Same cut as above: the losing Deadline ``d`` had its timer waiting when the child died,
    its cancellation recorded but its timer not yet settled. Recovery does not wait for the
    timer again (its Process is stopping): it records it unknown (``engine.dispatch.interrupted``)
    and ``d`` ends canceled with it as unresolved evidence; the race's result is unaffected and a
    host cannot (and need not) resolve it. docs/team.md (Deadline) says so."""
    from agentfold.domain.errors import AgentfoldError

    runtime_url = durable_store_url
    _, _, result, tree, records = race_cut_after_completion(runtime_url)
    assert result.status == "completed" and result.output["winner"] == 1
    d = child_by_key(tree, "d")
    assert d.status == "canceled"
    [(key, timer)] = unknown(tree)
    assert key == "d"
    assert [r.event.effect_id for r in of_type(records, EffectSettled, status="unknown")] == [timer]
    with open_runtime(runtime_url, C.build("race-win")) as runtime:
        with pytest.raises(AgentfoldError) as caught:
            runtime.resolve_unknown_effect(timer, Settlement.failed({"error": "stopped"}))
        assert caught.value.code == "engine.process.finished"
