"""Waits, child waits and signals: behaviour a mutation audit (2026-12-05, "waits") found
undefended; each test failed with its mutant planted and passes without it.

- a child wait counts only the children it names: another child of the same parent that
  ends does not satisfy it (nor wake the parent with no outcome);
- a ``signal_child`` to a child that has ended is a failed receipt
  (``engine.child.signal.rejected``), never reported delivered;
- a ``cancel_child`` to a child that has ended succeeds and changes nothing (spec §6.4);
- a ``cancel_child`` reaches the whole subtree of the child: its own children end
  canceled too, not left waiting for input nobody will give;
- a Step that opens a wait under a key already open, or waits on a process that is not
  its own child, is refused: the run fails ``execution.effect.invalid`` (contract), the
  owner goes on (the stream holds no event the fold refuses);
- a host cannot answer a child wait: only the engine satisfies it (spec §5.2 rule 5),
  so a forged "outcome" never wakes a parent whose children still run;
- only an answer to the CURRENT wait releases a waiting process: a child wait satisfied
  meanwhile (another wait id) queues, it does not wake it (spec §6.3);
- an answer to the wait of a paused process does not release the pause (spec §5.2 rule 9);
- a wait key is free again once its answer was consumed: a Program may ask twice under
  one key;
- one batch may answer the current wait and carry unaddressed input after the answer
  (spec §5.2 rule 6: refused only "until the batch has answered it");
- a ``signal_child`` to a process that is not the sender's own child (a sibling) is a
  failed receipt ``engine.child.control.not_owned``; the sibling gets nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Rejected
from agentfold.domain.ids import ChildKey, SignalID, WaitKey
from agentfold.domain.program import (
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Pause,
    Program,
    Signal,
    SignalRequest,
    Step,
    Wait,
    cancel_child_effect,
    signal_child_effect,
    start_child_effect,
    wait_children_effect,
    wait_effect,
)
from tests.kernel_programs import IMPL, Asker, JsonStrategy, asker_program, config_digest


def _opened(window: Sequence[Signal], key: str) -> Signal:
    """The signal that opened the wait ``key`` (the engine's wait-opened signal)."""
    return next(s for s in window if isinstance(s.payload, dict) and s.payload.get("key") == key
                and s.payload.get("operation") in ("wait", "wait_children"))

WAIT = 30.0


def _children(tree: Any, parent: Any) -> list[Any]:
    return [tree.processes[cid] for cid in parent.children]


# ---------------------------------------------------------------------------
# A child wait counts only the children it names


class WaitsOnTheFirstOfTwo(JsonStrategy):
    """Starts two askers and waits (``any``) on the first only; completes with the keys of
    the outcomes it was given."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effects = tuple(start_child_effect(ChildSpec(ChildKey(f"asker-{i}"), self.child.ref)) for i in range(2))
            return Step(0, Continue(effects), {"phase": "starting"})
        if phase == "starting":
            first = window[0].payload["process_id"]  # type: ignore[index]
            spec = ChildWaitSpec(WaitKey("first"), (first,), condition="any")
            return Step(len(window), Continue((wait_children_effect(spec),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        outcomes = window[0].payload["outcomes"]  # type: ignore[index]
        return Step(1, Complete({"outcomes": [o["key"] for o in outcomes]}), {"phase": "done"})


def test_a_child_wait_is_not_satisfied_by_the_end_of_a_child_it_does_not_name() -> None:
    asker = asker_program("mw.named.asker")
    parent = Program(Descriptor("mw.named.parent"), WaitsOnTheFirstOfTwo(asker), IMPL,
                     config_digest("mw.named.parent"), children=(asker,))
    with Runtime(EventStore("memory:"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="named")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        steps = tree.root.committed_steps
        first, second = _children(tree, tree.root)

        # The child the wait does not name ends: the parent keeps waiting.
        answer = SignalRequest(SignalID("second"), {"name": "b"}, second.current_wait)
        assert runtime.deliver_signals(second.process_id, [answer])
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.processes[second.process_id].status == "completed"
        assert (tree.root.status, tree.root.committed_steps) == ("waiting", steps), \
            "the end of a child the wait does not name satisfied it"

        # The named child ends: the wait is satisfied with its outcome.
        answer = SignalRequest(SignalID("first"), {"name": "a"}, first.current_wait)
        assert runtime.deliver_signals(first.process_id, [answer])
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"outcomes": ["asker-0"]})


# ---------------------------------------------------------------------------
# Child controls sent to a child that has ended


class Done(JsonStrategy):
    """Completes at once; takes any object as unaddressed input."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(len(window), Complete({"done": True}), {"phase": "done"})


class ControlsAnEndedChild(JsonStrategy):
    """Starts a child, waits for its end, then signals and cancels it; completes with the
    two receipts."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Continue((start_child_effect(ChildSpec(ChildKey("done"), self.child.ref)),)),
                        {"phase": "starting"})
        if phase == "starting":
            child = window[0].payload["process_id"]  # type: ignore[index]
            spec = ChildWaitSpec(WaitKey("ended"), (child,))
            return Step(1, Continue((wait_children_effect(spec),)), {"phase": "opening", "child": child})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting", "child": state["child"]})  # type: ignore[arg-type]
        if phase == "waiting":
            child = state["child"]
            controls = (signal_child_effect(child, SignalRequest(SignalID("late"), {"late": True})),
                        cancel_child_effect(child, "too late"))
            return Step(1, Continue(controls), {"phase": "controlling"})
        return Step(2, Complete({"receipts": [s.payload for s in window[:2]]}), {"phase": "done"})


def test_controls_sent_to_a_child_that_has_ended_are_refused_or_change_nothing() -> None:
    child = Program(Descriptor("mw.ended.child", signal_schema={"type": "object"}), Done(), IMPL,
                    config_digest("mw.ended.child"))
    parent = Program(Descriptor("mw.ended.parent"), ControlsAnEndedChild(child), IMPL,
                     config_digest("mw.ended.parent"), children=(child,))
    with Runtime(EventStore("memory:"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="ended")
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert result.status == "completed", result
        signaled, canceled = result.output["receipts"]
        # The signal was not delivered: a failed receipt that says why.
        assert signaled["signal_id"] == "late"
        assert signaled["failure"]["code"] == "engine.child.signal.rejected", signaled
        assert "admits no more input" in signaled["failure"]["message"]
        # The cancel of an ended child succeeds and leaves it as it ended.
        assert "failure" not in canceled, canceled
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        (ended,) = _children(tree, tree.root)
        assert (ended.status, ended.termination.cause, ended.output) == ("completed", "completion", {"done": True})
        assert ended.intents == {}
        assert "late" not in ended.signal_index


# ---------------------------------------------------------------------------
# cancel_child reaches the child's own children


class HoldsAnAsker(JsonStrategy):
    """Starts an asker grandchild, then waits for input of its own that never comes."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effects = (start_child_effect(ChildSpec(ChildKey("asker"), self.child.ref)), wait_effect(WaitKey("hold")))
            return Step(0, Continue(effects), {"phase": "opening"})
        if phase == "opening":
            (opened,) = [s for s in window if s.wait_id is not None]
            return Step(len(window), Wait(opened.wait_id), {"phase": "holding"})  # type: ignore[arg-type]
        return Step(len(window), Complete({"held": True}), {"phase": "done"})


class CancelsItsChild(JsonStrategy):
    """Starts a child, waits for the host's go, cancels the child and completes with how it
    ended."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effects = (start_child_effect(ChildSpec(ChildKey("middle"), self.child.ref)), wait_effect(WaitKey("go")))
            return Step(0, Continue(effects), {"phase": "opening"})
        if phase == "opening":
            child = next(s.payload["process_id"] for s in window if s.wait_id is None)  # type: ignore[index]
            (opened,) = [s for s in window if s.wait_id is not None]
            return Step(len(window), Wait(opened.wait_id), {"phase": "go", "child": child})  # type: ignore[arg-type]
        if phase == "go":
            child = state["child"]
            effects = (cancel_child_effect(child, "no longer needed"),
                       wait_children_effect(ChildWaitSpec(WaitKey("ended"), (child,))))
            return Step(len(window), Continue(effects), {"phase": "canceling"})
        if phase == "canceling":
            # The receipt, the opening, and (the child ended at once) maybe the satisfaction.
            opened = next(s for s in window if s.wait_id is not None)
            return Step(window.index(opened) + 1, Wait(opened.wait_id), {"phase": "ending"})  # type: ignore[arg-type]
        outcome = window[0].payload["outcomes"][0]["result"]  # type: ignore[index]
        return Step(1, Complete({"middle": outcome["status"]}), {"phase": "done"})


def test_a_cancel_child_reaches_the_childs_own_children() -> None:
    asker = asker_program("mw.reach.asker")
    middle = Program(Descriptor("mw.reach.middle"), HoldsAnAsker(asker), IMPL, config_digest("mw.reach.middle"),
                     children=(asker,))
    root = Program(Descriptor("mw.reach.root"), CancelsItsChild(middle), IMPL, config_digest("mw.reach.root"),
                   children=(middle,))
    with Runtime(EventStore("memory:"), Catalog([root])) as runtime:
        handle = runtime.start(root, None, start_id="reach")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        (mid,) = _children(tree, tree.root)
        (low,) = _children(tree, mid)
        assert (tree.root.status, mid.status, low.status) == ("waiting", "waiting", "waiting")

        assert runtime.deliver_signals(handle.root_process_id,
                                       [SignalRequest(SignalID("go"), {}, tree.root.current_wait)])
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"middle": "canceled"}), result
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        (mid,) = _children(tree, tree.root)
        (low,) = _children(tree, mid)
        ends = [(p.status, p.termination.cause if p.termination else None) for p in (mid, low)]
        assert ends == [("canceled", "parent_cancellation"), ("canceled", "parent_cancellation")], \
            "the cancel of the child did not reach its own child"


# ---------------------------------------------------------------------------
# Steps the kernel refuses: a wait key already open, a child wait on another's child


class OpensTheSameKeyTwice(JsonStrategy):
    """Opens the wait ``k``, then (woken by its opening) ``k`` again."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue((wait_effect(WaitKey("k")),)), {"phase": "again"})
        return Step(len(window), Continue((wait_effect(WaitKey("k")),)), {"phase": "twice"})


class WaitsOnItsSibling(JsonStrategy):
    """Given a sibling's process id as input, opens a child wait on it."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            spec = ChildWaitSpec(WaitKey("sibling"), (state["input"]["sibling"],))
            return Step(0, Continue((wait_children_effect(spec),)), {"phase": "opening"})
        return Step(len(window), Complete({"waited": True}), {"phase": "done"})


class StartsSiblings(JsonStrategy):
    """Starts a ``Done`` child, then a waiter given its id; completes with how both ended."""

    def __init__(self, done: Program, waiter: Program) -> None:
        self.done, self.waiter = done, waiter

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Continue((start_child_effect(ChildSpec(ChildKey("first"), self.done.ref)),)),
                        {"phase": "first"})
        if phase == "first":
            first = window[0].payload["process_id"]  # type: ignore[index]
            spec = ChildSpec(ChildKey("waiter"), self.waiter.ref, {"sibling": first})
            return Step(1, Continue((start_child_effect(spec),)), {"phase": "second"})
        if phase == "second":
            waiter = window[0].payload["process_id"]  # type: ignore[index]
            wait = wait_children_effect(ChildWaitSpec(WaitKey("waiter"), (waiter,)))
            return Step(1, Continue((wait,)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        result = window[0].payload["outcomes"][0]["result"]  # type: ignore[index]
        return Step(1, Complete({"waiter": result["status"], "failure": result["termination"]["failure"]}),
                    {"phase": "done"})


def test_a_step_opening_a_wait_under_a_key_already_open_fails_the_run_as_a_contract_failure() -> None:
    program = Program(Descriptor("mw.twice", signal_schema={"type": "object"}), OpensTheSameKeyTwice(), IMPL,
                      config_digest("mw.twice"))
    with Runtime(EventStore("memory:"), Catalog([program])) as runtime:
        handle = runtime.start(program, None, start_id="twice")
        result = runtime.result(handle.tree_id, timeout=WAIT)
        termination = result.termination
        assert termination is not None, result
        assert (result.status, termination["cause"]) == ("failed", "contract_failure"), result
        assert termination["failure"]["code"] == "execution.effect.invalid"
        assert "wait key k is already open" in termination["failure"]["message"]


def test_a_child_wait_on_a_process_that_is_not_the_waiters_child_fails_the_waiter() -> None:
    done = Program(Descriptor("mw.sibling.done"), Done(), IMPL, config_digest("mw.sibling.done"))
    waiter = Program(Descriptor("mw.sibling.waiter", input_schema={"type": "object"}), WaitsOnItsSibling(), IMPL,
                     config_digest("mw.sibling.waiter"))
    root = Program(Descriptor("mw.sibling.root"), StartsSiblings(done, waiter), IMPL, config_digest("mw.sibling.root"),
                   children=(done, waiter))
    with Runtime(EventStore("memory:"), Catalog([root])) as runtime:
        handle = runtime.start(root, None, start_id="sibling")
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert result.status == "completed", result
        assert result.output["waiter"] == "failed"
        failure = result.output["failure"]
        assert (failure["kind"], failure["code"]) == ("contract", "execution.effect.invalid"), failure
        assert "is not a direct child of the waiter" in failure["message"]


# ---------------------------------------------------------------------------
# A child wait is answered by the engine only


def test_a_host_cannot_answer_a_child_wait_in_place_of_the_children() -> None:
    asker = asker_program("mw.forged.asker")
    parent = Program(Descriptor("mw.forged.parent"), WaitsOnTheFirstOfTwo(asker), IMPL,
                     config_digest("mw.forged.parent"), children=(asker,))
    with Runtime(EventStore("memory:"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="forged")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        steps, wait_id = tree.root.committed_steps, tree.root.current_wait
        assert wait_id is not None and tree.root.waits[wait_id].kind == "children"

        forged = SignalRequest(SignalID("forged"), {"outcomes": []}, wait_id)
        with pytest.raises(Rejected) as refused:
            runtime.deliver_signals(handle.root_process_id, [forged])
        assert refused.value.code == "engine.signal.rejected"
        assert "is not an open input wait" in refused.value.message
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert (tree.root.status, tree.root.committed_steps) == ("waiting", steps)
        assert "forged" not in tree.root.signal_index


# ---------------------------------------------------------------------------
# Only an answer to the current wait releases a waiting process


class AsksWhileAChildRuns(JsonStrategy):
    """Starts an asker, opens a child wait on it (``kid``) and an input wait (``q``), waits
    on ``q``; answered, completes with the answer and the signals it was given."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Continue((start_child_effect(ChildSpec(ChildKey("kid"), self.child.ref)),)),
                        {"phase": "starting"})
        if phase == "starting":
            kid = window[0].payload["process_id"]  # type: ignore[index]
            effects = (wait_children_effect(ChildWaitSpec(WaitKey("kid"), (kid,))), wait_effect(WaitKey("q")))
            return Step(1, Continue(effects), {"phase": "opening"})
        if phase == "opening":
            q = _opened(window, "q")
            return Step(window.index(q) + 1, Wait(q.wait_id), {"phase": "asking", "q": q.wait_id})  # type: ignore[arg-type]
        answers = [s.payload for s in window if s.wait_id == state["q"]]
        if not answers:
            return Step(0, Complete({"woken_by": [s.id for s in window]}), {"phase": "done"})
        return Step(len(window), Complete({"answer": answers[0]}), {"phase": "done"})


