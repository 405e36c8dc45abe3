"""The coordination FirstSuccess and Deadline (reference section 8.4; Scope
``coordination/first_success.go``, ``deadline.go``, ``deadline_dispatcher.go``), as root
Programs on real stores.

FirstSuccess races the candidates its input names: the first completed one that ``accept``
accepts wins, a failed start is kept as an explicit result, the candidates still running are
canceled when it completes, and no winner is a business result. Deadline completes at an
absolute instant; a cancel stops its timer without an unknown outcome. Adaptations: Scope's
candidates are any Deployment the engine resolves; ours are the Programs bound to the
competition, named in the input by Program name. Scope's ``Restore`` is the fold of stored
events (crash tests in test_competition_recovery.py). Where one satisfaction brings several
outcomes (request order decides), the interleaving is produced by driving the Strategy with a
satisfaction Signal as the kernel builds it, because which children finish before the wait opens
is a race on a real Runtime.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.team import (
    FIRST_COMPLETED,
    DeadlineDispatcher,
    FirstSuccessConfig,
    InputGateConfig,
    compile_deadline,
    compile_first_success,
    compile_input_gate,
)
from agentfold.domain.competition import FirstSuccessStrategy
from agentfold.domain.coordination import DeadlineStrategy, parse_instant
from agentfold.domain.errors import AgentfoldError, ClassifiedError, InvalidInput
from agentfold.domain.events import EffectDispatched, EffectSettled
from agentfold.domain.ids import SignalID, TreeID, WaitID
from agentfold.domain.program import Complete, Continue, Signal, SignalRequest
from agentfold.domain.requests import Settlement
from tests.interaction.support import child_by_key, open_runtime
from tests.interaction.tools import WAIT, wait_until

TEXT = {"type": "string"}
WAIT_ID = "wait:" + "1" * 64


def gate(name: str) -> Any:
    return compile_input_gate(InputGateConfig(name=name, answer_schema=TEXT))


def only_yes(key: str, outcome: dict[str, Any]) -> bool:
    return outcome["result"]["output"]["payload"] == "yes"


def broken_accept(key: str, outcome: dict[str, Any]) -> bool:
    raise RuntimeError("the scorer is down")


def race(*candidates: Any, accept: Any = FIRST_COMPLETED, max_candidates: int = 4) -> Any:
    return compile_first_success(FirstSuccessConfig(name="test.race", candidates=list(candidates), accept=accept,
                                                    max_candidates=max_candidates))


def waiting_child(runtime: Any, tree_id: Any, key: str) -> Any:
    def found() -> Any:
        for process in runtime.capture(tree_id).processes.values():
            if process.child_key == key and process.current_wait is not None:
                return process
        return None

    wait_until(lambda: found() is not None, f"candidate {key} to wait")
    return found()


def answer(runtime: Any, tree_id: Any, key: str, text: str) -> None:
    process = waiting_child(runtime, tree_id, key)
    assert runtime.deliver_signals(process.process_id, [SignalRequest(f"signal:{key}", text, process.current_wait)])


def refused_at_start(tmp_path: Any, program: Any, value: Any, start_id: str) -> tuple[AgentfoldError, list[Any], list[Any]]:
    """Start ``program`` with ``value`` on a fresh SQLite store, which must be refused: the
    error, then what the store holds (its trees, the events of ``start_id``'s tree)."""
    store = EventStore(f"sqlite:///{tmp_path / 'refused.db'}")
    try:
        with open_runtime(store, program) as runtime:
            with pytest.raises(AgentfoldError) as caught:
                runtime.start(program, value, start_id=start_id)
        return caught.value, store.tree_ids(), store.read(TreeID.for_start(start_id))
    finally:
        store.close()


def soon(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


# ---------------------------------------------------------------------------
# FirstSuccess on a real Runtime


def test_the_first_accepted_candidate_wins_and_the_others_are_canceled(store_url: str) -> None:
    """Candidate b answers first and is accepted: it wins (index 1); a, still running, keeps its
    start receipt in the output and is canceled by the completion."""
    program = race(gate("gate.a"), gate("gate.b"))
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, [{"key": "a", "program": "gate.a", "input": "qa"},
                                         {"key": "b", "program": "gate.b", "input": "qb"}])
        waiting_child(runtime, handle.tree_id, "a")
        answer(runtime, handle.tree_id, "b", "hello")
        result = handle.result(WAIT)
        assert result.status == "completed", result.termination
        output = result.output
        assert output["winner"] == 1
        a, b = output["candidates"]
        assert set(a) == {"start"} and a["start"]["key"] == "a" and a["start"]["process_id"].startswith("process:")
        assert b["outcome"]["key"] == "b" and b["outcome"]["result"]["status"] == "completed"
        assert b["outcome"]["result"]["output"]["payload"] == "hello"
        tree = runtime.capture(handle.tree_id)
        assert child_by_key(tree, "a").status == "canceled"
        assert child_by_key(tree, "b").status == "completed"
        assert tree.root.unknown_effects() == []


def test_a_rejected_result_keeps_the_race_going_and_no_winner_is_a_result(store_url: str) -> None:
    """``accept`` rejects b's "no": the race waits on; a's "yes" wins. With both rejected the
    competition completes without a winner, every outcome kept in request order."""
    program = race(gate("gate.a"), gate("gate.b"), accept=only_yes)
    with open_runtime(store_url, program) as runtime:
        requests = [{"key": "a", "program": "gate.a", "input": "qa"}, {"key": "b", "program": "gate.b", "input": "qb"}]
        handle = runtime.start(program, requests)
        answer(runtime, handle.tree_id, "b", "no")
        wait_until(lambda: child_by_key(runtime.capture(handle.tree_id), "b").terminal, "b to finish")
        assert not runtime.capture(handle.tree_id).root.terminal
        answer(runtime, handle.tree_id, "a", "yes")
        result = handle.result(WAIT)
        assert result.output["winner"] == 0
        assert [c["outcome"]["result"]["output"]["payload"] for c in result.output["candidates"]] == ["yes", "no"]

        second = runtime.start(program, requests, start_id="race:none")
        answer(runtime, second.tree_id, "a", "no")
        answer(runtime, second.tree_id, "b", "nope")
        result = second.result(WAIT)
        assert result.status == "completed"
        assert "winner" not in result.output
        assert [set(c) for c in result.output["candidates"]] == [{"outcome"}, {"outcome"}]


def test_a_failed_start_is_kept_and_does_not_end_the_race(store_url: str) -> None:
    """A candidate asking for a capability the competition lacks cannot start: its failed receipt
    is an explicit result; the other candidate still wins. When every start fails, the
    competition completes at once without a winner."""
    program = race(gate("gate.a"), gate("gate.b"))
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, [{"key": "a", "program": "gate.a", "input": "qa", "capabilities": ["payments"]},
                                         {"key": "b", "program": "gate.b", "input": "qb"}])
        answer(runtime, handle.tree_id, "b", "ok")
        result = handle.result(WAIT)
        assert result.output["winner"] == 1
        failed = result.output["candidates"][0]["start"]
        assert failed["failure"]["code"] == "engine.child.capability_escalation"
        assert "process_id" not in failed

        none = runtime.start(program, [{"key": "a", "program": "gate.a", "input": "qa", "capabilities": ["x"]}],
                             start_id="race:nostart")
        result = none.result(WAIT)
        assert result.status == "completed" and "winner" not in result.output
        assert result.output["candidates"][0]["start"]["failure"]["code"] == "engine.child.capability_escalation"


