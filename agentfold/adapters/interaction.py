"""Compile an Interaction into a runnable Program: model dispatcher, ToolSet child, Delegates.

``compile_interaction(config)`` freezes the model loop: the pure
:class:`~agentfold.domain.interaction.interaction.InteractionStrategy`, its exact child
Programs (one ToolSet program that runs one tool call per child Process, and every
Delegate), and the dispatchers that do the I/O (the model client, the tools). The
ProgramRef digests cover the tool and Delegate manifests, the limits and the
identities of the opaque collaborators (model, tools, callbacks), so a recovered tree
is only ever driven by the exact binding that started it.

``adapt(config)`` wraps an Interaction with typed input and output (the seed's
``Adapt``); ``steer_signal`` builds a steering SignalRequest.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.models import Model, ModelError, ModelRequest
from agentfold.adapters.tools import ObservationFailures, Tool, ToolDispatcher, ToolObserver, observe, tool_spec
from agentfold.domain.budget import MAX_COUNTER, Budget, Quota, child_debit
from agentfold.domain.canonical import JSON, MAX_PAYLOAD_BYTES, canonical_bytes, digest_of
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, InvalidInput, recorded_text
from agentfold.domain.ids import ChildKey, Digest, SignalID, WaitKey
from agentfold.domain.interaction.chat import FINISH_REASONS, parse_message, parse_messages, parse_response
from agentfold.domain.interaction.interaction import (
    CompletionValidator,
    ContextPolicy,
    InteractionDefinition,
    InteractionStrategy,
    expand_interaction_request,
)
from agentfold.domain.interaction.settle import check_resolution
from agentfold.domain.interaction.state import InteractionState
from agentfold.domain.interaction.tool_call import ToolCallStrategy, tool_program_descriptor
from agentfold.domain.interaction.toolset import DelegateSpec, ToolManifest
from agentfold.domain.kernel import brief_repr
from agentfold.domain.program import (
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    EffectPolicy,
    Fail,
    Program,
    Signal,
    SignalRequest,
    Step,
    Wait,
    check_description,
    check_synchronous,
    start_child_effect,
    wait_children_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement

IMPLEMENTATION = Digest.of(b"agentfold.interaction/1")


class ContextFailure(Exception):
    """A context processor's definite rejection (the context effect settles failed)."""


class ContextProcessor(Protocol):
    def prepare_context(self, request: ModelRequest) -> list[dict[str, Any]]: ...


class ModelObserver(Protocol):
    def on_model_started(self, request: ModelRequest) -> None: ...

    def on_model_settled(self, request: ModelRequest, outcome: str, response: dict[str, Any] | None) -> None: ...


