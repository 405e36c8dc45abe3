"""Build team Programs: a collaboration (coordinator + workers), an InputGate, a transform.

* :func:`compile_team` binds a coordinator and workers into one root Program (the Scope
  ``team.Compile``); the coordinator is any Program whose input schema is exactly
  :data:`TURN_SCHEMA` and output schema exactly :data:`DECISION_SCHEMA` (e.g. a transform of a
  Python policy, or ``adapt`` around an Interaction that renders the Turn and decodes a Decision).
* :func:`compile_input_gate` is the coordination InputGate: a worker that waits for one
  external answer (addressed to its wait) and completes with it.
* :func:`compile_first_success` is the coordination FirstSuccess: it starts the candidates
  its input names (bound candidate Programs) and completes with the first completed one that
  ``accept`` accepts, cancelling the others.
* :func:`compile_deadline` is the coordination Deadline: it completes at the absolute instant
  its input names (:class:`DeadlineDispatcher` is its timer).
* :func:`transform` is a Program whose one Effect calls ``fn(input)`` (the Scope workflow
  Transform): an exception fails it (``transform.failed``); a crash during the call leaves an
  unknown Effect for a host to resolve (it is never called again behind the host's back).

Docs: docs/team.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentfold.adapters.dispatch import DispatchContext, TimerDispatcher
from agentfold.adapters.interaction import _identity
from agentfold.domain.budget import MAX_COUNTER, Budget, Quota
from agentfold.domain.canonical import JSON, digest_of, normalize
from agentfold.domain.competition import AcceptFn, FirstSuccessStrategy
from agentfold.domain.coordination import DeadlineStrategy, InputGateStrategy, deadline_policy, instant_seconds
from agentfold.domain.errors import InvalidInput, bounded_text, recorded_text
from agentfold.domain.ids import Digest
from agentfold.domain.json_schema import check_schema
from agentfold.domain.program import Descriptor, Program, check_description, check_synchronous
from agentfold.domain.requests import EffectRequest, Settlement
from agentfold.domain.team import DECISION_SCHEMA, TURN_SCHEMA, CollaborationStrategy, Member, TeamDefinition
from agentfold.domain.workflow import TransformStrategy, check_transform_resolution, expand_transform_request

TEAM_IMPLEMENTATION = Digest.of(b"agentfold.team/1")
GATE_IMPLEMENTATION = Digest.of(b"agentfold.input_gate/1")
TRANSFORM_IMPLEMENTATION = Digest.of(b"agentfold.transform/1")
FIRST_SUCCESS_IMPLEMENTATION = Digest.of(b"agentfold.first_success/1")
DEADLINE_IMPLEMENTATION = Digest.of(b"agentfold.deadline/1")

#: A team member: its exact Program, the budget each of its child Processes is granted and their capabilities.
TeamMember = Member


def _limit(name: str, value: object, minimum: int, code: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidInput(code, f"TeamConfig.{name} is {value!r}; it must be an int of at least {minimum}")
    if value > MAX_COUNTER:  # else a Quota refused it as budget.invalid
        raise InvalidInput(code, f"TeamConfig.{name} is {value!r}; it must be at most {MAX_COUNTER}")


@dataclass(frozen=True, eq=False)
class TeamConfig:
    """Everything a collaboration binds (the seed's team.Config).

    ``max_turns`` / ``max_tasks``: None is unlimited; ``max_tasks=0`` forbids worker starts.
    ``state_schema`` validates the root input (the initial working state) and every Decision's
    state; ``output_schema`` the completing Decision's output (the root's output)."""

    name: str
    coordinator: Member
    workers: Sequence[Member]
    description: str = ""
    state_schema: JSON = True
    output_schema: JSON = True
    max_turns: int | None = None
    max_tasks: int | None = None
    max_concurrent_tasks: int = 4
    max_controls_per_turn: int = 4
    configuration: JSON = None


def _check_member(what: str, member: object) -> Member:
    code = "collaboration.definition.invalid"
    if not isinstance(member, Member):
        raise InvalidInput(code, f"{what} is a {type(member).__name__}, not a TeamMember",
                           hint="wrap each Program: TeamMember(program, budget=Budget(...))")
    if not isinstance(member.program, Program):
        raise InvalidInput(code, f"{what}.program is a {type(member.program).__name__}, not a Program")
    if not isinstance(member.budget, Budget):
        raise InvalidInput(code, f"{what}.budget is a {type(member.budget).__name__}, not a Budget",
                           hint="e.g. Budget(steps=Quota(32), effects=Quota(16), signals=Quota(32)) "
                                "(agentfold.domain.budget)")
    capabilities = member.capabilities
    if not isinstance(capabilities, frozenset | set) or not all(isinstance(c, str) and c for c in capabilities):
        raise InvalidInput(code, f"{what}.capabilities must be a set of non-empty strings, got {capabilities!r}"[:300],
                           hint='e.g. frozenset({"net"})')
    return member


def _check_schema(name: str, schema: object) -> None:
    try:
        check_schema(schema, f"#{name}")
    except InvalidInput as exc:
        raise InvalidInput("collaboration.definition.invalid", f"TeamConfig.{name}: {exc.message}",
                           hint="give a JSON schema agentfold can enforce (True accepts any JSON; docs/team.md)") from exc


def compile_team(config: TeamConfig) -> Program:
    """Freeze a collaboration and bind its coordinator and workers (the seed's Compile)."""
    code = "collaboration.definition.invalid"
    if not isinstance(config, TeamConfig):
        raise InvalidInput(code, f"compile_team takes a TeamConfig, not {type(config).__name__}")
    for name in ("max_turns", "max_tasks"):
        value = getattr(config, name)
        if value is not None:
            _limit(name, value, 0, code)
    if isinstance(config.workers, (str, bytes)) or not isinstance(config.workers, Sequence):
        raise InvalidInput(code, "TeamConfig.workers must be a list of TeamMember")
    check_description(config.description, "TeamConfig.description", code)
    _check_schema("state_schema", config.state_schema)
    _check_schema("output_schema", config.output_schema)
    try:
        document = normalize(config.configuration, what="TeamConfig.configuration")
    except InvalidInput as exc:
        raise InvalidInput(code, exc.message, hint="configuration is your own JSON value (or None)") from exc
    definition = TeamDefinition(
        name=config.name,
        coordinator=_check_member("coordinator", config.coordinator),
        workers=tuple(_check_member(f"workers[{i}]", w) for i, w in enumerate(config.workers)),
        description=config.description,
        state_schema=config.state_schema,
        output_schema=config.output_schema,
        max_turns=Quota(config.max_turns),
        max_tasks=Quota(config.max_tasks),
        max_concurrent_tasks=config.max_concurrent_tasks,
        max_controls_per_turn=config.max_controls_per_turn,
    )
    descriptor = definition.descriptor()
    configuration = {**definition.to_json(), "document": document}
    return Program(
        descriptor,
        CollaborationStrategy(definition),
        TEAM_IMPLEMENTATION,
        digest_of(configuration),
        children=definition.child_programs(),
        active_children=definition.max_concurrent_tasks + 1,
        active_children_setting="its TeamConfig.max_concurrent_tasks, plus its coordinator",
        configuration=document,
    )


@dataclass(frozen=True, eq=False)
class InputGateConfig:
    name: str
    answer_schema: JSON
    description: str = ""
    request_schema: JSON = True


def compile_input_gate(config: InputGateConfig) -> Program:
    """A Program that waits for one addressed answer (coordination.InputGate)."""
    if not isinstance(config, InputGateConfig):
        raise InvalidInput("coordination.definition.invalid",
                           f"compile_input_gate takes an InputGateConfig, not {type(config).__name__}")
    strategy = InputGateStrategy(config.name, config.description, config.request_schema, config.answer_schema)
    return Program(
        strategy.descriptor,
        strategy,
        GATE_IMPLEMENTATION,
        digest_of({"answer_schema": config.answer_schema}),
    )


@dataclass(frozen=True, eq=False)
class FirstSuccessConfig:
    """A competition among the bound ``candidates`` (Programs, named in the input by their
    Program name). ``accept(key, outcome) -> bool`` decides whether a completed candidate wins;
    it must be pure and quick, and ``accept_identity`` names it in the configuration digest (by
    default its module and qualified name): change it when ``accept`` changes meaning.
    ``max_candidates`` bounds one input's candidates."""

    name: str
    candidates: Sequence[Program]
    accept: AcceptFn
    max_candidates: int = 8
    description: str = ""
    accept_identity: str | None = None


def _accept_everything(key: str, outcome: dict[str, object]) -> bool:
    return True


#: ``accept`` for a plain race: the first candidate that completes wins.
FIRST_COMPLETED: AcceptFn = _accept_everything


def compile_first_success(config: FirstSuccessConfig) -> Program:
    """A Program that races the candidates its input names (coordination.FirstSuccess)."""
    code = "coordination.definition.invalid"
    if not isinstance(config, FirstSuccessConfig):
        raise InvalidInput(code, f"compile_first_success takes a FirstSuccessConfig, not {type(config).__name__}")
    candidates = tuple(config.candidates) if isinstance(config.candidates, (list, tuple)) else None
    if candidates is None:
        raise InvalidInput(code, f"FirstSuccessConfig.candidates is {type(config.candidates).__name__}, not a list of "
                           "Programs", hint="pass the candidate Programs as a list, also for one")
    check_synchronous(f"FirstSuccessConfig.accept of {config.name!r}", config.accept, code)
    identity = config.accept_identity
    if identity is not None and (not isinstance(identity, str) or not identity.strip()):
        raise InvalidInput(code, f"FirstSuccessConfig.accept_identity of {config.name!r} must be non-empty text",
                           hint="name what accept decides and its version, e.g. 'shop.pick/2', or leave it out")
    strategy = FirstSuccessStrategy(config.name, config.description, candidates, config.max_candidates, config.accept)
    document: JSON = {
        "accept": identity if identity is not None else _identity(config.accept, None),
        "max_candidates": config.max_candidates,
    }
    return Program(
        strategy.descriptor,
        strategy,
        FIRST_SUCCESS_IMPLEMENTATION,
        digest_of(document),
        children=candidates,
        active_children=config.max_candidates,
        active_children_setting="its FirstSuccessConfig.max_candidates",
        configuration=document,
    )


class DeadlineDispatcher(TimerDispatcher):
    """The timer of a Deadline: settles succeeded ``{}`` at the absolute instant of its Effect.
    Cancellation (the Process asked to stop) settles failed at once, so it never leaves an
    unknown outcome; a malformed payload is a definite failure. Waiting for the same instant
    again has no external side effect, which is why recovery may re-dispatch it under the same
    identity. A Runtime waits for it on its timer thread: it holds no call slot and no thread."""

    def due(self, request: EffectRequest) -> float | Settlement:
        payload = request.payload
        try:
            if not isinstance(payload, dict) or set(payload) != {"deadline"}:
                raise InvalidInput("effect.invalid", "a timer's payload is {'deadline': <RFC 3339 time>}")
            return instant_seconds(payload["deadline"])
        except InvalidInput as exc:
            return Settlement.failed({"error": exc.message})


def compile_deadline(name: str, description: str = "", dispatcher: DeadlineDispatcher | None = None) -> Program:
    """A Program that completes at the absolute instant its input names (coordination.Deadline)."""
    strategy = DeadlineStrategy(name, description)
    return Program(
        strategy.descriptor,
        strategy,
        DEADLINE_IMPLEMENTATION,
        digest_of({"deadline": 1}),
        policy=deadline_policy,
        dispatcher=dispatcher or DeadlineDispatcher(),
    )


@dataclass(frozen=True, eq=False)
class TransformConfig:
    """``fn(input) -> output`` as a Program. ``identity`` names ``fn`` in the configuration
    digest (by default its module and qualified name, which differ when the module is imported
    under another name): change it when ``fn`` changes meaning."""

    name: str
    fn: Callable[[JSON], JSON]
    description: str = ""
    input_schema: JSON = True
    output_schema: JSON = True
    identity: str | None = None


class TransformDispatcher:
    """Calls the transform's function once per Effect; what it raises is a definite failure."""

    def __init__(self, fn: Callable[[JSON], JSON]) -> None:
        self.fn = fn

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        payload = request.payload
        value = payload["transform"]["input"] if isinstance(payload, dict) else None
        try:
            output = self.fn(value)
        except Exception as exc:  # noqa: BLE001 - the function's own failure is the Effect's result
            return Settlement.failed({"error": bounded_text(f"{type(exc).__name__}: {recorded_text(exc)}")})
        try:
            output = normalize(output, what="transform output")
        except InvalidInput as exc:
            return Settlement.failed({"error": bounded_text(f"the function returned no JSON value: {exc.message}")})
        return Settlement.succeeded({"output": output})


def transform(config: TransformConfig) -> Program:
    """One ordinary Program whose one Effect calls ``config.fn`` with the Process input."""
    check_synchronous(f"TransformConfig.fn of {config.name!r}", config.fn, "program.invalid")
    if config.identity is not None and (not isinstance(config.identity, str) or not config.identity.strip()):
        raise InvalidInput("program.invalid", f"TransformConfig.identity of {config.name!r} must be non-empty text",
                           hint="name what fn does and its version, e.g. 'shop.review/2', or leave it out")
    return Program(
        Descriptor(config.name, config.description, config.input_schema, config.output_schema, None),
        TransformStrategy(),
        TRANSFORM_IMPLEMENTATION,
        digest_of({"fn": config.identity if config.identity is not None else _identity(config.fn, None)}),
        expand_request=expand_transform_request,
        check_resolution=check_transform_resolution,
        dispatcher=TransformDispatcher(config.fn),
    )


__all__ = [
    "DECISION_SCHEMA",
    "FIRST_COMPLETED",
    "TURN_SCHEMA",
    "DeadlineDispatcher",
    "FirstSuccessConfig",
    "InputGateConfig",
    "TeamConfig",
    "TeamMember",
    "TransformConfig",
    "compile_deadline",
    "compile_first_success",
    "compile_input_gate",
    "compile_team",
    "transform",
]
