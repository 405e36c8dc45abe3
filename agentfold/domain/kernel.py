"""The kernel's decision rules: what happens next in a tree, as events.

Every function here is a deterministic function of the folded tree, the bound
Programs and identities handed in by the caller (an :class:`IdSource`); it validates
before it produces anything, and applies what it produces to the tree it was given
so the next decision sees it. The runtime (``adapters``) appends the events in one
commit and only then calls dispatchers.

Rules implemented here (kernel spec 2-7): scheduling of runnable Processes, the
Steps budget, Step validation (transition, effects, capabilities, budgets, output
schema), classified Step failures, framework Effects (wait, wait_children,
start_child, signal_child, cancel_child), dispatch permission at the batch
frontier, termination by priority (kill, deadline, cancellation, failure,
completion), recovery of in-flight Effects on activation, and host admission of
signals, controls and resolutions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentfold.domain.budget import MAX_COUNTER, Budget, child_debit
from agentfold.domain.canonical import JSON, canonical_bytes, normalize, value_at
from agentfold.domain.errors import (
    AgentfoldError,
    ClassifiedError,
    EngineCode,
    Failure,
    FailureKind,
    InvalidInput,
    NotFound,
    Rejected,
    recorded_text,
)
from agentfold.domain.events import (
    CheckpointCommitted,
    ControlRequested,
    EffectDeclared,
    EffectDispatched,
    EffectResolved,
    EffectSettled,
    OutputRef,
    ProcessStarted,
    ProcessTerminated,
    SignalAdmitted,
    StepCommitted,
    TreeEvent,
    TreeLimits,
    TreeStarted,
    WriterActivated,
)
from agentfold.domain.ids import (
    EffectAttemptID,
    EffectID,
    ProcessID,
    SignalID,
    StartID,
    TreeID,
    TreeIncarnationID,
    WaitID,
    WaitKey,
    child_process_id,
)
from agentfold.domain.ids import (
    effect_id as derive_effect_id,
)
from agentfold.domain.input_changes import INPUT_PATCH, holds_input_patch, input_changes
from agentfold.domain.json_schema import check_schema, schema_errors
from agentfold.domain.mailbox import check_admission
from agentfold.domain.program import (
    NO_STATE,
    TRANSITION_KINDS,
    Checkpoint,
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Effect,
    EffectPolicy,
    Fail,
    Operation,
    OutputOf,
    Pause,
    Program,
    ProgramResolver,
    Replay,
    SettlementStatus,
    Signal,
    SignalRequest,
    Step,
    Target,
    Wait,
    check_child_operation,
    check_reason,
)
from agentfold.domain.requests import effect_request
from agentfold.domain.tree import (
    _MISSING,
    CAUSE_STATUS,
    FAILURE_CAUSE,
    EffectRecord,
    ProcessState,
    TreeState,
    intent_cause,
    stop_intent,
)


class IdSource(Protocol):
    """Where fresh random identities come from (the adapters own randomness)."""

    def attempt_id(self) -> EffectAttemptID: ...

    def incarnation_id(self) -> TreeIncarnationID: ...


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A dispatch permission granted in this batch: call the dispatcher after the append."""

    process_id: ProcessID
    effect_id: EffectID
    attempt_id: EffectAttemptID


@dataclass(slots=True)
class Progress:
    """Events produced (and already applied to the tree) plus the dispatches they permit."""

    events: list[TreeEvent] = field(default_factory=list)
    dispatches: list[Dispatch] = field(default_factory=list)


def _failure(kind: FailureKind, code: str, message: str) -> Failure:
    return Failure(kind, code, message)


# ---------------------------------------------------------------------------
# Start


#: Prefixes a new start id may not have: commands read such a reference as a tree or process id.
RESERVED_START_PREFIXES = ("tree:", "process:")
#: What a start refused by the Program's ``initial`` is told (engine.process.start.failed).
START_REFUSED_HINT = "fix the input: the Program's initial() refused it for the reason in the message"


def check_limits(limits: TreeLimits) -> None:
    """Refuse tree limits a start would store and every child start would then trip over (a
    negative count) or that cannot be stored (beyond 64 bits): ``limits.invalid``. Only new
    starts are checked: histories that already hold such limits still fold."""
    if not isinstance(limits, TreeLimits):
        raise InvalidInput(
            "limits.invalid",
            f"tree limits must be a TreeLimits, not {type(limits).__name__}",
            hint="pass TreeLimits(max_active_children=...) (agentfold.domain.events.TreeLimits), or None for the defaults",
        )
    for name in TreeLimits.model_fields:
        value = getattr(limits, name)
        optional = TreeLimits.model_fields[name].default is None
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
            raise InvalidInput(
                "limits.invalid",
                f"tree limit {name} is {value!r}; it must be an int from 0 to {MAX_COUNTER}"
                + (" (or None for no limit)" if optional else ""),
                hint="pass TreeLimits with whole numbers of 0 or more (the defaults: max_depth 16, "
                "max_active_children 16, max_pending_signals 10000)",
            )