class ModelDispatcher:
    """Executes an Interaction's model-call and context-preparation Effects."""

    def __init__(
        self,
        definition: InteractionDefinition,
        model: Model,
        observer: ModelObserver | None = None,
        processor: ContextProcessor | None = None,
    ) -> None:
        self.definition = definition
        self.model = model
        self.observer = observer
        self.processor = processor
        self.observation_failures = ObservationFailures()
        self._lock = threading.Lock()

    def _request(self, request: EffectRequest, body: dict[str, Any], context: DispatchContext | None = None) -> ModelRequest:
        req = body["request"]
        return ModelRequest(
            process_id=request.relation.process_id,
            model_call_sequence=int(body["model_call_sequence"]),
            effect_id=request.effect_id,
            attempt_id=request.attempt_id,
            messages=tuple(req["messages"]),
            options=dict(req.get("options") or {}),
            tools=tuple(self.definition.manifest.definitions(body.get("advertised_tool_names", ()))),
            applied_steer_signal_ids=tuple(body.get("applied_steer_signal_ids", ())),
            cancelled=context.cancelled if context is not None else None,
        )

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        payload = request.payload if isinstance(request.payload, dict) else {}
        if "prepare_context" in payload:
            return self._prepare(request, payload["prepare_context"])
        body = payload.get("model_call")
        if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
            return Settlement.failed("the model dispatcher received a payload that is not a model_call")
        model_request = self._request(request, body, context)
        original = list(model_request.messages)
        policy = self.definition.context_policy
        if policy is not None:
            try:
                reduced = parse_messages(policy(model_request.messages), "context_policy")
            except Exception as exc:  # noqa: BLE001 - a failing local policy is a host failure before the call
                return Settlement.failed(f"the context policy failed: {recorded_text(exc)}")
            model_request = replace(model_request, messages=tuple(reduced))
            if reduced != original:
                # Scope 2.8: the smallest possible success envelope must fit the payload limit,
                # else a failed settlement before the call. Past it, the answer's settlement
                # (which carries the reduced messages) could never be recorded: the call would
                # be made, then left unknown, and no resolution could carry those messages either.
                smallest = {"model_result": {"response": {"message": {"role": "assistant"}, "finish_reason": "stop"},
                                             "replacement_messages": reduced}}
                size = len(canonical_bytes(smallest))  # what the runtime's normalize measures
                if size > MAX_PAYLOAD_BYTES:
                    return Settlement.failed(f"the context policy's messages do not fit a settlement: its smallest is "
                                             f"{size} bytes, above the limit of {MAX_PAYLOAD_BYTES}; the policy must send less")
        if self.observer is not None:
            observe(self.observation_failures, "model_started", lambda: self.observer.on_model_started(model_request))  # type: ignore[union-attr]
        outcome, response = "unknown", None
        try:
            raw = self.model.call(model_request)
            if inspect.iscoroutine(raw):
                raw.close()  # never run: no "was never awaited" warning; invalid response (unknown) below
            try:
                # Duplicate call ids are the Interaction's to refuse (it fails the run:
                # interaction.model.invalid_response); anything else invalid leaves the call unknown.
                parsed = parse_response(raw, unique_call_ids=False, admitting=True)
            except InvalidInput as exc:
                raise ModelError(f"invalid model response: {exc.message}") from exc
            if parsed["finish_reason"] not in FINISH_REASONS:
                raise ModelError(
                    f"invalid model response: response.finish_reason: {parsed['finish_reason']!r} is not one of "
                    f"{', '.join(FINISH_REASONS)} (a model adapter maps a provider's own reasons onto these)"
                )
            outcome, response = "succeeded", parsed
        finally:
            if self.observer is not None:
                final_outcome, final_response = outcome, response
                observe(
                    self.observation_failures,
                    "model_settled",
                    lambda: self.observer.on_model_settled(model_request, final_outcome, final_response),  # type: ignore[union-attr]
                )
        result: dict[str, Any] = {"response": response}
        if list(model_request.messages) != original:
            result["replacement_messages"] = list(model_request.messages)
        return Settlement.succeeded({"model_result": result})

    def _prepare(self, request: EffectRequest, body: dict[str, Any]) -> Settlement:
        if self.processor is None:
            return Settlement.failed("no context processor is bound")
        model_request = self._request(request, {**body, "advertised_tool_names": ()})
        try:
            messages = self.processor.prepare_context(model_request)
        except ContextFailure as exc:
            return Settlement.failed(f"the context processor refused: {recorded_text(exc)}")
        return Settlement.succeeded({"prepared_context": {"messages": parse_messages(messages, "prepared_context")}})


@dataclass(frozen=True, eq=False)
class Delegate:
    """A model-selectable exact child Program."""

    name: str
    description: str
    program: Program
    input_schema: JSON = None
    budget: Budget = field(default_factory=Budget)
    capabilities: frozenset[str] = frozenset()
    build_input: Callable[[JSON], JSON] | None = None
    build_identity: Digest | None = None