def test_a_candidate_input_its_schema_refuses_is_a_failed_start(store_url: str) -> None:
    strict = compile_input_gate(InputGateConfig(name="gate.strict", answer_schema=TEXT, request_schema=TEXT))
    program = race(strict, gate("gate.b"))
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, [{"key": "a", "program": "gate.strict", "input": 5},
                                         {"key": "b", "program": "gate.b", "input": "qb"}])
        answer(runtime, handle.tree_id, "b", "ok")
        result = handle.result(WAIT)
        assert result.output["winner"] == 1
        assert result.output["candidates"][0]["start"]["failure"]["code"] == "engine.child.input.invalid"


def test_an_accept_that_raises_fails_the_competition_and_cancels_the_rest(store_url: str) -> None:
    program = race(gate("gate.a"), gate("gate.b"), accept=broken_accept)
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, [{"key": "a", "program": "gate.a", "input": "qa"},
                                         {"key": "b", "program": "gate.b", "input": "qb"}])
        answer(runtime, handle.tree_id, "a", "yes")
        result = handle.result(WAIT)
        assert result.status == "failed"
        failure = result.termination["failure"]
        assert (failure["kind"], failure["code"]) == ("execution", "coordination.accept.failed")
        assert "the scorer is down" in failure["message"] and "'a'" in failure["message"]
        assert child_by_key(runtime.capture(handle.tree_id), "b").status == "canceled"