def test_a_child_wait_satisfied_while_another_wait_is_current_does_not_wake_the_process() -> None:
    asker = asker_program("mw.current.asker")
    parent = Program(Descriptor("mw.current.parent"), AsksWhileAChildRuns(asker), IMPL,
                     config_digest("mw.current.parent"), children=(asker,))
    with Runtime(EventStore("memory:"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="current")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        steps, current = tree.root.committed_steps, tree.root.current_wait
        (kid,) = _children(tree, tree.root)

        assert runtime.deliver_signals(kid.process_id, [SignalRequest(SignalID("kid"), {"name": "k"}, kid.current_wait)])
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.processes[kid.process_id].status == "completed"
        assert (tree.root.status, tree.root.current_wait, tree.root.committed_steps) == ("waiting", current, steps), \
            "the satisfaction of another wait released the current one"

        assert runtime.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("q"), {"q": 1}, current)])
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"answer": {"q": 1}})


# ---------------------------------------------------------------------------
# An answer does not release a pause


def test_an_answer_to_a_paused_process_is_kept_until_it_is_resumed() -> None:
    asker = asker_program("mw.paused.asker")
    with Runtime(EventStore("memory:"), Catalog([asker])) as runtime:
        handle = runtime.start(asker, None, start_id="paused")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        steps, wait_id = tree.root.committed_steps, tree.root.current_wait
        assert runtime.pause(handle.root_process_id, "hold on")

        assert runtime.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("a"), {"name": "Ada"}, wait_id)])
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert (tree.root.status, tree.root.committed_steps) == ("paused", steps), "the answer released the pause"
        assert tree.root.pause_reason == "hold on"

        assert runtime.resume(handle.root_process_id)
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"hello": "Ada"})


