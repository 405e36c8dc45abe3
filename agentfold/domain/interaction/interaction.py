"""The Interaction: a model/tool loop as a decide/evolve Strategy (spec 2-5).

Per Step, in the words of the seed: request a model call (after applying pending
steering), accept its result through the finish-reason gate, admit a tool round with
a Checkpoint, advance the round call by call (rejecting truncated, unknown or
malformed calls model-visibly), run ordinary Tools as one child Process per call in
bounded windows and Delegates as exact child Programs, collect their outcomes, close
the round with a Checkpoint, then either call the model again or complete (directly
with tool results, or with the model's final response) through the optional
completion validator.

Effects: model calls and context preparation are dispatcher Effects whose stored
payload references the working context by length; the runtime expands them with the
messages from the Process state (``expand_request``), so a conversation is stored
once and not once per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentfold.domain.budget import Budget, Quota
from agentfold.domain.canonical import JSON, normalize
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, InvalidInput, recorded_text
from agentfold.domain.interaction.chat import (
    FINISH_REASONS,
    INPUT_SCHEMA,
    OUTPUT_SCHEMA,
    ChatInput,
    ToolCall,
    parse_response,
    tool_message,
)
from agentfold.domain.interaction.refs import delegate_child_key, tool_child_key
from agentfold.domain.interaction.state import (
    InteractionState,
    Phase,
    apply_op,
    is_child_start,
    is_child_wait_satisfied,
    is_dispatch_settlement,
    is_steer,
    is_wait_opened,
    merge_steer,
    model_result,
    round_tool_results,
    state_error,
    tool_completion,
)
from agentfold.domain.interaction.toolset import DelegateSpec, ToolManifest, prepare_arguments
from agentfold.domain.program import (
    Boundary,
    Checkpoint,
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Effect,
    Fail,
    Program,
    Signal,
    Step,
    Transition,
    Wait,
    dispatcher_effect,
    start_child_effect,
    wait_children_effect,
)

STEER_SCHEMA: JSON = {
    "type": "object",
    "required": ["steer"],
    "additionalProperties": False,
    "properties": {
        "steer": {
            "type": "object",
            "required": ["messages"],
            "additionalProperties": False,
            "properties": {
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    # Only user messages steer: anything else is refused before admission.
                    "items": {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": "user"}}},
                }
            },
        }
    },
}

MAX_FEEDBACK_BYTES = 4096


@dataclass(frozen=True, slots=True)
class CompletionCandidate:
    """What a completion validator judges: the working context before the candidate, the
    candidate Output, and every successful Delegate Artifact so far (in call order)."""

    working_context: tuple[dict[str, Any], ...]
    output: dict[str, Any]
    artifacts: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class CompletionDecision:
    accepted: bool
    feedback: str = ""

    def valid(self) -> bool:
        """Scope's ``CompletionDecision.Valid``: accepted with empty feedback, or rejected with
        non-empty feedback, trimmed (Go's white space), of at most 4096 bytes; here also text
        that encodes as UTF-8 (no lone surrogate), which the stored feedback must be."""
        if not isinstance(self.accepted, bool) or not isinstance(self.feedback, str):
            return False
        if self.accepted:
            return self.feedback == ""
        text = self.feedback
        try:
            size = len(text.encode())
        except UnicodeEncodeError:  # a lone surrogate: not valid UTF-8
            return False
        return bool(text) and text == text.strip(GO_WHITE_SPACE) and size <= MAX_FEEDBACK_BYTES


#: What Go's ``strings.TrimSpace`` trims (``unicode.IsSpace``); Python's ``str.strip()`` trims
#: more (e.g. the separators U+001C-U+001F), which would refuse feedback Scope accepts.
GO_WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"

CompletionValidator = Callable[[CompletionCandidate], CompletionDecision]
ContextPolicy = Callable[[tuple[dict[str, Any], ...]], list[dict[str, Any]]]


@dataclass(frozen=True, eq=False)
class InteractionDefinition:
    """Immutable Interaction behaviour (the seed's DefinitionConfig)."""

    name: str
    description: str = ""
    manifest: ToolManifest = field(default_factory=ToolManifest)
    tool_program: Program | None = None
    tool_budget: Budget = field(default_factory=Budget)
    tool_capabilities: frozenset[str] = frozenset()
    max_model_calls: Quota = field(default_factory=Quota)
    max_concurrent_tool_calls: int = 0
    completion_validator: CompletionValidator | None = None
    context_policy: ContextPolicy | None = None
    prepare_context: bool = False

    def __post_init__(self) -> None:
        if self.max_model_calls.maximum == 0:
            raise InvalidInput(
                "interaction.definition.invalid", "a finite zero MaxModelCalls can never call a model",
                hint="leave it unlimited or allow at least one call",
            )
        if self.max_concurrent_tool_calls < 0:
            raise InvalidInput("interaction.definition.invalid", "MaxConcurrentToolCalls must not be negative")
        has_tools = self.manifest.configured
        if has_tools and self.tool_program is None:
            raise InvalidInput("interaction.definition.invalid", "tools need their ToolSet program")
        if not has_tools and (
            self.tool_budget != Budget() or self.tool_capabilities or self.max_concurrent_tool_calls
        ):
            raise InvalidInput(
                "interaction.definition.invalid",
                "ToolBudget, ToolCapabilities and MaxConcurrentToolCalls need a configured ToolSet",
            )

    @property
    def max_concurrent(self) -> int:
        return max(1, self.max_concurrent_tool_calls)

    def descriptor(self) -> Descriptor:
        return Descriptor(
            self.name,
            self.description,
            input_schema=INPUT_SCHEMA,
            output_schema=OUTPUT_SCHEMA,
            signal_schema=STEER_SCHEMA,
        )

    def child_programs(self) -> tuple[Program, ...]:
        children = [self.tool_program] if self.tool_program is not None else []
        children += [d.program for d in self.manifest.delegates]
        return tuple(children)


class _Plan:
    """One Step being decided: ops applied to a working copy, effects, the transition."""

    def __init__(self, strategy: InteractionStrategy, state: InteractionState, consumed: Sequence[Signal]) -> None:
        self.strategy = strategy
        self.state = merge_steer(state, consumed)
        self.consumed = consumed
        self.ops: list[dict[str, Any]] = []

    def add(self, op: dict[str, Any]) -> None:
        self.state = apply_op(self.state, op, self.consumed, self.strategy.delegate_names)
        self.ops.append(op)

    def step(self, transition: Transition) -> Step:
        # The working copy is exactly evolve(state, facts, consumed): decide applied the same ops.
        return Step(len(self.consumed), transition, {"ops": self.ops}, next_state=self.state)


def _fail(kind: FailureKind, code: str, message: str) -> Fail:
    return Fail(Failure(kind, code, message))


def _delegate_input(spec: DelegateSpec, call: ToolCall) -> tuple[JSON, str | None]:
    """The child input of a Delegate call, or the model-visible text of why it cannot start
    (spec 4.1: every preparation problem is a rejected result and the round continues)."""
    arguments, problem = prepare_arguments(call.arguments, spec.input_schema)
    if problem is not None:
        return None, problem if problem.startswith("arguments are not valid JSON") else (
            f"arguments violate the delegated worker input contract: {problem}"
        )
    try:
        return normalize(spec.child_input(arguments), what="delegated worker input"), None
    except Exception as exc:  # noqa: BLE001 - the Delegate's build_input is its author's code
        return None, f"preparing the delegated worker input failed: {type(exc).__name__}: {recorded_text(exc)}"


def tool_calls_not_completed(response: dict[str, Any]) -> str | None:
    """Why the Interaction fails the run on a parsed response with tool calls
    (``interaction.model.tool_calls_not_completed``): they came with a finish reason other
    than ``tool_calls`` or ``length``, so they are not executed. Shared with the recovery
    helpers (``settle_model_result``), which refuse such a response."""
    reason = response["finish_reason"]
    if response["message"].get("tool_calls") and reason not in ("tool_calls", "length"):
        return f'model output ended with "{reason}"; tool calls were not executed'
    return None


def response_problem(response: dict[str, Any]) -> str | None:
    """Why the Interaction refuses a parsed final model response (``interaction.model.invalid_response``).

    A final response (no tool calls) completes with any portable finish reason, ``length``
    and ``content_filter`` included, as Scope's does (``acceptFinalModelResponse`` asks only
    for a finished message); the Output carries the reason. Shared with the recovery helpers
    (``settle_model_result``), so a host's resolution is refused exactly when the
    Interaction would fail the run on it.
    """
    if not response["message"].get("tool_calls") and response["finish_reason"] not in FINISH_REASONS:
        return (f'a final response must end with one of {", ".join(FINISH_REASONS)}; '
                f'it ended with "{response["finish_reason"]}"')
    return None


class InteractionStrategy:
    """decide/evolve for one Interaction Process."""

    def __init__(self, definition: InteractionDefinition) -> None:
        self.definition = definition
        self.delegate_names = frozenset(d.name for d in definition.manifest.delegates)

    # -- Strategy contract -------------------------------------------------

    def initial(self, input: JSON) -> InteractionState:
        chat = ChatInput.parse(input)
        return InteractionState(messages=chat.messages, options=chat.options)

    def evolve(self, state: InteractionState, facts: JSON, consumed: Sequence[Signal]) -> InteractionState:
        new = merge_steer(state, consumed)
        for op in (facts or {}).get("ops", []):
            new = apply_op(new, op, consumed, self.delegate_names)
        return new

    def encode_state(self, state: InteractionState) -> JSON:
        return state.to_json()

    def decode_state(self, data: JSON) -> InteractionState:
        return InteractionState.from_json(data)

    def decide(self, state: InteractionState, window: Sequence[Signal]) -> Step:
        phase = state.phase
        if phase is Phase.COMPLETED:
            raise state_error("a completed Interaction takes no more Steps")
        expected, predicate = self._expectation(state, phase)
        consumed, taken = _scan(window, expected, predicate)
        if len(taken) < expected:
            raise state_error(f"{phase.value}: expected {expected} settlement signal(s), found {len(taken)}")
        plan = _Plan(self, state, consumed)
        if phase is Phase.READY_MODEL:
            return self._request_model(plan)
        if phase is Phase.AWAITING_CONTEXT:
            return self._accept_context(plan, taken[0])
        if phase is Phase.AWAITING_MODEL:
            return self._accept_model(plan, taken[0])
        if phase is Phase.ADVANCING_TOOLS:
            return self._advance(plan)
        if phase is Phase.AWAITING_CHILD_STARTS:
            return self._record_starts(plan, taken)
        if phase is Phase.AWAITING_CHILD_WAIT_OPEN:
            plan.add({"op": "set_wait"})
            wait_id = plan.state.round.batch.wait_id  # type: ignore[union-attr]
            return plan.step(Wait(wait_id))  # type: ignore[arg-type]
        if phase is Phase.WAITING_CHILDREN:
            return self._record_outcomes(plan, taken[0])
        return self._finish_round(plan)

    # -- expectations ------------------------------------------------------

    def _expectation(self, state: InteractionState, phase: Phase) -> tuple[int, Callable[[Signal], bool]]:
        if phase in (Phase.AWAITING_MODEL, Phase.AWAITING_CONTEXT):
            return 1, is_dispatch_settlement
        if phase is Phase.AWAITING_CHILD_STARTS:
            assert state.round is not None and state.round.batch is not None
            starting = sum(1 for i in state.round.batch.invocations if i.starting)
            return starting, is_child_start
        if phase is Phase.AWAITING_CHILD_WAIT_OPEN:
            return 1, is_wait_opened
        if phase is Phase.WAITING_CHILDREN:
            wait_id = state.round.batch.wait_id  # type: ignore[union-attr]
            return 1, lambda s: is_child_wait_satisfied(s, wait_id)
        return 0, lambda s: False

    # -- model calls -------------------------------------------------------

    def _request_model(self, plan: _Plan, *, apply_steer: bool = True) -> Step:
        d = self.definition
        count = plan.state.model_call_count
        if not d.max_model_calls.allows(count, 1):
            return plan.step(
                _fail(
                    FailureKind.EXECUTION,
                    "interaction.limit.model_calls",
                    f"Interaction reached its configured model-call limit ({d.max_model_calls.maximum}) "
                    "before a final response",
                )
            )
        steer = [sid for sid, _ in plan.state.pending_steer] if apply_steer else []
        if steer:
            plan.add({"op": "apply_steer", "ids": steer})
        sequence = count + 1
        if d.prepare_context:
            plan.add({"op": "prepare", "sequence": sequence, "steer": steer})
            effect = dispatcher_effect(
                {"prepare_context": {"model_call_sequence": sequence, "message_count": len(plan.state.messages)}}
            )
            return plan.step(Continue((effect,)))
        plan.add({"op": "model_call", "sequence": sequence})
        return plan.step(Continue((self._model_effect(plan.state, sequence, steer),)))

    def _model_effect(self, state: InteractionState, sequence: int, steer: Sequence[str]) -> Effect:
        body: dict[str, Any] = {"model_call_sequence": sequence, "message_count": len(state.messages)}
        if state.advertised:
            body["advertised_tool_names"] = list(state.advertised)
        if steer:
            body["applied_steer_signal_ids"] = list(steer)
        return dispatcher_effect({"model_call": body})

    def _accept_context(self, plan: _Plan, settlement: Signal) -> Step:
        if settlement.status is not None and settlement.status.value == "failed":
            return plan.step(_fail(FailureKind.EXTERNAL, "interaction.host.failed", _diagnostic(settlement.payload)))
        steer = list(plan.state.preparing_steer)
        sequence = plan.state.preparing
        plan.add({"op": "prepared_context"})
        plan.add({"op": "model_call", "sequence": sequence})
        return plan.step(Continue((self._model_effect(plan.state, sequence, steer),)))

    def _accept_model(self, plan: _Plan, settlement: Signal) -> Step:
        if settlement.status is not None and settlement.status.value == "failed":
            return plan.step(_fail(FailureKind.EXTERNAL, "interaction.host.failed", _diagnostic(settlement.payload)))
        result = model_result(plan.consumed)
        try:
            response = parse_response(result.get("response"))
        except InvalidInput as exc:
            raise ClassifiedError(FailureKind.EXTERNAL, "interaction.model.invalid_response", exc.message) from exc
        calls = response["message"].get("tool_calls", [])
        not_completed = tool_calls_not_completed(response)
        if not_completed is not None:
            return plan.step(_fail(FailureKind.EXTERNAL, "interaction.model.tool_calls_not_completed", not_completed))
        if result.get("replacement_messages") is not None:
            plan.add({"op": "replace_context"})
        if not calls:
            problem = response_problem(response)
            if problem is not None:
                raise ClassifiedError(FailureKind.EXTERNAL, "interaction.model.invalid_response", problem)
            if plan.state.pending_steer:
                plan.add({"op": "append_response"})
                return self._request_model(plan)
            output = {"model_response": response, "model_calls": plan.state.model_call_count}
            return self._complete(plan, output, [{"op": "append_response"}])
        plan.add({"op": "admit_round"})
        r = plan.state.round
        assert r is not None
        return plan.step(
            Checkpoint("interaction.round.admitted", {"model_call_sequence": r.sequence, "call_count": len(r.calls)})
        )

    # -- completion --------------------------------------------------------

    def _complete(self, plan: _Plan, output: dict[str, Any], context_ops: list[dict[str, Any]]) -> Step:
        validator = self.definition.completion_validator
        if validator is not None:
            candidate = CompletionCandidate(plan.state.messages, output, self._artifacts_at(plan.state))
            try:
                decision = validator(candidate)
            except Exception as exc:  # noqa: BLE001 - every validator error (a classified one too) is this failure
                return plan.step(
                    _fail(FailureKind.EXECUTION, "interaction.completion.validator_failed",
                          f"{type(exc).__name__}: {recorded_text(exc)}")
                )
            if not isinstance(decision, CompletionDecision) or not decision.valid():
                return plan.step(
                    _fail(
                        FailureKind.CONTRACT,
                        "interaction.completion.decision_invalid",
                        "CompletionValidator returned an invalid decision: a decision accepts with empty feedback or "
                        "rejects with trimmed UTF-8 feedback of at most 4096 bytes",
                    )
                )
            if not decision.accepted:
                for op in context_ops:
                    plan.add(op)
                plan.add({"op": "user", "text": decision.feedback})
                return self._request_model(plan, apply_steer=False)
        plan.add({"op": "complete"})
        return plan.step(Complete(output))

    def _artifacts_at(self, state: InteractionState) -> tuple[dict[str, Any], ...]:
        artifacts = list(state.artifacts)
        r = state.round
        if r is not None and r.cursor == len(r.calls):
            for call, result in zip(r.calls, r.results, strict=True):
                if call.name in self.delegate_names and result["disposition"] == "succeeded":
                    artifacts.append(
                        {
                            "model_call_sequence": r.sequence,
                            "tool_call_id": call.id,
                            "delegate_name": call.name,
                            "output": result["output"].get("details"),
                        }
                    )
        return tuple(artifacts)

    # -- rounds ------------------------------------------------------------

    def _advance(self, plan: _Plan) -> Step:
        """Advance the round by one call or one window (spec 2.4 "Advance round")."""
        d = self.definition
        r = plan.state.round
        assert r is not None
        cursor = r.cursor
        if cursor == len(r.calls):
            return plan.step(
                Checkpoint("interaction.round.complete", {"model_call_sequence": r.sequence, "call_count": len(r.calls)})
            )
        call = r.calls[cursor]
        progress = {"model_call_sequence": r.sequence, "results": cursor + 1}
        if r.finish_reason == "length":
            plan.add(
                {
                    "op": "reject",
                    "text": f'error: tool "{call.name}" was not executed because model output reached its token limit; '
                    "emit the complete call again",
                }
            )
            return plan.step(Checkpoint("interaction.round.progress", progress))
        delegate = d.manifest.delegate(call.name)
        if delegate is not None:
            first_input, text = _delegate_input(delegate, call)
            if text is not None:
                plan.add({"op": "reject", "text": f"error: {text}"})
                return plan.step(Checkpoint("interaction.round.progress", progress))
            effects: list[Effect] = []
            for index in range(cursor, len(r.calls)):
                other = r.calls[index]
                spec = d.manifest.delegate(other.name)
                if spec is None:
                    break
                # build_input is the Delegate author's code: called once per call
                child_input, text = (first_input, None) if index == cursor else _delegate_input(spec, other)
                if text is not None:
                    break
                effects.append(
                    start_child_effect(
                        ChildSpec(
                            delegate_child_key(r.sequence, other.id, other.name),
                            spec.program.ref,
                            child_input,
                            spec.budget,
                            spec.capabilities,
                        )
                    )
                )
            plan.add({"op": "start_batch", "kind": "delegate", "size": len(effects), "request": len(effects)})
            return plan.step(Continue(tuple(effects)))
        spec_tool = d.manifest.tool(call.name)
        if spec_tool is None:
            plan.add({"op": "reject", "text": f'error: tool "{call.name}" is not available'})
            return plan.step(Checkpoint("interaction.round.progress", progress))
        size = d.manifest.tool_window(r.calls, cursor, d.max_concurrent)
        start = min(size, d.max_concurrent)
        plan.add({"op": "start_batch", "kind": "tool", "size": size, "request": start})
        return plan.step(Continue(tuple(self._tool_starts(plan.state, cursor, range(start)))))

    def _tool_starts(self, state: InteractionState, base: int, offsets: Sequence[int]) -> list[Effect]:
        d = self.definition
        r = state.round
        assert r is not None and d.tool_program is not None
        return [
            start_child_effect(
                ChildSpec(
                    tool_child_key(r.sequence, base + offset),
                    d.tool_program.ref,
                    {"call": r.calls[base + offset].to_json()},
                    d.tool_budget,
                    d.tool_capabilities,
                )
            )
            for offset in offsets
        ]

    def _record_starts(self, plan: _Plan, starts: Sequence[Signal]) -> Step:
        b = plan.state.round.batch  # type: ignore[union-attr]
        assert b is not None
        rejected: dict[str, str] = {}
        pending = [offset for offset, inv in enumerate(b.invocations) if inv.starting]
        for offset, signal in zip(pending, starts, strict=True):
            failure = signal.payload.get("failure")
            if failure is None:
                continue
            parsed = Failure.from_json(failure)
            if b.kind == "tool":
                # The ToolSet is required infrastructure: a refused Tool child fails the Interaction.
                return plan.step(Fail(parsed))
            rejected[str(offset)] = f"error: delegated worker child start failed: {parsed.code}: {parsed.message}"
        plan.add({"op": "record_starts", "rejected": rejected} if rejected else {"op": "record_starts"})
        return self._after_batch_change(plan, refill=False)

    def _record_outcomes(self, plan: _Plan, satisfied: Signal) -> Step:
        b = plan.state.round.batch  # type: ignore[union-attr]
        assert b is not None
        failed: dict[str, str] = {}
        for outcome in satisfied.payload["outcomes"]:
            pid = outcome["process_id"]
            offset = b.offset_of(pid)
            if offset is None:
                raise state_error(f"child wait outcome names {pid}, which this batch did not start")
            result = outcome["result"]
            status = result["status"]
            termination = result.get("termination") or {}
            if b.kind == "tool":
                if status != "completed":
                    failure = termination.get("failure")
                    if failure:
                        return plan.step(Fail(Failure.from_json(failure)))
                    return plan.step(
                        _fail(
                            FailureKind.EXECUTION,
                            "interaction.tool.process_failed",
                            f"Tool child {pid} ended with {status} ({termination.get('cause')}): {termination.get('reason')}",
                        )
                    )
                tool_completion(result.get("output"))
                continue
            unresolved = outcome.get("subtree_unresolved_effects") or []
            if unresolved:
                return plan.step(
                    _fail(
                        FailureKind.EXTERNAL,
                        "interaction.delegate.unresolved_effects",
                        f"Delegate subtree {pid} ended with unresolved Effects [{', '.join(unresolved)}]",
                    )
                )
            if status != "completed":
                text = f"error: delegated worker child ended with {status} ({termination.get('cause')})"
                if termination.get("reason"):
                    text += f": {termination['reason']}"
                failed[str(offset)] = text
        plan.add({"op": "record_outcomes", "failed": failed} if failed else {"op": "record_outcomes"})
        return self._after_batch_change(plan, refill=True)

    def _after_batch_change(self, plan: _Plan, *, refill: bool) -> Step:
        d = self.definition
        r = plan.state.round
        assert r is not None and r.batch is not None
        b = r.batch
        active = [inv for inv in b.invocations if inv.active]
        if b.kind == "tool" and refill:
            waiting = [offset for offset, inv in enumerate(b.invocations) if not inv.requested]
            room = d.max_concurrent - len(active)
            if waiting and room > 0:
                count = min(room, len(waiting))
                plan.add({"op": "request", "count": count})
                return plan.step(Continue(tuple(self._tool_starts(plan.state, b.start, waiting[:count]))))
        if active:
            done = sum(1 for inv in b.invocations if inv.result is not None)
            key = f"interaction.children:{r.sequence}:{b.start}:{done}"
            plan.add({"op": "open_wait", "key": key})
            spec = ChildWaitSpec(
                key,  # type: ignore[arg-type]
                tuple(inv.process_id for inv in active),  # type: ignore[misc]
                Boundary.SUBTREE_DRAINED,
                "any" if b.kind == "tool" else "all",
            )
            return plan.step(Continue((wait_children_effect(spec),)))
        plan.add({"op": "finish_batch"})
        return self._advance(plan)

    def _finish_round(self, plan: _Plan) -> Step:
        r = plan.state.round
        assert r is not None
        d = self.definition
        direct = (
            not plan.state.pending_steer
            and all(result["disposition"] == "succeeded" for result in r.results)
            and all(
                (spec := d.manifest.tool(call.name)) is not None and spec.direct_result and call.name not in self.delegate_names
                for call in r.calls
            )
        )
        if direct:
            results = [t.to_json() for t in round_tool_results(r)]
            output = {"direct_tool_results": results, "model_calls": plan.state.model_call_count}
            return self._complete(plan, output, [{"op": "finish_round"}])
        plan.add({"op": "finish_round"})
        return self._request_model(plan)


def _scan(window: Sequence[Signal], expected: int, predicate: Callable[[Signal], bool]) -> tuple[list[Signal], list[Signal]]:
    """The consumed prefix (steering and expected signals) and the expected signals in it."""
    consumed: list[Signal] = []
    taken: list[Signal] = []
    for signal in window:
        if is_steer(signal):
            consumed.append(signal)
            continue
        if len(taken) < expected and predicate(signal):
            consumed.append(signal)
            taken.append(signal)
            continue
        break
    return consumed, taken


def _diagnostic(payload: Any) -> str:
    if isinstance(payload, str) and payload.strip():
        return payload.strip()
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return str(payload["message"])
    return "the host failed the operation before any external work"


def expand_interaction_request(state: InteractionState, payload: JSON) -> JSON:
    """Rebuild the full dispatcher payload of a model or context Effect from the Process state."""
    if not isinstance(payload, dict):
        return payload
    for name in ("model_call", "prepare_context"):
        body = payload.get(name)
        if isinstance(body, dict):
            count = int(body.get("message_count", -1))
            if count != len(state.messages):
                raise state_error(
                    f"{name} expects {count} messages but the working context holds {len(state.messages)}"
                )
            request = {"messages": list(state.messages), "options": state.options}
            return {name: {**body, "request": request}}
    return payload


def completion_context_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [response["message"]]


def direct_context_messages(state: InteractionState) -> list[dict[str, Any]]:
    r = state.round
    assert r is not None
    return [r.response["message"], tool_message(round_tool_results(r))]


__all__ = [
    "CompletionCandidate",
    "CompletionDecision",
    "CompletionValidator",
    "InteractionDefinition",
    "InteractionStrategy",
    "STEER_SCHEMA",
    "expand_interaction_request",
    "replace",
]