def test_a_deadline_candidate_bounds_how_long_the_others_may_take(store_url: str) -> None:
    """The timeout pattern: race a worker against a Deadline. Nobody answers the gate; the
    Deadline completes at its instant and wins; the gate is canceled."""
    program = race(gate("gate.a"), compile_deadline("timeout"))
    with open_runtime(store_url, program) as runtime:
        begun = time.monotonic()
        handle = runtime.start(program, [{"key": "work", "program": "gate.a", "input": "q"},
                                         {"key": "timeout", "program": "timeout", "input": soon(0.8)}])
        result = handle.result(WAIT)
        assert time.monotonic() - begun >= 0.6
        assert result.output["winner"] == 1
        assert result.output["candidates"][1]["outcome"]["result"]["output"].endswith("Z")
        assert child_by_key(runtime.capture(handle.tree_id), "work").status == "canceled"


@pytest.mark.parametrize(
    ("candidates", "needle"),
    [
        ([], "fewer than 1 items"),
        ([{"key": f"k{i}", "program": "gate.a"} for i in range(3)], "more than 2 items"),
        ([{"key": "a", "program": "gate.a"}, {"key": "a", "program": "gate.b"}], "used twice"),
        ([{"key": "a", "program": "nobody"}], "not one of ['gate.a', 'gate.b']"),
        ([{"key": "a", "program": "gate.a", "budget": {"tokens": 3}}], "budget"),
        ([{"key": " ", "program": "gate.a"}], "child key"),
        ({"key": "a", "program": "gate.a"}, "array"),
        ([{"key": "a", "program": "gate.a", "extra": 1}], "extra"),
    ],
)
def test_bad_candidates_are_refused_and_nothing_is_stored(tmp_path: Any, candidates: Any, needle: str) -> None:
    program = race(gate("gate.a"), gate("gate.b"), max_candidates=2)
    error, trees, events = refused_at_start(tmp_path, program, candidates, "race:bad")
    # the input schema, then the Program's own checks (the Strategy's initial)
    assert error.code in ("engine.start.input_invalid", "engine.process.start.failed"), error
    assert needle in str(error)
    assert events == []
    assert trees == []