@dataclass(frozen=True, eq=False)
class InteractionConfig:
    """Everything an Interaction binds (the seed's Compile Config)."""

    name: str
    model: Model
    description: str = ""
    tools: Sequence[Tool] = ()
    deferred_tools: Sequence[Tool] = ()
    delegates: Sequence[Delegate] = ()
    max_model_calls: int | None = None
    max_concurrent_tool_calls: int = 0
    tool_budget: Budget = field(default_factory=Budget)
    tool_capabilities: frozenset[str] = frozenset()
    completion_validator: CompletionValidator | None = None
    context_policy: ContextPolicy | None = None
    context_processor: ContextProcessor | None = None
    model_observer: ModelObserver | None = None
    tool_observer: ToolObserver | None = None
    model_identity: Digest | None = None
    tool_identity: Digest | None = None
    callback_identity: Digest | None = None
    configuration: JSON = None


def _identity(value: object, given: Digest | None) -> str:
    """An opaque collaborator's identity for the configuration digest (its qualified name by default).

    agentfold's own modules are named as before they moved under the ``agentfold`` package
    (``adapters.models``, not ``agentfold.adapters.models``): the digest of a Program built
    with them stays the one its stored runs recorded, so they resume after an upgrade."""
    if given is not None:
        return given
    if callable(value) and hasattr(value, "__qualname__"):
        module, name = getattr(value, "__module__", ""), value.__qualname__
    else:
        module, name = type(value).__module__, type(value).__qualname__
    return f"{module.removeprefix(_OWN_PREFIX)}.{name}"


_OWN_PREFIX = "agentfold."