def brief_repr(value: object) -> str:
    """A bad argument, named without printing all of it."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def start_tree(
    program: Program,
    input: JSON,
    *,
    start_id: StartID,
    root_id: ProcessID,
    incarnation_id: TreeIncarnationID,
    budget: Budget | None = None,
    capabilities: Sequence[str] = (),
    limits: TreeLimits | None = None,
    configuration: JSON = None,
) -> TreeStarted:
    """Validate a root start and build its ``TreeStarted`` event (nothing is appended here)."""
    reserved = next((p for p in RESERVED_START_PREFIXES if start_id.startswith(p)), None)
    if reserved is not None:
        # Commands take "a tree id, a start id or a process id": such a run could not be named
        # by its start id (histories that already hold one still fold: only new starts are refused).
        raise InvalidInput(
            "identity.invalid", f"start id {start_id[:80]!r} begins with {reserved!r}: it would read as "
            f"a {reserved[:-1]} id", hint="choose a start id that does not begin with tree: or process:",
        )
    if limits is not None:
        check_limits(limits)
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidInput(
            "budget.invalid", f"a budget must be a Budget, not {type(budget).__name__}",
            hint="pass Budget(steps=Quota(100), ...) (agentfold.domain.budget), or None for no limit",
        )
    if isinstance(capabilities, (str, bytes)) or not all(isinstance(c, str) and c for c in capabilities):
        # A str is a sequence of one-letter strings: "admin" was stored as a, d, i, m, n.
        raise InvalidInput(
            "capabilities.invalid",
            f"capabilities must be a list of non-empty strings, not {brief_repr(capabilities)}",
            hint='pass a list, e.g. capabilities=["payments"] (not the bare string "payments")',
        )
    value = normalize(input, what="input")
    problems = schema_errors(value, program.descriptor.input_schema)
    if problems:
        raise InvalidInput(
            "engine.start.input_invalid",
            f"input does not satisfy {program.descriptor.name}'s input schema: " + "; ".join(problems[:3]),
            hint="fix the input to match the program's input schema",
        )
    try:
        program.strategy.initial(value)
    except ClassifiedError as exc:
        raise InvalidInput(exc.failure.code, f"the program refused its input: {exc.failure.message}",
                           hint=START_REFUSED_HINT, recorded_hint=False) from exc
    except Exception as exc:
        raise InvalidInput(EngineCode.PROCESS_START_FAILED, f"the program refused its input: {exc}",
                           hint=START_REFUSED_HINT, recorded_hint=False) from exc
    return TreeStarted(
        process_id=root_id,
        tree_id=TreeID.for_start(start_id),
        start_id=start_id,
        incarnation_id=incarnation_id,
        program=program.ref,
        input=value,
        budget=budget or Budget(),
        capabilities=tuple(sorted(set(capabilities))),
        limits=limits or TreeLimits(),
        configuration=normalize(configuration, what="configuration"),
        programs=tuple(sorted((p.ref for p in program.walk() if p is not program), key=lambda r: r.digest)),
    )


# ---------------------------------------------------------------------------
# Progress: run Steps, settle framework Effects, grant dispatch permissions


def replay_allowed(program: Program | None, record: EffectRecord) -> bool:
    """Whether a dispatcher Effect may be dispatched again under its EffectID: its declaration
    says ``same_identity`` AND its Program, asked again now, still says so (scope-kernel.md
    §3.8: the policy is asked at each restoration). A declaration edited to say so (a forged
    import, a hand edit under a recomputed digest chain), a Program that no longer says so,
    one not bound, or a policy that raises: the call is not made again."""
    if record.target != "dispatcher" or record.replay != "same_identity" or program is None:
        return False
    try:
        policy = program.policy(Effect(Target.DISPATCHER, record.payload))
    except Exception:  # noqa: BLE001 - the Program's own code: in doubt, never call twice
        return False
    return isinstance(policy, EffectPolicy) and policy.replay.value == "same_identity"


def resolvable(tree: TreeState, effect_id: EffectID, process_id: ProcessID | None = None) -> tuple[ProcessState, EffectRecord]:
    """The Process and record of an Effect a host may resolve now, or the kernel's refusal:
    ``engine.effect.not_pending`` (no such unsettled effect, another Process's, or not
    unknown: e.g. resolved a moment ago by another host), ``engine.process.finished``."""
    found = tree.find_effect(effect_id)
    if found is None:
        raise NotFound(
            "engine.effect.not_pending", f"effect {effect_id} is not an unsettled effect of tree {tree.tree_id}",
            hint="list unknown effects with `agentfold unknown`",
        )
    process, record = found
    if process_id is not None and process.process_id != process_id:
        raise NotFound("engine.effect.not_pending", f"effect {effect_id} does not belong to process {process_id}")
    ending = None if process.terminal else tree.ending(process)
    if process.terminal or ending is not None:
        raise Rejected(
            "engine.process.finished",
            f"process {process.process_id} is {process.status if process.terminal else f'terminating ({ending})'}; "
            "its unknown effects stay unresolved as evidence",
            hint="nothing to resolve: the run's outcome no longer depends on them",
        )
    if not record.unknown or record.resolved_by is not None:
        raise Rejected(
            "engine.effect.not_pending",
            f"effect {effect_id} is {record.phase}"
            + (f" ({record.status.value})" if record.status else "")
            + "; only an unknown effect can be resolved",
        )
    return process, record



class Kernel:
    """Applies the kernel rules to one folded tree with the bound Programs."""

    def __init__(
        self, tree: TreeState, programs: ProgramResolver, ids: IdSource, *,
        dispatch: bool | Callable[[ProcessState], bool] = True, interruptible: bool = False,
    ) -> None:
        """``dispatch=False``: grant no dispatch permission (an owner that is shutting down
        records what it still has to, but starts no call: a declared Effect without its
        ``EffectDispatched`` is dispatched by the next owner, never settled unknown).

        ``dispatch`` may also be a function of the Process, asked right before each permission
        would be granted: True grants it (the caller counted one more call in flight), False
        leaves the Effect declared, to be permitted by a later ``advance`` (a runtime whose
        calls in flight are at their limit: a permission is only granted when its call can
        start). Once it has answered False, the Processes refused by earlier advances are not
        offered again during that ``advance``; the function is still asked for the others
        (a runtime out of call slots refuses every call but a timer, which needs none).

        ``interruptible``: a ``KeyboardInterrupt`` a Program's code raises is passed on (the
        caller's Ctrl-C, on the thread that receives it), not a ``panic`` failure of the run.
        """
        self.interruptible = interruptible
        self.tree = tree
        self.programs = programs
        self.ids = ids
        self.dispatch = dispatch
        self._denied = False
        self._refused = False

    def _passed_on(self, exc: BaseException) -> None:
        """Raise ``exc`` again when it is the operator's Ctrl-C (``interruptible``), not the run's."""
        if self.interruptible and isinstance(exc, KeyboardInterrupt):
            raise exc

    def _emit(self, progress: Progress, event: TreeEvent, next_state: Any = _MISSING) -> None:
        self.tree.apply(event, next_state=next_state)
        progress.events.append(event)

    def program_of(self, process: ProcessState) -> Program:
        program = self.programs(process.program)
        if program is None:
            raise NotFound(
                "engine.program.unavailable",
                f"no program is bound for {process.program.name} ({process.program.digest})",
                hint="start the runtime with a catalog that binds this exact program",
            )
        return program

    def advance(self, max_events: int = 2048) -> Progress:
        """Make every local step of progress possible now, up to ``max_events`` events.

        In passes: each pass offers every live Process (in creation order, those that
        existed when the pass began) one move, until a pass moves none. A Process that
        could not move stays unable to until an event touches it (``TreeState.touch_log``:
        its own events, a child's start, an end in its subtree or of its parent), so it is
        not offered one again until then ("asleep", also across advances: the tree keeps
        the others in ``kernel_awake``): it would answer no. Only a refused dispatch
        permission is no answer of the tree's: such a Process (``kernel_permits``) is
        offered a move again by the next advance, until that advance is refused one too
        (it grants none after a refusal: they would all answer no). The events and their
        order are those of offering every live Process a move at every pass; the cost is
        per move, not per live Process and pass (a parent starting N children, one per
        pass, cost O(N^2)).
        """
        progress = Progress()
        tree = self.tree
        self._denied = False
        processes, live = tree.processes, tree.live
        queue = [(processes[pid].ordinal, pid) for pid in tree.kernel_awake if pid in live]
        heapq.heapify(queue)
        queued = {pid for _, pid in queue}  # in ``queue`` (this pass or a later one) or ``later``
        # Refused a permission by an earlier advance (and untouched since): offered in order
        # like the others until this advance is refused one; then they are all refused at once,
        # unvisited (they are kept, a heap with stale entries, for the next advance).
        waiting = tree.kernel_waiting
        waiting -= tree.kernel_awake
        permits = tree.kernel_permits
        if len(permits) > 2 * len(waiting) + 64:
            permits[:] = sorted((processes[pid].ordinal, pid) for pid in waiting)
        refused: set[ProcessID] = set()  # refused a permission by this advance
        touched = tree.touch_log = []
        done = False
        try:
            moved = True
            while moved and len(progress.events) < max_events:
                moved = False
                end = len(processes)  # Processes created during this pass wait for the next one
                later: list[tuple[int, ProcessID]] = []
                while True:
                    while permits and permits[0][1] not in waiting:
                        heapq.heappop(permits)  # woken since (or offered already)
                    if permits and not self._denied and (not queue or permits[0] < queue[0]):
                        at, pid = heapq.heappop(permits)
                        waiting.discard(pid)
                    elif queue and queue[0][0] < end:
                        at, pid = heapq.heappop(queue)
                        queued.discard(pid)
                    else:
                        break
                    process = processes[pid]
                    if process.terminal:
                        continue  # never moves again
                    self._refused = False
                    if self._advance_process(process, progress):
                        moved = True
                        later.append((at, pid))
                        queued.add(pid)
                    elif self._refused:
                        refused.add(pid)
                    for woken in touched:
                        if woken in queued:
                            continue
                        other = processes[woken]
                        if other.terminal:
                            continue
                        refused.discard(woken)
                        waiting.discard(woken)
                        queued.add(woken)
                        # Still ahead in this pass: offered in it; else in the next one
                        # (a Process started now has the highest ordinal: the next one).
                        if at < other.ordinal < end:
                            heapq.heappush(queue, (other.ordinal, woken))
                        else:
                            later.append((other.ordinal, woken))
                    touched.clear()
                    if len(progress.events) >= max_events:
                        break
                for item in later:
                    heapq.heappush(queue, item)
            done = True
        finally:
            tree.touch_log = None
            # Offered a move by the next advance: all but the asleep (all, after an error).
            if done:
                tree.kernel_awake = queued
                for pid in refused - waiting:
                    waiting.add(pid)
                    heapq.heappush(permits, (processes[pid].ordinal, pid))
            else:
                tree.kernel_awake = set(live)
                waiting.clear()
                permits.clear()
        return progress

    def _advance_process(self, process: ProcessState, progress: Progress) -> bool:
        if process.terminal:
            return False
        intent = process.terminal_intent
        if intent is not None:
            if process.in_flight():
                # It ends once its calls settle; its subtree stops now (spec §2.6): no child
                # takes another Step or starts another call meanwhile.
                return self._stop_children(progress, process, intent)
            owner, reason = process.intents[intent]
            cause = intent_cause(intent, owner)
            self._terminate(progress, process, cause, reason or f"{intent} requested by {owner}", None)
            return True
        if process.status != "running":
            return False
        if process.batch:
            record = process.frontier()
            if record is None or record.phase != "planned":
                return False
            if record.target == Target.FRAMEWORK:
                return self._settle_framework(progress, process, record)
            elif not self._permitted(process):
                self._refused = True
                return False
            else:
                attempt = self.ids.attempt_id()
                assert self.tree.incarnation is not None
                self._emit(
                    progress,
                    EffectDispatched.model_construct(
                        process_id=process.process_id,
                        effect_id=record.effect_id,
                        attempt_id=attempt,
                        incarnation_id=self.tree.incarnation,
                    ),
                )
                progress.dispatches.append(Dispatch(process.process_id, record.effect_id, attempt))
            return True
        self._run_step(progress, process)
        return True

    def _permitted(self, process: ProcessState) -> bool:
        dispatch = self.dispatch
        if not callable(dispatch):
            return dispatch
        if dispatch(process):
            return True
        self._denied = True
        return False

    # -- termination ---------------------------------------------------------

    def _terminate(
        self,
        progress: Progress,
        process: ProcessState,
        cause: str,
        reason: str,
        failure: Failure | None,
        output: JSON = None,
        output_of: OutputRef | None = None,
    ) -> None:
        unresolved = tuple(sorted(r.effect_id for r in process.unknown_effects()))
        self._emit(
            progress,
            ProcessTerminated.model_construct(
                process_id=process.process_id,
                status=CAUSE_STATUS[cause],  # type: ignore[arg-type]
                cause=cause,  # type: ignore[arg-type]
                reason=reason,
                failure=failure,
                output=None if output_of is not None else output,
                output_of=output_of,
                unresolved_effect_ids=unresolved,
            ),
        )

    def _stop_children(self, progress: Progress, process: ProcessState, intent: str) -> bool:
        """Record on each live child the intent ``process``'s end will give it (its own
        children follow when ``advance`` reaches it); True when one was recorded."""
        kind = stop_intent(intent)
        moved = False
        for cid in process.children:
            child = self.tree.processes[cid]
            if not child.terminal and kind not in child.intents:
                reason = f"parent {process.process_id} is ending ({intent} requested)"
                self._emit(
                    progress, ControlRequested.model_construct(process_id=cid, control=kind, reason=reason, owner="parent")
                )
                moved = True
        return moved

    def _fail(self, progress: Progress, process: ProcessState, failure: Failure) -> None:
        self._terminate(progress, process, FAILURE_CAUSE[failure.kind], failure.message, failure)

    # -- steps ---------------------------------------------------------------

    def _run_step(self, progress: Progress, process: ProcessState) -> None:
        if not process.budget.steps.allows(process.committed_steps + process.allocated.steps, 1):
            self._fail(
                progress,
                process,
                _failure(FailureKind.EXECUTION, EngineCode.LIMIT_STEPS, f"step budget of {process.process_id} is spent"),
            )
            return
        program = self.program_of(process)
        window = process.window()
        try:
            step = program.strategy.decide(process.state, window)
        except ClassifiedError as exc:
            self._fail(progress, process, exc.failure)
            return
        except BaseException as exc:  # noqa: BLE001 - any other strategy error fails the Step
            self._passed_on(exc)
            self._fail(progress, process, _strategy_failure("", exc))
            return
        try:
            checked = self._check_step(process, program, step, len(window))
            if isinstance(step.transition, Complete) and step.transition.output_of is not None:
                checked.output_of = _output_ref(step.transition.output_of, window[: step.consumed], checked.output)
        except _StepRefused as refusal:
            self._fail(progress, process, refusal.failure)
            return
        except Exception as exc:  # noqa: BLE001 - a Step of a shape the checks did not foresee
            # (a bare Effect where a tuple belongs, an unhashable wait id, a kind that is no
            # text): refused as the Step it is, never the owner's end (which lost the outcome
            # of the call this Step settles, written in the same append).
            self._fail(progress, process, _failure(
                FailureKind.CONTRACT, EngineCode.TRANSITION_INVALID,
                f"the Step cannot be checked: {type(exc).__name__}: {recorded_text(exc)}"))
            return
        consumed = window[: step.consumed]
        try:
            if step.next_state is not NO_STATE:
                next_state = step.next_state
            else:
                next_state = program.strategy.evolve(process.state, checked.facts, consumed)
        except ClassifiedError as exc:
            self._fail(progress, process, exc.failure)
            return
        except BaseException as exc:  # noqa: BLE001
            self._passed_on(exc)
            self._fail(progress, process, _strategy_failure("evolve failed: ", exc))
            return
        seq = process.committed_steps + 1
        transition = step.transition
        kind = TRANSITION_KINDS[type(transition)]
        effects = checked.effects
        self._emit(
            progress,
            StepCommitted.model_construct(
                process_id=process.process_id,
                step=seq,
                consumed=step.consumed,
                kind=kind,  # type: ignore[arg-type]
                facts=checked.facts,
                effects=len(effects),
                wait_id=transition.wait_id if isinstance(transition, Wait) else None,
                reason=transition.reason if isinstance(transition, Pause) else None,
            ),
            next_state=next_state,
        )
        if isinstance(transition, Checkpoint):
            self._emit(
                progress,
                CheckpointCommitted.model_construct(
                    process_id=process.process_id, step=seq, kind=transition.kind, acknowledges=checked.acknowledges
                ),
            )
        for index, effect in enumerate(effects):
            policy = checked.policies[index]
            payload = checked.payloads[index]
            if effect.input_like is not None and effect.target is Target.FRAMEWORK:
                payload = self._input_as_changes(process, payload, effect.input_like)
            self._emit(
                progress,
                EffectDeclared.model_construct(
                    process_id=process.process_id,
                    effect_id=derive_effect_id(process.process_id, seq, index),
                    step=seq,
                    index=index,
                    target=effect.target._value_,  # safe: the member's value, without Enum's Python-level property
                    payload=payload,
                    replay=policy[0],  # type: ignore[arg-type]
                    capabilities=policy[1],
                ),
            )
        if isinstance(transition, Complete):
            self._terminate(progress, process, "completion", "", None, checked.output, checked.output_of)
        elif isinstance(transition, Fail):
            self._fail(progress, process, transition.failure)

    def _input_as_changes(self, process: ProcessState, payload: JSON, like: object) -> JSON:
        """A start-child payload whose input is stored as its changes from the input of the
        child ``like`` names (``Effect.input_like``), when that child is the last of the same
        Program this Process started and the changes are shorter; else the payload as is."""
        if not isinstance(payload, dict) or payload.get("operation") != Operation.START_CHILD.value:
            return payload
        # Only from the last child of the same Program this Process started (what a consumer of
        # the feed keeps to rebuild it: docs/kafka.md); any other hint is ignored (a hint, not a rule).
        base = None
        for cid in reversed(process.children):
            child = self.tree.processes[cid]
            if str(child.program) == payload.get("program"):
                base = child if child.child_key == like else None
                break
        if base is None:
            return payload
        patch = input_changes(base.input, payload.get("input"), str(like))
        if patch is None:
            return payload
        stored = {k: v for k, v in payload.items() if k != "input"}
        stored[INPUT_PATCH] = patch
        return stored

    def _check_step(self, process: ProcessState, program: Program, step: Step, window: int) -> _CheckedStep:
        def refuse(code: str, message: str, kind: FailureKind = FailureKind.CONTRACT) -> _StepRefused:
            return _StepRefused(_failure(kind, code, message))

        if not isinstance(step, Step):
            raise refuse(EngineCode.TRANSITION_INVALID, f"decide returned {type(step).__name__}, not a Step")
        if not isinstance(step.consumed, int) or isinstance(step.consumed, bool) or not 0 <= step.consumed <= window:
            raise refuse(EngineCode.TRANSITION_INVALID, f"consumed {step.consumed!r} of a window of {window}")
        transition = step.transition
        if type(transition) not in TRANSITION_KINDS:
            raise refuse(EngineCode.TRANSITION_INVALID, f"unknown transition {type(transition).__name__}")
        try:
            facts = normalize(step.facts, what="step facts")
        except InvalidInput as exc:
            raise refuse(EngineCode.TRANSITION_INVALID, exc.message) from exc
        checked = _CheckedStep(facts)
        if isinstance(transition, Continue):
            if not isinstance(transition.effects, (tuple, list)):
                raise refuse(EngineCode.TRANSITION_INVALID,
                             f"Continue takes a tuple of Effects, not {type(transition.effects).__name__}")
            checked.effects = tuple(transition.effects)
            self._check_effects(process, program, checked.effects, checked, refuse, step.consumed)
        elif isinstance(transition, Wait):
            wait = process.waits.get(transition.wait_id)
            consumed_answer = False
            if wait is not None and wait.answered_by is not None:
                last = (
                    process.mailbox[process.cursor + step.consumed - 1].arrival
                    if step.consumed
                    else process.consumed_through
                )
                consumed_answer = wait.answered_by <= last
            if wait is None or wait.closed or consumed_answer:
                raise refuse(EngineCode.TRANSITION_INVALID, f"wait {transition.wait_id} is not an open wait")
        elif isinstance(transition, Pause):
            try:
                check_reason(transition.reason)
            except InvalidInput as exc:
                raise refuse(EngineCode.TRANSITION_INVALID, exc.message) from exc
        elif isinstance(transition, Complete):
            try:
                output = normalize(transition.output, what="output")
            except InvalidInput as exc:
                raise refuse(EngineCode.OUTPUT_INVALID, exc.message) from exc
            problems = schema_errors(output, program.descriptor.output_schema)
            if problems:
                raise refuse(EngineCode.OUTPUT_INVALID, "output violates the output schema: " + "; ".join(problems[:3]))
            checked.output = output
        elif isinstance(transition, Checkpoint):
            try:
                checked.acknowledges = normalize(transition.acknowledges, what="checkpoint")
            except InvalidInput as exc:
                raise refuse(EngineCode.TRANSITION_INVALID, exc.message) from exc
            from agentfold.domain.errors import valid_qualified_name

            if not valid_qualified_name(transition.kind):
                raise refuse(EngineCode.TRANSITION_INVALID, f"checkpoint kind {transition.kind!r} is not qualified")
        elif isinstance(transition, Fail) and not isinstance(transition.failure, Failure):
            raise refuse(EngineCode.TRANSITION_INVALID, "a fail transition needs a Failure")
        return checked

    def _check_effects(
        self,
        process: ProcessState,
        program: Program,
        effects: Sequence[Effect],
        checked: _CheckedStep,
        refuse: Any,
        consumed: int = 0,
    ) -> None:
        opening: set[str] = set()
        reserve = 0
        for effect in effects:
            if not isinstance(effect, Effect):
                raise refuse(EngineCode.EFFECT_INVALID, f"{type(effect).__name__} is not an Effect")
            if not isinstance(effect.target, Target):
                raise refuse(EngineCode.EFFECT_INVALID, f"an Effect's target is a Target, not {effect.target!r}")
            if effect.normalized:
                checked.payloads.append(effect.payload)
            else:  # built directly, not by dispatcher_effect() & co.
                try:
                    checked.payloads.append(normalize(effect.payload, what="effect payload"))
                except InvalidInput as exc:
                    raise refuse(EngineCode.EFFECT_INVALID, exc.message) from exc
            if effect.target is Target.DISPATCHER:
                try:
                    policy = program.policy(effect)
                except BaseException as exc:  # SystemExit too: the Program's own code
                    self._passed_on(exc)
                    raise refuse(EngineCode.EFFECT_INVALID, f"the Program's policy for effect {len(checked.policies)} "
                                 f"failed: {_raised(exc)}") from exc
                if not isinstance(policy, EffectPolicy):  # one checks its own fields when built
                    raise refuse(EngineCode.EFFECT_INVALID, f"the Program's policy for effect {len(checked.policies)} "
                                 f"returned {type(policy).__name__}, not an EffectPolicy")
                required = policy.required_capabilities
                # Safe: nothing required, nothing missing (the sets are built only when something is).
                missing = set(required) - set(process.capabilities) if required else None
                if missing:
                    raise refuse(
                        EngineCode.CAPABILITY_DENIED,
                        f"effect requires capabilities {sorted(missing)} the process does not hold",
                    )
                replay = policy.replay
                # Safe: a Replay member's value (what .value returns) without Enum's Python-level property.
                replay_text = replay._value_ if type(replay) is Replay else replay.value
                checked.policies.append((replay_text, tuple(sorted(required)) if required else ()))
                reserve += 1
                continue
            checked.policies.append(("never", ()))
            reserve += 1
            payload = checked.payloads[-1] if isinstance(checked.payloads[-1], dict) else {}
            try:
                op = Operation(str(payload.get("operation")))
            except ValueError:
                raise refuse(EngineCode.EFFECT_INVALID, f"unknown framework operation {payload.get('operation')!r}") from None
            if op is Operation.START_CHILD and holds_input_patch("framework", payload):
                raise refuse(EngineCode.EFFECT_INVALID, f"a start-child payload without an input holds no {INPUT_PATCH}: "
                             "the kernel writes it (give the whole input, and start_child_effect(..., input_like=key))")
            try:
                if op in (Operation.WAIT, Operation.WAIT_CHILDREN):
                    key = WaitKey(payload["key"])
                    if key in process.open_wait_keys or key in opening:
                        raise refuse(EngineCode.EFFECT_INVALID, f"wait key {key} is already open")
                    opening.add(key)
                    if op is Operation.WAIT and payload.get("response_schema") is not None:
                        # wait_effect() checks it; a wait built directly was taken, and every answer
                        # to it then failed (a bare TypeError that stopped the owner).
                        check_schema(payload["response_schema"], "#response_schema")
                    if op is Operation.WAIT_CHILDREN:
                        reserve += 1
                        spec = ChildWaitSpec.from_json(payload)
                        # Scope's ChildWaitCondition.Valid: a quorum is an integer, given for
                        # "quorum" only (from_json, which the fold also reads stored payloads
                        # with, would take "1", 1.9 or an all/any with a quorum).
                        quorum = payload.get("quorum")
                        if "quorum" in payload and (not isinstance(quorum, int) or isinstance(quorum, bool)):
                            raise refuse(EngineCode.EFFECT_INVALID, f"a quorum is an integer, not {quorum!r}")
                        if spec.condition != "quorum" and quorum not in (None, 0):
                            raise refuse(
                                EngineCode.EFFECT_INVALID, f"a quorum applies to condition quorum, not {spec.condition}"
                            )
                        for cid in spec.children:
                            child = self.tree.processes.get(cid)
                            if child is None or child.parent_id != process.process_id:
                                raise refuse(EngineCode.EFFECT_INVALID, f"{cid} is not a direct child of the waiter")
                else:
                    # An unbound Program is a failed start the parent observes
                    # (engine.child.deployment_unavailable), not a refused Step.
                    check_child_operation(op, payload, self.tree.bound)
            except _StepRefused:
                raise
            except (InvalidInput, KeyError, TypeError, ValueError) as exc:
                raise refuse(EngineCode.EFFECT_INVALID, f"invalid {op.value} effect: {recorded_text(exc)}") from exc
        if effects and not process.budget.effects.allows(process.prepared_effects + process.allocated.effects, len(effects)):
            raise refuse(EngineCode.LIMIT_EFFECTS, f"{len(effects)} effects exceed the effects budget", FailureKind.EXECUTION)
        if reserve and not process.budget.signals.allows(
            process.accepted_signals + process.allocated.signals + process.reserved_signals, reserve
        ):
            raise refuse(
                EngineCode.LIMIT_SIGNALS, "settlement signals would exceed the signals budget", FailureKind.EXECUTION
            )
        # The mailbox bound too (spec 2.5 step 6, admission's rule 8): what stays pending after
        # this Step, the settlements already reserved and these must fit, or a full mailbox
        # would refuse every host signal afterwards.
        pending_after = process.pending_count - consumed + process.reserved_signals
        if reserve and pending_after + reserve > process.limits_max_pending:
            raise refuse(
                EngineCode.LIMIT_SIGNALS,
                f"{reserve} settlement signal(s) would exceed the mailbox bound of {process.limits_max_pending} "
                f"pending signals ({pending_after} pending or reserved)",
                FailureKind.EXECUTION,
            )

    # -- framework effects ---------------------------------------------------

    def _settle_framework(self, progress: Progress, process: ProcessState, record: EffectRecord) -> bool:
        op = Operation(str(record.operation))
        payload = record.payload
        pid = process.process_id
        eid = record.effect_id
        if op in (Operation.WAIT, Operation.WAIT_CHILDREN):
            # Settled by the fold as soon as it reaches the frontier of a running Process
            # (agentfold.domain.tree: _settle_implicit); reaching here means the Process is not running.
            return False
        elif op is Operation.START_CHILD:
            self._start_child(progress, process, record)
            return True
        elif op is Operation.SIGNAL_CHILD:
            child_id = ProcessID(payload["child"])
            signal = payload["signal"]
            request = SignalRequest(SignalID(signal["id"]), signal.get("payload"), signal.get("wait_id"))
            receipt: dict[str, JSON] = {"child": child_id, "signal_id": request.id}
            child = self.tree.processes.get(child_id)
            if child is None or child.parent_id != pid:
                receipt["failure"] = _failure(
                    FailureKind.CONTRACT, EngineCode.CHILD_CONTROL_NOT_OWNED, f"{child_id} is not a child of {pid}"
                ).to_json()
                self._emit(progress, EffectSettled.model_construct(process_id=pid, effect_id=eid, status="failed", payload=receipt))
                return True
            program = self.programs(child.program)
            try:
                admission = check_admission(
                    child, [request], source="parent", parent_schema=True, check_signal_schema=program is not None,
                    signal_schema=program.descriptor.signal_schema if program is not None else None,
                )
            except (Rejected, InvalidInput) as exc:
                receipt["failure"] = _failure(
                    FailureKind.EXECUTION, EngineCode.CHILD_SIGNAL_REJECTED, exc.message
                ).to_json()
                self._emit(progress, EffectSettled.model_construct(process_id=pid, effect_id=eid, status="failed", payload=receipt))
                return True
            for new in admission.new:
                self._emit(
                    progress,
                    SignalAdmitted.model_construct(
                        process_id=child_id, signal_id=new.id, wait_id=new.wait_id, payload=new.payload, source="parent"
                    ),
                )
            self._emit(progress, EffectSettled.model_construct(process_id=pid, effect_id=eid, status="succeeded", payload=receipt))
        else:
            child_id = ProcessID(payload["child"])
            receipt = {"child": child_id}
            child = self.tree.processes.get(child_id)
            if child is None or child.parent_id != pid:
                receipt["failure"] = _failure(
                    FailureKind.CONTRACT, EngineCode.CHILD_CONTROL_NOT_OWNED, f"{child_id} is not a child of {pid}"
                ).to_json()
                self._emit(progress, EffectSettled.model_construct(process_id=pid, effect_id=eid, status="failed", payload=receipt))
                return True
            if not child.terminal and "cancel" not in child.intents:
                self._emit(
                    progress,
                    ControlRequested.model_construct(process_id=child_id, control="cancel", reason=payload["reason"], owner="parent"),
                )
            self._emit(progress, EffectSettled.model_construct(process_id=pid, effect_id=eid, status="succeeded", payload=receipt))
        return True

    def _start_child(self, progress: Progress, parent: ProcessState, record: EffectRecord) -> None:
        try:
            spec = ChildSpec.from_json(record.payload, self.tree.bound)
        except InvalidInput as exc:  # program.unbound: everything else was checked at the Step
            failure = _failure(FailureKind.EXTERNAL, EngineCode.CHILD_DEPLOYMENT_UNAVAILABLE, exc.message)
            body = {"key": record.payload["key"], "program": record.payload["program"], "failure": failure.to_json()}
            self._emit(
                progress,
                EffectSettled.model_construct(process_id=parent.process_id, effect_id=record.effect_id, status="failed", payload=body),
            )
            return
        child_id = child_process_id(record.effect_id)
        base = {"key": spec.key, "program": str(spec.program)}

        def refused(kind: FailureKind, code: str, message: str) -> None:
            body = {**base, "failure": _failure(kind, code, message).to_json()}
            self._emit(
                progress,
                EffectSettled.model_construct(process_id=parent.process_id, effect_id=record.effect_id, status="failed", payload=body),
            )

        tree = self.tree
        if spec.key in parent.child_keys or child_id in tree.processes:
            refused(FailureKind.CONTRACT, EngineCode.CHILD_IDENTITY_CONFLICT, f"child key {spec.key} is already used")
            return
        if not spec.capabilities <= set(parent.capabilities):
            refused(
                FailureKind.CONTRACT,
                EngineCode.CHILD_CAPABILITY_ESCALATION,
                f"child capabilities {sorted(spec.capabilities - set(parent.capabilities))} exceed the parent's",
            )
            return
        limits = tree.limits
        # The live children (not the parent's every child ever started): a long Interaction
        # has thousands of finished Tool children, and this runs once per child start.
        active = parent.live_children
        if (
            parent.depth + 1 > limits.max_depth
            or (limits.max_children is not None and len(parent.children) >= limits.max_children)
            or active >= limits.max_active_children
            or (limits.max_tree_processes is not None and len(tree.processes) >= limits.max_tree_processes)
        ):
            refused(FailureKind.EXECUTION, EngineCode.CHILD_TREE_LIMIT, "starting this child would exceed a tree limit")
            return
        debit = child_debit(parent.budget, spec.budget)
        if isinstance(debit, str):
            refused(FailureKind.EXECUTION, EngineCode.CHILD_BUDGET_EXHAUSTED, debit)
            return
        allocated = parent.allocated.plus(debit)
        for name, used in (
            ("steps", parent.committed_steps + 1),
            ("effects", parent.prepared_effects),
            ("signals", parent.accepted_signals + parent.reserved_signals),
        ):
            if not getattr(parent.budget, name).allows(used + getattr(allocated, name), 0):
                refused(
                    FailureKind.EXECUTION,
                    EngineCode.CHILD_BUDGET_EXHAUSTED,
                    f"the child's {name} grant does not fit the parent's remaining budget",
                )
                return
        parent_program = self.program_of(parent)
        child_program = parent_program.child(spec.program)
        if child_program is None:
            refused(
                FailureKind.EXTERNAL,
                EngineCode.CHILD_DEPLOYMENT_UNAVAILABLE,
                f"program {spec.program.name} is not bound to {parent_program.ref.name}",
            )
            return
        try:
            value = normalize(spec.input, what="child input")
        except InvalidInput as exc:
            refused(FailureKind.CONTRACT, EngineCode.CHILD_INPUT_INVALID, exc.message)
            return
        problems = schema_errors(value, child_program.descriptor.input_schema)
        if problems:
            refused(FailureKind.CONTRACT, EngineCode.CHILD_INPUT_INVALID, "; ".join(problems[:3]))
            return
        try:
            initial = child_program.strategy.initial(value)
        except ClassifiedError as exc:
            refused(exc.failure.kind, exc.failure.code, exc.failure.message)
            return
        except Exception as exc:  # noqa: BLE001
            refused(FailureKind.EXECUTION, EngineCode.PROCESS_START_FAILED, f"{type(exc).__name__}: {recorded_text(exc)}")
            return
        # ProcessStarted also settles the start-child Effect (the fold derives its result). The
        # child's initial state goes with it: checked here, neither checked nor computed again.
        self._emit(
            progress,
            ProcessStarted.model_construct(process_id=child_id, parent_id=parent.process_id, start_effect_id=record.effect_id),
            initial if self.tree.programs is not None and self.tree.programs(child_program.ref) is child_program
            else _MISSING,
        )

    # -- dispatcher outcomes ---------------------------------------------------

    def settle_dispatch(
        self,
        process_id: ProcessID,
        effect_id: EffectID,
        attempt_id: EffectAttemptID,
        status: SettlementStatus,
        payload: JSON,
        diagnostic: Failure | None,
    ) -> list[TreeEvent]:
        """Record a dispatcher's outcome; a stale attempt's outcome is dropped (returns [])."""
        process = self.tree.processes.get(process_id)
        record = process.effect(effect_id) if process is not None else None
        if record is None or record.phase != "pending" or record.attempt_id != attempt_id:
            return []
        if record.incarnation_id != self.tree.incarnation:
            return []
        event = EffectSettled.model_construct(
            process_id=process_id,
            effect_id=effect_id,
            status=status._value_,  # safe: the member's value, without Enum's Python-level property
            payload=payload,
            attempt_id=attempt_id,
            diagnostic=diagnostic,
        )
        self.tree.apply(event)
        return [event]

    # -- recovery ------------------------------------------------------------

    def activate(self, incarnation: TreeIncarnationID) -> Progress:
        """Take ownership: ``WriterActivated``, then decide every in-flight Effect.

        A dispatched, unsettled Effect is dispatched again under the same EffectID only
        when its policy is ``same_identity`` (as declared, and as its Program says now:
        ``replay_allowed``) and no terminal intent is pending; otherwise it settles unknown
        without any call.
        """
        progress = Progress()
        assert self.tree.root_id is not None and self.tree.incarnation is not None
        self._emit(
            progress,
            WriterActivated.model_construct(
                process_id=self.tree.root_id,
                incarnation_id=incarnation,
                previous_incarnation_id=self.tree.incarnation,
            ),
        )
        for process in list(self.tree.processes.values()):
            for record in process.in_flight():
                # A paused Process's call too: the pause did not stop it, and its policy says
                # making it again is safe (scope-kernel.md §3.8: only a terminal intent forces
                # never; an ancestor's counts, as Scope records it on the subtree at once).
                if self.tree.ending(process) is None and replay_allowed(self.programs(process.program), record):
                    attempt = self.ids.attempt_id()
                    self._emit(
                        progress,
                        EffectDispatched.model_construct(
                            process_id=process.process_id,
                            effect_id=record.effect_id,
                            attempt_id=attempt,
                            incarnation_id=incarnation,
                        ),
                    )
                    progress.dispatches.append(Dispatch(process.process_id, record.effect_id, attempt))
                else:
                    self._emit(
                        progress,
                        EffectSettled.model_construct(
                            process_id=process.process_id,
                            effect_id=record.effect_id,
                            status="unknown",
                            payload=None,
                            attempt_id=record.attempt_id,
                            diagnostic=_failure(
                                FailureKind.EXTERNAL,
                                EngineCode.DISPATCH_INTERRUPTED,
                                "the writer that dispatched this effect stopped before recording its outcome",
                            ),
                        ),
                    )
        return progress

    # -- host admission ------------------------------------------------------

    def _live(self, pid: ProcessID) -> ProcessState:
        process = self.tree.processes.get(pid)
        if process is None:
            raise NotFound("engine.process.not_found", f"process {pid} is not in tree {self.tree.tree_id}")
        return process

    def admit_signals(self, pid: ProcessID, requests: Sequence[SignalRequest]) -> list[TreeEvent]:
        """Admit host signals all or nothing; returns [] when every identity was already admitted."""
        process = self._live(pid)
        program = self.program_of(process)
        admission = check_admission(process, requests, source="host", signal_schema=program.descriptor.signal_schema)
        events: list[TreeEvent] = []
        for request in admission.new:
            event = SignalAdmitted.model_construct(
                process_id=pid, signal_id=request.id, wait_id=request.wait_id, payload=request.payload, source="host"
            )
            self.tree.apply(event)
            events.append(event)
        return events

    def request_control(
        self, pid: ProcessID, control: str, reason: str | None = None, owner: str = "host"
    ) -> list[TreeEvent]:
        """Pause, resume, cancel, kill or deadline; repeating a recorded intent changes nothing.

        ``reason`` None: the default text; an empty or oversize reason is refused first
        (``control.invalid``), also when the request would change nothing."""
        if control == "pause":
            reason = check_reason("paused by host" if reason is None else reason)
        elif control in ("cancel", "kill", "deadline"):
            reason = check_reason(f"{control} requested by {owner}" if reason is None else reason)
        elif control != "resume":
            raise InvalidInput("control.invalid", f"unknown control {control!r}",
                               hint="the controls are pause, resume, cancel, kill and deadline", recorded_hint=False)
        process = self._live(pid)
        if process.terminal:
            raise Rejected(
                "engine.process.finished", f"process {pid} already ended {process.status}",
                hint="an ended process takes no more controls", process_id=pid,
            )
        if control == "pause":
            if process.status == "paused":
                return []
            if process.status not in ("running", "waiting") or process.terminal_intent is not None:
                state = f"{process.terminal_intent} requested" if process.terminal_intent else process.status
                raise Rejected("engine.process.control_invalid", f"cannot pause process {pid}: it is {state}")
        elif control == "resume":
            if process.status != "paused":
                raise Rejected(
                    "engine.process.control_invalid", f"cannot resume process {pid}: it is {process.status}, not paused"
                )
        elif control in process.intents:  # cancel, kill, deadline
            return []
        event = ControlRequested.model_construct(process_id=pid, control=control, reason=reason or "", owner=owner)  # type: ignore[arg-type]
        self.tree.apply(event)
        return [event]

    def resolve_effect(
        self,
        effect_id: EffectID,
        status: SettlementStatus,
        payload: JSON,
        *,
        resolved_by: str = "host",
        attempt_id: EffectAttemptID | None = None,
        process_id: ProcessID | None = None,
    ) -> list[TreeEvent]:
        """Settle an unknown Effect with a definite result (host investigation or replay)."""
        process, record = resolvable(self.tree, effect_id, process_id)
        if not status.definite:
            raise InvalidInput("engine.effect.settlement_invalid", "a resolution must be succeeded or failed")
        value = normalize(payload, what="resolution payload")
        if resolved_by == "host" and record.target == Target.DISPATCHER:
            self._check_resolution(process, effect_id, status, value)
        event = EffectResolved.model_construct(
            process_id=process.process_id,
            effect_id=effect_id,
            status=status.value,  # type: ignore[arg-type]
            payload=value,
            resolved_by=resolved_by,  # type: ignore[arg-type]
            attempt_id=attempt_id,
        )
        self.tree.apply(event)
        return [event]

    def _check_resolution(self, process: ProcessState, effect_id: EffectID, status: SettlementStatus, payload: JSON) -> None:
        """The Program's own check of a host's outcome (``Program.check_resolution``), before
        anything is recorded. A Program not bound here is not asked (``audit``-style hosts
        without the deployment's catalog record what they are given, as before)."""
        program = self.programs(process.program)
        check = program.check_resolution if program is not None else None
        if program is None or check is None:
            return
        try:
            # Inside: the request's expansion is the Program's code too. Raised from this
            # owner's cycle, anything but an AgentfoldError would stop the owner line.
            check(program, effect_request(self.tree, process.process_id, effect_id, program), status, payload)
        except AgentfoldError:
            raise
        except BaseException as exc:  # SystemExit too: the Program's own code (a Ctrl-C on the operator's thread passes)
            self._passed_on(exc)
            raise InvalidInput(
                "engine.effect.settlement_invalid",
                f"the check of program {program.descriptor.name} refused the outcome of effect {effect_id}: "
                f"{_raised(exc)}",
                hint="build the outcome with the Program's settle helpers (agentfold resolve does); if the check "
                "itself fails, fix the Program's check_resolution",
            ) from exc


class _StepRefused(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(slots=True)
class _CheckedStep:
    facts: JSON
    output: JSON = None
    output_of: OutputRef | None = None
    acknowledges: JSON = None
    policies: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    effects: tuple[Effect, ...] = ()
    payloads: list[JSON] = field(default_factory=list)  # each Effect's, normalized


def _strategy_failure(prefix: str, exc: BaseException) -> Failure:
    """The Failure of a Step whose decide or evolve raised: ``execution.step.failed``, of
    kind ``panic`` for what no Program should raise (SystemExit, GeneratorExit, ...: as a
    dispatcher's are ``engine.dispatch.panicked``). A KeyboardInterrupt is one too, except on
    the thread a Ctrl-C reaches (``Kernel(interruptible=True)``): there it is the operator's."""
    kind = FailureKind.EXECUTION if isinstance(exc, Exception) else FailureKind.PANIC
    return _failure(kind, EngineCode.STEP_FAILED, prefix + _raised(exc))


def _raised(exc: BaseException) -> str:
    """``Name: text`` of a raised error, or its name alone when it has no text."""
    text = recorded_text(exc).strip()
    return type(exc).__name__ + (f": {text}" if text else "")


def _output_ref(hint: OutputOf, consumed: Sequence[Signal], output: JSON) -> OutputRef | None:
    """The reference to store for a completion's output, when the hint holds: the output is
    exactly the value at ``hint.path`` of a succeeded settlement this Step consumes."""
    for signal in consumed:
        if signal.effect_id == hint.effect_id and signal.status is SettlementStatus.SUCCEEDED:
            found, value = value_at(signal.payload, hint.path)
            if found and canonical_bytes(value) == canonical_bytes(output):
                return OutputRef(effect_id=hint.effect_id, path=tuple(hint.path))
            return None
    return None


__all__ = [
    "Dispatch",
    "IdSource",
    "Kernel",
    "Progress",
    "start_tree",
    "WaitID",
]