def test_compile_refuses_a_bad_configuration() -> None:
    a = gate("gate.a")

    async def later(key: str, outcome: Any) -> bool:
        return True

    # docs/team.md (Failure codes): every FirstSuccessConfig it refuses is
    # coordination.definition.invalid (a blank accept_identity and candidates that are no list
    # were program.invalid, although "a FirstSuccess without candidates" is documented).
    definition = "coordination.definition.invalid"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"candidates": [a], "accept": FIRST_COMPLETED, "max_candidates": 0}, definition),
        ({"candidates": [a], "accept": "yes"}, definition),
        ({"candidates": [], "accept": FIRST_COMPLETED}, definition),
        ({"candidates": None, "accept": FIRST_COMPLETED}, definition),
        ({"candidates": [a, gate("gate.a")], "accept": FIRST_COMPLETED}, definition),
        ({"candidates": ["gate.a"], "accept": FIRST_COMPLETED}, definition),
        ({"candidates": [a], "accept": later}, definition),
        ({"candidates": [a], "accept": FIRST_COMPLETED, "accept_identity": " "}, definition),
        ({"candidates": [a], "accept": FIRST_COMPLETED, "description": 5}, definition),
    ]
    for fields, code in bad:
        with pytest.raises(InvalidInput) as caught:
            compile_first_success(FirstSuccessConfig(name="test.race", **fields))
        assert caught.value.code == code, (fields, caught.value)
    with pytest.raises(InvalidInput) as caught:  # a Deadline's too (was program.invalid, from its Descriptor)
        compile_deadline("test.deadline", 5)  # type: ignore[arg-type]
    assert caught.value.code == definition, caught.value


def test_the_configuration_digest_names_the_predicate_and_the_bound() -> None:
    a = gate("gate.a")
    first = race(a)
    assert race(a).ref == first.ref
    assert race(a, accept=only_yes).ref != first.ref
    assert race(a, max_candidates=5).ref != first.ref
    assert race(a, gate("gate.b")).ref != first.ref


# ---------------------------------------------------------------------------
# FirstSuccess's rule inside one satisfaction (the Strategy, fed as the kernel feeds it)


def _satisfied(wait_id: str, *outcomes: tuple[str, str, str]) -> Signal:
    body = [{"boundary": "terminal_result", "key": key, "process_id": pid,
             "result": {"process_id": pid, "status": "completed", "usage": {}, "output": {"payload": text}}}
            for key, pid, text in outcomes]
    return Signal(SignalID("signal:engine:satisfied"), {"operation": "child_wait_satisfied", "wait_id": wait_id,
                  "key": "coordination.first_success.0", "boundary": "terminal_result", "outcomes": body},
                  WaitID(wait_id))


def _running_state() -> dict[str, Any]:
    return {
        "candidates": [{"key": "a", "program": "gate.a"}, {"key": "b", "program": "gate.b"}],
        "results": [{"start": {"key": "a", "process_id": "process:a"}}, {"start": {"key": "b", "process_id": "process:b"}}],
        "wait_id": WAIT_ID,
    }


@pytest.mark.parametrize(("accept", "winner"), [(FIRST_COMPLETED, 0), (only_yes, 1)])
def test_within_one_satisfaction_request_order_decides(accept: Any, winner: int) -> None:
    """Both candidates' results arrive together: the first accepted in request order wins,
    whatever their completion times."""
    strategy = FirstSuccessStrategy("test.race", "", [gate("gate.a"), gate("gate.b")], 4, accept)
    signal = _satisfied(WAIT_ID, ("a", "process:a", "no"), ("b", "process:b", "yes"))
    step = strategy.decide(_running_state(), [signal])
    assert isinstance(step.transition, Complete)
    assert step.transition.output["winner"] == winner
    assert step.facts == {"op": "outcomes", "winner": winner}
    # the fold (recovery) reaches the same state from the facts alone, without calling accept
    folded = FirstSuccessStrategy("test.race", "", [gate("gate.a"), gate("gate.b")], 4, broken_accept).evolve(
        _running_state(), step.facts, [signal])
    assert folded == step.next_state


def test_the_strategy_refuses_a_foreign_signal_and_a_corrupt_state() -> None:
    strategy = FirstSuccessStrategy("test.race", "", [gate("gate.a")], 4, FIRST_COMPLETED)
    stray = Signal(SignalID("signal:host"), "hi")
    with pytest.raises(ClassifiedError) as caught:
        strategy.decide(_running_state(), [stray])
    assert caught.value.failure.code == "coordination.protocol.invalid"
    for data in ({}, {"candidates": []}, {"candidates": [{}], "results": []},
                 {"candidates": [{}], "results": [None], "winner": 0}, {"candidates": [{}], "phase": "x"}):
        with pytest.raises(ClassifiedError) as caught:
            strategy.decode_state(data)
        assert caught.value.failure.code == "coordination.state.invalid"
    first = strategy.decide(strategy.initial([{"key": "a", "program": "gate.a", "input": "q"}]), [])
    assert isinstance(first.transition, Continue) and len(first.transition.effects) == 1