def _check_count(field_name: str, value: object, minimum: int, expected: str) -> None:
    """A numeric limit of the config: an int (not a bool) between ``minimum`` and MAX_COUNTER."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(
            "interaction.definition.invalid",
            f"InteractionConfig.{field_name} is {value!r} (of type {type(value).__name__}); it must be {expected}",
            hint=f"pass a Python int, e.g. {field_name}={max(minimum, 1)}",
        )
    if not minimum <= value <= MAX_COUNTER:
        raise InvalidInput(
            "interaction.definition.invalid", f"InteractionConfig.{field_name} is {value}; it must be {expected}"
        )


def _method(owner: object, field_name: str, method: str) -> object:
    try:
        return getattr(owner, method, None)
    except Exception as exc:  # a property of the caller's own object
        raise InvalidInput(
            "interaction.definition.invalid",
            f"reading InteractionConfig.{field_name}.{method} failed: {type(exc).__name__}: {exc}",
        ) from exc


DEFINITION = "interaction.definition.invalid"


def _check_collaborators(config: InteractionConfig) -> None:
    """Refuse, before anything runs, what could only fail as an unknown Effect (or a failed
    Step) later: no model, a model, processor or callback that cannot be called, or one that
    is ``async`` (agentfold never awaits: its coroutine would be dropped unrun)."""
    if config.model is None:
        raise InvalidInput(
            "interaction.definition.invalid", "InteractionConfig.model is None",
            hint="pass a model client: an object with call(ModelRequest), e.g. OpenAIChatModel or ScriptedModel",
        )
    call = _method(config.model, "model", "call")
    if not callable(call):
        raise InvalidInput(
            "interaction.definition.invalid",
            f"InteractionConfig.model (of type {type(config.model).__name__}) has no call(request) method",
            hint="pass a model client: an object with call(ModelRequest), e.g. OpenAIChatModel or ScriptedModel",
        )
    check_synchronous(f"InteractionConfig.model.call ({type(config.model).__name__}.call)", call, DEFINITION)
    if config.context_processor is not None:
        prepare = _method(config.context_processor, "context_processor", "prepare_context")
        if prepare is None:
            raise InvalidInput(
                "interaction.definition.invalid",
                f"InteractionConfig.context_processor (of type {type(config.context_processor).__name__}) "
                "has no prepare_context(request) method",
            )
        check_synchronous("InteractionConfig.context_processor.prepare_context", prepare, DEFINITION)
    for field_name in ("completion_validator", "context_policy"):
        fn = getattr(config, field_name)
        if fn is not None:
            check_synchronous(f"InteractionConfig.{field_name}", fn, DEFINITION)
    observers = (
        ("model_observer", config.model_observer, ("on_model_started", "on_model_settled")),
        ("tool_observer", config.tool_observer, ("on_tool_started", "on_tool_settled")),
    )
    for field_name, observer, methods in observers:
        if observer is None:
            continue
        for method in methods:
            fn = _method(observer, field_name, method)
            if fn is not None:
                check_synchronous(f"InteractionConfig.{field_name}.{method}", fn, DEFINITION)
    for delegate in config.delegates:
        if delegate.build_input is not None:
            check_synchronous(f"delegate {delegate.name!r}: build_input", delegate.build_input,
                              "interaction.delegate.invalid")
        _check_delegate_budget(delegate)


def _check_delegate_budget(delegate: Delegate) -> None:
    """A Delegate whose Interaction grants its own children (its tool calls: ``tool_budget``;
    its Delegates) what the Delegate's budget cannot hold (kernel rule ``budget.child_allocation``:
    under a finite quota a grant is finite and at most it): every such child would be refused,
    and each delegated call fail at run time (``engine.child.budget_exhausted``)."""
    strategy = getattr(delegate.program, "strategy", None)
    if not isinstance(strategy, InteractionStrategy):
        return
    inner = strategy.definition
    grants: list[tuple[str, Budget]] = []
    if inner.tool_program is not None:
        grants.append(("its tool calls' budget (InteractionConfig.tool_budget)", inner.tool_budget))
    grants += [(f"its Delegate {d.name!r}'s budget", d.budget) for d in inner.manifest.delegates]
    for whom, grant in grants:
        refused = child_debit(delegate.budget, grant)
        if isinstance(refused, str):
            raise InvalidInput(
                "interaction.delegate.invalid",
                f"delegate {delegate.name!r}: the delegated Interaction {inner.name!r} runs within the Delegate's "
                f"budget {brief_repr(delegate.budget.to_json())}, and {whom} {brief_repr(grant.to_json())} would be "
                f"refused within it ({refused}): every delegated call would fail",
                hint="give the delegated Interaction a finite tool_budget (and its Delegates finite budgets) of at most "
                "the Delegate's budget in each finite dimension, or leave the Delegate's budget unlimited",
            )


def _check_lists(config: InteractionConfig) -> None:
    """``tools``, ``deferred_tools`` and ``delegates`` are sequences (a list, a tuple): one tool
    passed on its own raised a bare TypeError ('... object is not iterable'), a string iterated
    its letters, a generator was used up by the first of the compiler's passes."""
    for field_name, what in (("tools", "tools"), ("deferred_tools", "tools"), ("delegates", "Delegates")):
        value = getattr(config, field_name)
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
            raise InvalidInput(
                DEFINITION, f"InteractionConfig.{field_name} is {brief_repr(value)}, not a list of {what}",
                hint=f"pass a list, also for one: {field_name}=[...]",
            )