# ---------------------------------------------------------------------------
# A wait key can be used again once its answer was consumed


class AsksTwice(JsonStrategy):
    """Asks under the key ``q`` twice in turn (the second time in the Step after the one that
    consumed the first answer); completes with both answers."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase, answers = state["phase"], state.get("answers", [])
        if phase in ("start", "again"):
            return Step(len(window), Continue((wait_effect(WaitKey("q")),)), {"phase": "opening", "answers": answers})
        if phase == "opening":
            q = _opened(window, "q")
            return Step(1, Wait(q.wait_id), {"phase": "asking", "answers": answers, "q": q.wait_id})  # type: ignore[arg-type]
        answers = [*answers, next(s.payload for s in window if s.wait_id == state["q"])]
        if len(answers) == 2:
            return Step(len(window), Complete({"answers": answers}), {"phase": "done"})
        # The key is free once this Step consumed the answer: the NEXT Step opens it again (the
        # Step consuming it may not: the kernel checks a Step's effects before its consumption).
        return Step(len(window), Continue(()), {"phase": "again", "answers": answers})


def test_a_wait_key_is_free_again_once_its_answer_was_consumed() -> None:
    program = Program(Descriptor("mw.twice.asked"), AsksTwice(), IMPL, config_digest("mw.twice.asked"))
    with Runtime(EventStore("memory:"), Catalog([program])) as runtime:
        handle = runtime.start(program, None, start_id="asked")
        for n in (1, 2):
            tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
            assert tree.root.status == "waiting", tree.root.termination
            answer = SignalRequest(SignalID(f"a{n}"), {"n": n}, tree.root.current_wait)
            assert runtime.deliver_signals(handle.root_process_id, [answer])
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"answers": [{"n": 1}, {"n": 2}]}), result


# ---------------------------------------------------------------------------
# One batch: the answer to the current wait, then unaddressed input


def test_one_batch_may_answer_the_current_wait_and_then_carry_unaddressed_input() -> None:
    program = Program(Descriptor("mw.batch.asker", signal_schema={"type": "object"}), Asker(), IMPL,
                      config_digest("mw.batch.asker"))
    with Runtime(EventStore("memory:"), Catalog([program])) as runtime:
        handle = runtime.start(program, None, start_id="batch")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        batch = [SignalRequest(SignalID("answer"), {"name": "Ada"}, tree.root.current_wait),
                 SignalRequest(SignalID("note"), {"note": 1})]
        assert runtime.deliver_signals(handle.root_process_id, batch)
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"hello": "Ada"})
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert [r.signal_id for r in tree.root.mailbox if r.source == "host"] == ["answer", "note"]


# ---------------------------------------------------------------------------
# signal_child reaches only the sender's own children


class Sleeps(JsonStrategy):
    """Pauses at once (taking any object as unaddressed input meanwhile)."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Pause("asleep"), {"phase": "asleep"})