# ---------------------------------------------------------------------------
# Deadline


def test_a_deadline_completes_at_its_instant_with_that_instant(store_url: str) -> None:
    program = compile_deadline("test.deadline")
    instant = datetime.now(UTC) + timedelta(seconds=0.8)
    text = instant.astimezone(timezone_plus_one()).isoformat()  # the same instant, given at +01:00
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, text)
        result = handle.result(WAIT)
        assert datetime.now(UTC) >= instant
        assert result.status == "completed"
        assert result.output == parse_instant(text) and result.output.endswith("Z")
        assert datetime.fromisoformat(result.output) == instant

        past = runtime.start(program, "2020-01-01T00:00:00Z", start_id="deadline:past")
        begun = time.monotonic()
        assert past.result(WAIT).output == "2020-01-01T00:00:00Z"
        assert time.monotonic() - begun < 5


def timezone_plus_one() -> Any:
    from datetime import timezone

    return timezone(timedelta(hours=1))


def test_cancelling_a_waiting_deadline_stops_its_timer_without_an_unknown(store_url: str) -> None:
    program = compile_deadline("test.deadline")
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, soon(600))
        wait_until(lambda: runtime.capture(handle.tree_id).root.in_flight(), "the timer to run")
        begun = time.monotonic()
        assert runtime.cancel(handle.root_process_id, "no longer needed")
        result = handle.result(WAIT)
        assert time.monotonic() - begun < 10
        assert result.status == "canceled"
        assert runtime.capture(handle.tree_id).root.unknown_effects() == []
        store = runtime.store
        settled = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectSettled)]
        assert [s.status for s in settled] == ["failed"]


class RefusingTimer(DeadlineDispatcher):
    def due(self, request: Any) -> float | Settlement:
        return Settlement.failed({"error": "no clock here"})


class OldStyleTimer(DeadlineDispatcher):
    """Overrides ``dispatch`` (a timer written before TimerDispatcher): it is called, as an
    ordinary dispatcher (docs/team.md)."""

    def dispatch(self, request: Any, context: Any) -> Settlement:
        return Settlement.failed({"error": "no clock here"})


@pytest.mark.parametrize("timer", [RefusingTimer, OldStyleTimer])
def test_a_timer_that_returns_early_fails_the_deadline_as_interrupted(store_url: str, timer: Any) -> None:
    program = compile_deadline("test.deadline", dispatcher=timer())
    with open_runtime(store_url, program) as runtime:
        result = runtime.start(program, soon(60)).result(WAIT)
        assert result.status == "failed"
        failure = result.termination["failure"]
        assert (failure["kind"], failure["code"]) == ("external", "coordination.deadline.interrupted")


@pytest.mark.parametrize("value", ["2026-12-03T06:00:00", "tomorrow", 1700000000, None, "2026-13-03T06:00:00Z"])
def test_a_bad_deadline_is_refused_and_nothing_is_stored(tmp_path: Any, value: Any) -> None:
    error, trees, _ = refused_at_start(tmp_path, compile_deadline("test.deadline"), value, "deadline:bad")
    assert error.code in ("engine.start.input_invalid", "engine.process.start.failed"), error
    assert "deadline" in str(error)
    assert trees == []


def test_the_timer_is_replayed_under_its_identity_and_only_a_valid_one() -> None:
    """Recovery may wait again for the same instant (policy same_identity); nothing else of the
    Deadline is ever replayed."""
    program = compile_deadline("test.deadline")
    strategy = program.strategy
    assert isinstance(strategy, DeadlineStrategy)
    step = strategy.decide(strategy.initial("2026-12-03T07:00:00+01:00"), [])
    (effect,) = step.transition.effects  # type: ignore[union-attr]
    assert effect.payload == {"deadline": "2026-12-03T06:00:00Z"}
    assert program.policy(effect).replay.value == "same_identity"
    from agentfold.domain.program import dispatcher_effect

    assert program.policy(dispatcher_effect({"deadline": "soon"})).replay.value == "never"
    assert program.policy(dispatcher_effect({"deadline": "2026-12-03T06:00:00Z", "x": 1})).replay.value == "never"