def compile_interaction(config: InteractionConfig) -> Program:
    """Freeze the model loop, bind its child Programs and its dispatchers (the seed's Compile)."""
    _check_lists(config)
    check_description(config.description, "InteractionConfig.description", DEFINITION)
    if config.max_model_calls is not None:
        _check_count("max_model_calls", config.max_model_calls, 1, f"an int from 1 to {MAX_COUNTER} (or None for unlimited)")
    _check_count("max_concurrent_tool_calls", config.max_concurrent_tool_calls, 0, f"an int from 0 to {MAX_COUNTER} (0 means 1)")
    _check_collaborators(config)
    specs = tuple(tool_spec(t) for t in config.tools)
    deferred = tuple(tool_spec(t) for t in config.deferred_tools)
    delegates = tuple(
        DelegateSpec(
            d.name,
            d.description,
            d.input_schema if d.input_schema is not None else d.program.descriptor.input_schema,
            d.program,
            d.budget,
            d.capabilities,
            d.build_input,
        )
        for d in config.delegates
    )
    manifest = ToolManifest(specs, deferred, delegates)
    tool_program: Program | None = None
    if manifest.configured:
        tool_manifest = ToolManifest(specs, deferred)
        tool_strategy = ToolCallStrategy(tool_manifest)
        tool_config = {
            "tools": [s.definition() | {"direct_result": s.direct_result} for s in specs],
            "deferred": [s.definition() for s in deferred],
            "tool_identity": _identity(config.tools[0] if config.tools else config.deferred_tools[0], config.tool_identity),
            "observer": _identity(config.tool_observer, None) if config.tool_observer else None,
        }
        tool_program = Program(
            tool_program_descriptor(f"{config.name}.tools"),
            tool_strategy,
            IMPLEMENTATION,
            digest_of(tool_config),
            expand_request=tool_strategy.expand_request,
            check_resolution=check_resolution,
            dispatcher=ToolDispatcher(tool_manifest, [*config.tools, *config.deferred_tools], config.tool_observer),
        )
    definition = InteractionDefinition(
        name=config.name,
        description=config.description,
        manifest=manifest,
        tool_program=tool_program,
        tool_budget=config.tool_budget,
        tool_capabilities=config.tool_capabilities,
        max_model_calls=Quota(config.max_model_calls),
        max_concurrent_tool_calls=config.max_concurrent_tool_calls,
        completion_validator=config.completion_validator,
        context_policy=config.context_policy,
        prepare_context=config.context_processor is not None,
    )
    strategy = InteractionStrategy(definition)
    configuration = {
        "tools": [s.definition() | {"direct_result": s.direct_result} for s in specs],
        "deferred": [s.definition() for s in deferred],
        "delegates": [
            {
                "name": d.name,
                "description": d.description,
                "input_schema": d.input_schema,
                "program": d.program.ref.digest,
                "budget": d.budget.to_json(),
                "capabilities": sorted(d.capabilities),
            }
            for d in delegates
        ],
        "max_model_calls": config.max_model_calls,
        "max_concurrent_tool_calls": config.max_concurrent_tool_calls,
        "tool_budget": config.tool_budget.to_json(),
        "tool_capabilities": sorted(config.tool_capabilities),
        "model": _identity(config.model, config.model_identity),
        "callbacks": config.callback_identity
        or [
            _identity(c, None) if c is not None else None
            for c in (config.completion_validator, config.context_policy, config.context_processor)
        ],
        "observers": [_identity(o, None) if o is not None else None for o in (config.model_observer,)],
        "document": config.configuration,
    }

    def expand(state: InteractionState, payload: JSON) -> JSON:
        return expand_interaction_request(state, payload)

    return Program(
        definition.descriptor(),
        strategy,
        IMPLEMENTATION,
        digest_of(configuration),
        children=definition.child_programs(),
        policy=lambda effect: EffectPolicy(),
        expand_request=expand,
        check_resolution=check_resolution,
        # The tool window's width, for a run that can start children at all (tools or delegates).
        active_children=definition.max_concurrent if definition.child_programs() else 0,
        active_children_setting="its max_concurrent_tool_calls",
        configuration=config.configuration,
        dispatcher=ModelDispatcher(definition, config.model, config.model_observer, config.context_processor),
    )


def steer_signal(signal_id: str | SignalID, *messages: dict[str, Any]) -> SignalRequest:
    """An unaddressed steering Signal: one or more user messages for the next model request."""
    sid = SignalID(signal_id)
    if not messages:
        raise InvalidInput("interaction.signal.invalid", "a steer needs at least one user message",
                           hint='pass "words for the model" or [{"role": "user", "content": "..."}]')
    parsed = [parse_message(m, f"steer.messages[{i}]") for i, m in enumerate(messages)]
    for i, message in enumerate(parsed):
        if message["role"] != "user":
            raise InvalidInput(
                "interaction.signal.invalid", f"steer.messages[{i}]: steering accepts only user messages",
                hint='give each message "role": "user"; system, assistant and tool messages cannot steer a run',
            )
        if not any(str(part.get("text", "")).strip() for part in message.get("content") or ()):
            # An empty or blank message would reach the model as an empty user turn.
            raise InvalidInput(
                "interaction.signal.invalid", f"steer.messages[{i}]: the message has no text (empty or only spaces)",
                hint="give the words the model should read",
            )
    return SignalRequest(sid, {"steer": {"messages": parsed}})