class SignalsItsSibling(JsonStrategy):
    """Given a sibling's process id as input, signals it; completes with the receipt."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            request = SignalRequest(SignalID("from-a-sibling"), {"hi": True})
            return Step(0, Continue((signal_child_effect(state["input"]["sibling"], request),)), {"phase": "sent"})
        return Step(1, Complete({"receipt": window[0].payload}), {"phase": "done"})


def test_a_signal_child_to_a_process_that_is_not_the_senders_child_fails_not_owned() -> None:
    sleeper = Program(Descriptor("mw.owned.sleeper", signal_schema={"type": "object"}), Sleeps(), IMPL,
                      config_digest("mw.owned.sleeper"))
    sender = Program(Descriptor("mw.owned.sender", input_schema={"type": "object"}), SignalsItsSibling(), IMPL,
                     config_digest("mw.owned.sender"))
    root = Program(Descriptor("mw.owned.root"), StartsSiblings(sleeper, sender), IMPL, config_digest("mw.owned.root"),
                   children=(sleeper, sender))
    with Runtime(EventStore("memory:"), Catalog([root])) as runtime:
        handle = runtime.start(root, None, start_id="owned")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        first, second = _children(tree, tree.root)
        assert second.status == "completed", second.termination
        receipt = second.output["receipt"]
        assert receipt["failure"]["code"] == "engine.child.control.not_owned", receipt
        assert "from-a-sibling" not in first.signal_index


class AsksAgainInTheConsumingStep(AsksTwice):
    """Opens ``q`` again in the Step that consumes its first answer."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        step = super().decide(state, window)
        if state["phase"] == "asking" and step.transition == Continue(()):
            return Step(step.consumed, Continue((wait_effect(WaitKey("q")),)), {**step.facts, "phase": "opening"})
        return step


def test_a_step_that_consumes_a_waits_answer_may_not_open_its_key_again() -> None:
    """scope-kernel.md 2.5 step 6 and 5.3: a Step's waits are checked before its consumption
    closes anything, so the key of the wait whose answer it consumes is still open; the fold
    refuses a stored Step that does it (tests/test_fold_rules.py)."""
    program = Program(Descriptor("mw.twice.same"), AsksAgainInTheConsumingStep(), IMPL, config_digest("mw.twice.same"))
    with Runtime(EventStore("memory:"), Catalog([program])) as runtime:
        handle = runtime.start(program, None, start_id="same")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        answer = SignalRequest(SignalID("a1"), {"n": 1}, tree.root.current_wait)
        assert runtime.deliver_signals(handle.root_process_id, [answer])
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert result.termination is not None, result
        assert (result.status, result.termination["failure"]["code"]) == ("failed", "execution.effect.invalid")
        assert "wait key q is already open" in result.termination["failure"]["message"]