def test_only_dispatches_are_stored_for_the_timer_once(store_url: str) -> None:
    """One timer Effect, one dispatch, one settlement: the Deadline stores no polling."""
    program = compile_deadline("test.deadline")
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, soon(0.5))
        assert handle.result(WAIT).status == "completed"
        events = [r.event for r in runtime.store.read(handle.tree_id)]
        assert sum(isinstance(e, EffectDispatched) for e in events) == 1
        assert sum(isinstance(e, EffectSettled) for e in events) == 1


# ---------------------------------------------------------------------------
# Review findings (2026-12-03): forged states, the accept copy, bounds, RFC 3339


def _forged_states() -> list[Any]:
    ok = _running_state()
    a_done = {"outcome": {"key": "a", "process_id": "process:a", "boundary": "terminal_result",
                          "result": {"process_id": "process:a", "status": "failed", "usage": {}}}}
    return [
        {**ok, "candidates": [{"program": "gate.a"}, {"key": "b", "program": "gate.b"}]},
        {**ok, "candidates": [{"key": "a", "program": "nobody"}, {"key": "b", "program": "gate.b"}]},
        {**ok, "candidates": [{"key": "a", "program": "gate.a"}, {"key": "a", "program": "gate.b"}]},
        {"candidates": [{"key": f"k{i}", "program": "gate.a"} for i in range(3)]},
        {**ok, "winner": True, "wait_id": None},
        {**ok, "results": [a_done, ok["results"][1]], "winner": 0, "wait_id": None},
        {**ok, "results": [{"foo": 1}, ok["results"][1]]},
        {**ok, "results": ["x", ok["results"][1]]},
        {**ok, "results": [{**ok["results"][0], **a_done}, ok["results"][1]]},
        {**ok, "wait_id": 123},
        {**ok, "results": [ok["results"][0], None]},
        {**ok, "results": [{"start": {"key": "b", "process_id": "process:a"}}, ok["results"][1]]},
        {"candidates": ok["candidates"], "wait_id": WAIT_ID},
    ]


def test_a_forged_state_is_refused_and_every_state_the_race_makes_is_kept() -> None:
    strategy = FirstSuccessStrategy("test.race", "", [gate("gate.a"), gate("gate.b")], 2, FIRST_COMPLETED)
    for data in _forged_states():
        with pytest.raises(ClassifiedError) as caught:
            strategy.decode_state(data)
        assert caught.value.failure.code == "coordination.state.invalid", data
    assert strategy.decode_state(_running_state()) == _running_state()
    for data in ({"deadline": "garbage", "phase": "ready"}, {"deadline": "", "phase": "ready"},
                 {"deadline": "2026-12-03T07:00:00+01:00", "phase": "ready"}):
        with pytest.raises(ClassifiedError) as caught:
            DeadlineStrategy("d", "").decode_state(data)
        assert caught.value.failure.code == "coordination.state.invalid"


def _tamper(key: str, outcome: dict[str, Any]) -> bool:
    outcome["result"]["output"]["payload"] = "tampered"
    return True


def test_accept_gets_a_copy_of_the_outcome() -> None:
    strategy = FirstSuccessStrategy("test.race", "", [gate("gate.a"), gate("gate.b")], 4, _tamper)
    signal = _satisfied(WAIT_ID, ("a", "process:a", "real"))
    step = strategy.decide(_running_state(), [signal])
    assert step.transition.output["candidates"][0]["outcome"]["result"]["output"]["payload"] == "real"  # type: ignore[union-attr]
    assert signal.payload["outcomes"][0]["result"]["output"]["payload"] == "real"  # type: ignore[index]