# ---------------------------------------------------------------------------
# adapt: typed input and output around an Interaction


class _AdapterStrategy:
    def __init__(
        self,
        interaction: Program,
        build_input: Callable[[JSON], JSON],
        decode_output: Callable[[JSON], JSON],
        budget: Budget,
        capabilities: frozenset[str],
    ) -> None:
        self.interaction = interaction
        self.build_input = build_input
        self.decode_output = decode_output
        self.budget = budget
        self.capabilities = capabilities

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"input": input, "phase": "start"}

    def encode_state(self, state: Any) -> JSON:
        return state

    def decode_state(self, data: JSON) -> Any:
        return data

    def evolve(self, state: Any, facts: JSON, consumed: Sequence[Signal]) -> Any:
        return {**state, **(facts or {})}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            try:
                child_input = self.build_input(state["input"])
            except Exception as exc:
                raise ClassifiedError(FailureKind.EXECUTION, "adapter.input.failed", f"build_input failed: {exc}") from exc
            spec = ChildSpec(ChildKey("adapter.interaction"), self.interaction.ref, child_input, self.budget, self.capabilities)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            result = window[0].payload
            if result.get("failure"):
                return Step(1, Fail(Failure.from_json(result["failure"])), {"phase": "done"})
            spec_wait = ChildWaitSpec(WaitKey("adapter.interaction"), (result["process_id"],))
            return Step(1, Continue((wait_children_effect(spec_wait),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        if phase == "waiting":
            outcome = window[0].payload["outcomes"][0]["result"]
            if outcome["status"] != "completed":
                failure = (outcome.get("termination") or {}).get("failure")
                if failure:
                    return Step(1, Fail(Failure.from_json(failure)), {"phase": "done"})
                return Step(
                    1,
                    Fail(Failure(FailureKind.EXECUTION, "adapter.interaction.ended", f"the interaction ended {outcome['status']}")),
                    {"phase": "done"},
                )
            try:
                decoded = self.decode_output(outcome["output"])
            except Exception as exc:  # noqa: BLE001
                return Step(
                    1, Fail(Failure(FailureKind.EXECUTION, "adapter.output.invalid", f"decode_output failed: {exc}")),
                    {"phase": "done"},
                )
            return Step(1, Complete(decoded), {"phase": "done"})
        raise ClassifiedError(FailureKind.CONTRACT, "adapter.state.invalid", f"unexpected phase {phase}")


@dataclass(frozen=True, eq=False)
class AdapterConfig:
    name: str
    interaction: Program
    build_input: Callable[[JSON], JSON]
    decode_output: Callable[[JSON], JSON]
    description: str = ""
    input_schema: JSON = True
    output_schema: JSON = True
    budget: Budget = field(default_factory=Budget)
    capabilities: frozenset[str] = frozenset()
    implementation_digest: Digest = field(default_factory=lambda: Digest.of(b"agentfold.adapt/1"))
    configuration_digest: Digest | None = None


def adapt(config: AdapterConfig) -> Program:
    """One ordinary Program with an I -> O contract around an Interaction child."""
    strategy = _AdapterStrategy(
        config.interaction, config.build_input, config.decode_output, config.budget, config.capabilities
    )
    configuration = config.configuration_digest or digest_of(
        {
            "interaction": config.interaction.ref.digest,
            "budget": config.budget.to_json(),
            "capabilities": sorted(config.capabilities),
            "build_input": _identity(config.build_input, None),
            "decode_output": _identity(config.decode_output, None),
        }
    )
    return Program(
        Descriptor(config.name, config.description, config.input_schema, config.output_schema, None),
        strategy,
        config.implementation_digest,
        configuration,
        children=(config.interaction,),
    )