@pytest.mark.parametrize("bound", [0, 1025, 2**63, 2**70, True, 2.0])
def test_max_candidates_outside_1_to_1024_is_refused(bound: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        race(gate("gate.a"), max_candidates=bound)
    assert caught.value.code == "coordination.definition.invalid"


@pytest.mark.parametrize(("text", "canonical"), [
    ("2026-12-03T06:00:00Z", "2026-12-03T06:00:00Z"),
    ("2026-12-03t07:00:00+01:00", "2026-12-03T06:00:00Z"),
    ("2026-12-03T06:00:00.500z", "2026-12-03T06:00:00.5Z"),
    ("2026-12-03T06:00:00.123456789Z", "2026-12-03T06:00:00.123456789Z"),
    ("2026-12-31T23:30:00-01:00", "2027-01-01T00:30:00Z"),
    ("2024-02-29T00:00:00+14:00", "2024-02-28T10:00:00Z"),
    ("1969-12-31T23:59:59Z", "1969-12-31T23:59:59Z"),
    ("0001-01-01T00:00:00Z", "0001-01-01T00:00:00Z"),
])
def test_a_deadline_is_any_rfc_3339_time_in_its_canonical_utc_form(text: str, canonical: str) -> None:
    assert parse_instant(text) == canonical
    assert parse_instant(canonical) == canonical
    assert datetime.fromisoformat(canonical[:26].rstrip("Z") + "+00:00").year == int(canonical[:4])


@pytest.mark.parametrize("text", [
    "2026-12-03T06:00:00", "20261203T060000Z", "2026-W49-4T06:00Z", "2026-12-03T06Z", "2026-12-03T06:00:00,5Z",
    "2026-12-03T06:00:00+0100", "2026-12-03T06:00:00+01:00:30", "2026-12-31T23:59:60Z", "2026-02-29T00:00:00Z",
    "2026-12-03T24:00:00Z", "9999-12-31T23:59:59-14:00", "0000-01-01T00:00:00+14:00", "2026-12-03 06:00:00Z",
    "2026-12-03T06:00:00.1234567890Z",
])
def test_other_forms_of_a_time_are_refused_with_a_classified_code(text: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_instant(text)
    assert caught.value.code == "coordination.input.invalid"
    assert text[:20] in caught.value.message


def test_tree_limits_narrower_than_the_race_are_refused_naming_its_setting(tmp_path: Any) -> None:
    """A race may run max_candidates children at once: limits that allow fewer are refused
    before anything is stored, naming the race's own setting (not an Interaction's)."""
    from agentfold.domain.tree import TreeLimits

    program = race(gate("gate.a"), max_candidates=32)
    store = EventStore(f"sqlite:///{tmp_path / 'race.db'}")
    try:
        with open_runtime(store, program) as runtime:
            with pytest.raises(InvalidInput) as caught:
                runtime.start(program, [{"key": "a", "program": "gate.a"}], limits=TreeLimits(max_active_children=16))
            assert caught.value.code == "limits.invalid"
            assert "FirstSuccessConfig.max_candidates" in str(caught.value)
            assert "max_concurrent_tool_calls" not in str(caught.value)
            assert store.tree_ids() == []
    finally:
        store.close()


def test_results_of_a_run_without_an_interaction_say_so_and_where_to_look(store_url: str) -> None:
    """``results`` (settled tool results per round) exist only for Interactions: asked of a
    Deadline run, the refusal names the run's root Program and says to look at the run itself."""
    program = compile_deadline("test.deadline")
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, soon(0))
        assert handle.result(WAIT).status == "completed"
        with pytest.raises(AgentfoldError) as refused:
            Host(runtime).results(str(handle.tree_id))
        assert refused.value.code == "engine.program.unavailable"
        assert "(root Program test.deadline) has no Interaction" in refused.value.message
        assert f"agentfold show {handle.tree_id}" in (refused.value.hint or "")
