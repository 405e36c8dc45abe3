"""The Strategy contract (decide/evolve), Programs, Effects, Signals and Transitions.

A Strategy is a pair of pure functions plus an initial state:

* ``initial(input) -> state`` (may raise a ClassifiedError to refuse the input);
* ``decide(state, window) -> Step``: a bounded, deterministic reduction of the
  committed state and the ordered signal window; no I/O, clock or randomness;
* ``evolve(state, facts, consumed) -> state``: applies the facts a Step recorded
  (``StepCommitted.facts``), with the signals it consumed, to the state.

The history stores the facts, never a copy of the whole state, so it grows with the
conversation and survives code changes (only ``evolve`` must stay compatible).

A :class:`Program` binds one Strategy to its :class:`Descriptor`, its exact
:class:`ProgramRef` and the exact child Programs it may start. The runtime adds a
Dispatcher (I/O) in ``adapters``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from agentfold.domain.budget import Budget
from agentfold.domain.canonical import JSON, canonical_bytes, digest_of, normalize
from agentfold.domain.errors import MAX_DIAGNOSTIC_BYTES, Failure, InvalidInput, bounded_text, valid_qualified_name
from agentfold.domain.ids import (
    ChildKey,
    Digest,
    EffectID,
    ProcessID,
    SignalID,
    WaitID,
    WaitKey,
)
from agentfold.domain.json_schema import check_schema

if TYPE_CHECKING:
    from agentfold.domain.requests import EffectRequest

# ---------------------------------------------------------------------------
# Descriptor and ProgramRef


def check_description(description: object, what: str, code: str = "program.invalid") -> None:
    """A Program's description is text that encodes as UTF-8; else ``code`` (each compiler
    names its own definition code; ``Descriptor`` is the last check, ``program.invalid``)."""
    if not isinstance(description, str):
        problem = f"is {type(description).__name__}, not text"
    else:
        try:
            description.encode("utf-8")
            return
        except UnicodeEncodeError:
            problem = "is not valid UTF-8 (it holds a lone surrogate)"
    raise InvalidInput(code, f"{what} {problem}", hint="give the description as text (or leave it out)")


@dataclass(frozen=True, slots=True)
class Descriptor:
    """A Program's contract: name and the JSON schemas of its input, output and signals.

    ``signal_schema`` governs unaddressed host input; ``None`` means the Program
    accepts no unaddressed input at all (answers to waits are addressed).
    """

    name: str
    description: str = ""
    input_schema: JSON = True
    output_schema: JSON = True
    signal_schema: JSON = None

    def __post_init__(self) -> None:
        if not valid_qualified_name(self.name):
            raise InvalidInput("program.invalid", f"descriptor name {self.name!r} is not a qualified name")
        check_description(self.description, f"the description of Program {self.name!r}")
        check_schema(self.input_schema, "#input")
        check_schema(self.output_schema, "#output")
        if self.signal_schema is not None:
            check_schema(self.signal_schema, "#signal")

    def to_json(self) -> dict[str, JSON]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "output_schema": self.output_schema,
            "signal_schema": self.signal_schema,
        }

    @property
    def digest(self) -> Digest:
        return digest_of(self.to_json())


@dataclass(frozen=True)
class ProgramRef:
    """The value identity of one exact behaviour binding (kernel spec 1.4).

    Text form ``name+sha256:<hex>``; the digest covers the name and the four
    component digests, and is recomputed (never trusted) when decoded.
    """

    name: str
    contract_digest: Digest
    implementation_digest: Digest
    configuration_digest: Digest
    bindings_digest: Digest

    def __post_init__(self) -> None:
        if not valid_qualified_name(self.name):
            raise InvalidInput("program.invalid", f"program name {self.name!r} is not a qualified name")
        for name in ("contract_digest", "implementation_digest", "configuration_digest", "bindings_digest"):
            object.__setattr__(self, name, Digest(getattr(self, name)))
        # Cached outside the dataclass fields (not serialized, not compared): refs are looked
        # up by digest on every Step.
        object.__setattr__(self, "_digest", Digest.of(canonical_bytes(self.components())))

    def components(self) -> dict[str, str]:
        return {
            "name": self.name,
            "contract_digest": self.contract_digest,
            "implementation_digest": self.implementation_digest,
            "configuration_digest": self.configuration_digest,
            "bindings_digest": self.bindings_digest,
        }

    @property
    def digest(self) -> Digest:
        return self.__dict__["_digest"]  # type: ignore[no-any-return]

    def __str__(self) -> str:
        return f"{self.name}+{self.digest}"

    def to_json(self) -> dict[str, str]:
        return {**self.components(), "digest": self.digest}

    @classmethod
    def from_json(cls, value: Any) -> ProgramRef:
        if not isinstance(value, dict):
            raise InvalidInput("program.invalid", "a program ref must be an object")
        fields = {k: value.get(k) for k in (
            "name", "contract_digest", "implementation_digest", "configuration_digest", "bindings_digest")}
        if any(not isinstance(v, str) for v in fields.values()):
            raise InvalidInput("program.invalid", f"incomplete program ref {value!r}")
        ref = cls(**fields)  # type: ignore[arg-type]
        if "digest" in value and value["digest"] != ref.digest:
            raise InvalidInput("program.invalid", "program ref digest does not match its components")
        return ref

    @staticmethod
    def bindings_of(children: Sequence[ProgramRef]) -> Digest:
        """Digest of the canonical, sorted, de-duplicated list of child ref digests."""
        return digest_of(sorted({c.digest for c in children}))


# ---------------------------------------------------------------------------
# Effects


class Target(StrEnum):
    FRAMEWORK = "framework"
    DISPATCHER = "dispatcher"


class Replay(StrEnum):
    NEVER = "never"
    SAME_IDENTITY = "same_identity"


class Boundary(StrEnum):
    TERMINAL_RESULT = "terminal_result"
    SUBTREE_DRAINED = "subtree_drained"


class Operation(StrEnum):
    WAIT = "wait"
    WAIT_CHILDREN = "wait_children"
    START_CHILD = "start_child"
    SIGNAL_CHILD = "signal_child"
    CANCEL_CHILD = "cancel_child"


@dataclass(frozen=True, slots=True)
class EffectPolicy:
    """What the Program's dispatcher promises about one Effect (pure, deterministic).

    ``same_identity`` claims that repeating the Effect under the same EffectID is the
    same logical external operation; only then may recovery re-dispatch it or a host
    replay it. ``never`` forbids both (a host can still supply a definite result).
    """

    replay: Replay = Replay.NEVER
    required_capabilities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.replay, Replay):
            try:
                object.__setattr__(self, "replay", Replay(self.replay))  # "never" as Replay.NEVER
            except (ValueError, TypeError):
                raise InvalidInput("effect.invalid", f"replay {self.replay!r:.100} is not one of "
                                   f"{[r.value for r in Replay]}", hint="pass Replay.NEVER or Replay.SAME_IDENTITY") from None
        object.__setattr__(self, "required_capabilities", _capability_set(self.required_capabilities))


def _capability_set(value: Any) -> frozenset[str]:
    """Capability names as a frozenset; a bare string (which Python reads as one-letter names)
    or a member that is no non-empty string is ``capabilities.invalid``."""
    if isinstance(value, frozenset) and (not value or all(isinstance(c, str) and c for c in value)):
        return value  # (an empty one, every policy's default, without building the generator: same answer)
    try:
        names = None if isinstance(value, (str, bytes)) else frozenset(value)
    except TypeError:
        names = None
    if names is None or not all(isinstance(c, str) and c for c in names):
        raise InvalidInput(
            "capabilities.invalid", f"capabilities must be a set of non-empty strings, not {value!r:.100}",
            hint='pass a set or list, e.g. {"payments"} (not the bare string "payments")',
        )
    return names


#: Marks an Effect built by this module's constructors, whose payload is already normalized
#: (the kernel checks the payload of any other Effect before declaring it).
_NORMALIZED: Any = object()


@dataclass(frozen=True, slots=True)
class Effect:
    """One operation a Step declares: a framework operation or an opaque dispatcher payload.

    Build them with ``dispatcher_effect``, ``wait_effect``, ``start_child_effect``, ...: an
    Effect built directly is accepted too, and its payload is checked when the Step is
    (``execution.effect.invalid`` for a value that is not JSON or is too large)."""

    target: Target
    payload: JSON
    #: A start-child Effect's storage hint (``start_child_effect(..., input_like=key)``): the key
    #: of an earlier child of the same parent whose input this child's is close to. The kernel
    #: then stores the input as its changes from that one (agentfold.domain.input_changes).
    input_like: str | None = None
    # Not a constructor argument: ``dataclasses.replace`` (a new payload) leaves it unset.
    _checked: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def normalized(self) -> bool:
        """Whether its payload was normalized when it was built (by this module's constructors)."""
        return self._checked is _NORMALIZED

    @property
    def operation(self) -> Operation | None:
        if self.target is Target.FRAMEWORK:
            return Operation(self.payload["operation"])
        return None

    def to_json(self) -> dict[str, JSON]:
        return {"target": self.target.value, "payload": self.payload}


def _normalized(target: Target, payload: JSON) -> Effect:
    effect = Effect(target, payload)
    object.__setattr__(effect, "_checked", _NORMALIZED)
    return effect


def dispatcher_effect(payload: JSON) -> Effect:
    return _normalized(Target.DISPATCHER, normalize(payload, what="effect payload"))


def wait_effect(key: WaitKey | str, *, prompt: JSON = None, response_schema: JSON = None) -> Effect:
    """Open an external wait. An optional ``response_schema`` is enforced on answers at admission.

    ``prompt`` is retained with the wait for hosts (e.g. PendingToolInputs).
    """
    payload: dict[str, JSON] = {"operation": Operation.WAIT.value, "key": WaitKey(key)}
    if prompt is not None:
        payload["prompt"] = prompt
    if response_schema is not None:
        check_schema(response_schema, "#response_schema")
        payload["response_schema"] = response_schema
    return _normalized(Target.FRAMEWORK, normalize(payload, what="wait effect"))


@dataclass(frozen=True, slots=True)
class ChildWaitSpec:
    """Wait for direct children to reach a boundary: all, any, or a quorum of n."""

    key: WaitKey
    children: tuple[ProcessID, ...]
    boundary: Boundary = Boundary.TERMINAL_RESULT
    condition: str = "all"  # "all" | "any" | "quorum"
    quorum: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", WaitKey(self.key))
        object.__setattr__(self, "children", tuple(ProcessID(c) for c in self.children))
        object.__setattr__(self, "boundary", Boundary(self.boundary))
        if not self.children or len(set(self.children)) != len(self.children):
            raise InvalidInput("effect.invalid", "a child wait needs distinct, non-empty children")
        if self.condition not in ("all", "any", "quorum"):
            raise InvalidInput("effect.invalid", f"unknown child wait condition {self.condition!r}")
        if self.condition == "quorum" and not 0 < self.quorum <= len(self.children):
            raise InvalidInput("effect.invalid", "a quorum must be between 1 and the number of children")

    @property
    def required(self) -> int:
        if self.condition == "all":
            return len(self.children)
        if self.condition == "any":
            return 1
        return self.quorum

    def to_json(self) -> dict[str, JSON]:
        body: dict[str, JSON] = {
            "key": self.key,
            "children": list(self.children),
            "boundary": self.boundary.value,
            "condition": self.condition,
        }
        if self.condition == "quorum":
            body["quorum"] = self.quorum
        return body

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ChildWaitSpec:
        return cls(
            WaitKey(value["key"]),
            tuple(value["children"]),
            Boundary(value.get("boundary", "terminal_result")),
            value.get("condition", "all"),
            int(value.get("quorum", 0)),
        )


def wait_children_effect(spec: ChildWaitSpec) -> Effect:
    return _normalized(Target.FRAMEWORK, {"operation": Operation.WAIT_CHILDREN.value, **spec.to_json()})


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child start: parent-scoped key, exact program, input, grant and capabilities."""

    key: ChildKey
    program: ProgramRef
    input: JSON = None
    budget: Budget = field(default_factory=Budget)
    capabilities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", _capability_set(self.capabilities))

    def to_json(self) -> dict[str, JSON]:
        """The program by its text ref (its components are in ``TreeStarted.programs``);
        an unlimited budget and an empty capability set are omitted."""
        body: dict[str, JSON] = {"key": self.key, "program": str(self.program), "input": self.input}
        if self.budget != Budget():
            body["budget"] = self.budget.to_json()
        if self.capabilities:
            body["capabilities"] = sorted(self.capabilities)
        return body

    @classmethod
    def from_json(cls, value: Mapping[str, Any], programs: Mapping[str, ProgramRef]) -> ChildSpec:
        """Parse a stored spec; ``programs`` maps ref digests to the tree's bound ProgramRefs."""
        return cls(
            ChildKey(value["key"]),
            program_ref_of(value["program"], programs),
            value.get("input"),
            Budget.from_json(value.get("budget")),
            frozenset(value.get("capabilities", ())),
        )


def program_ref_of(text: Any, programs: Mapping[str, ProgramRef]) -> ProgramRef:
    """Resolve a ``name+sha256:...`` text ref against the bound ProgramRefs."""
    if not isinstance(text, str) or "+" not in text:
        raise InvalidInput("program.invalid", f"a program ref is name+sha256:<hex>, got {str(text)[:120]!r}")
    name, _, digest = text.partition("+")
    ref = programs.get(digest)
    if ref is None or ref.name != name:
        raise InvalidInput("program.unbound", f"program {text} is not bound in this tree")
    return ref


def start_child_effect(spec: ChildSpec, *, input_like: ChildKey | str | None = None) -> Effect:
    """Start a child. ``input_like``: the key of an earlier child of the same parent whose
    input this one's mostly repeats (a cumulative input, such as a team's Turn): the input is
    then stored as its changes from that child's (``input_patch``, docs/events.md), when that
    is shorter; what the child receives is the same either way. A key that names no earlier
    child is ignored."""
    payload = {"operation": Operation.START_CHILD.value, **spec.to_json()}
    effect = _normalized(Target.FRAMEWORK, normalize(payload, what="child input"))
    if input_like is not None:
        object.__setattr__(effect, "input_like", ChildKey(input_like))
    return effect


def host_signal_id(signal_id: str) -> SignalID:
    """A signal id a host (or a parent) may use: any but the engine's own namespace
    (``signal.invalid``), which settlements and wait openings use."""
    parsed = SignalID(signal_id)
    if parsed.engine_owned:
        raise InvalidInput(
            "signal.invalid",
            f"signal id {parsed} uses the engine-owned namespace {SignalID.ENGINE_PREFIX!r}",
            hint="choose another signal id",
        )
    return parsed


@dataclass(frozen=True, slots=True)
class SignalRequest:
    """What a host (or a parent) submits: an identity, an optional wait address, a payload."""

    id: SignalID
    payload: JSON
    wait_id: WaitID | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", host_signal_id(self.id))
        if self.wait_id is not None:
            object.__setattr__(self, "wait_id", WaitID(self.wait_id))
        object.__setattr__(self, "payload", normalize(self.payload, what="signal payload"))

    @property
    def payload_digest(self) -> Digest:
        return digest_of(self.payload)

    def to_json(self) -> dict[str, JSON]:
        return {"id": self.id, "wait_id": self.wait_id, "payload": self.payload}


def signal_child_effect(child: ProcessID, request: SignalRequest) -> Effect:
    # Built from checked parts (the signal's payload is normalized by SignalRequest).
    return _normalized(
        Target.FRAMEWORK,
        {"operation": Operation.SIGNAL_CHILD.value, "child": ProcessID(child), "signal": request.to_json()},
    )


def cancel_child_effect(child: ProcessID, reason: str) -> Effect:
    reason = bounded_text(reason)
    if not reason:
        raise InvalidInput("effect.invalid", "a child cancellation needs a reason")
    return _normalized(
        Target.FRAMEWORK, {"operation": Operation.CANCEL_CHILD.value, "child": ProcessID(child), "reason": reason}
    )


# ---------------------------------------------------------------------------
# Signals (what a Step sees)


class SettlementStatus(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"

    @property
    def definite(self) -> bool:
        return self is not SettlementStatus.UNKNOWN


@dataclass(frozen=True, slots=True)
class Signal:
    """One mailbox record as a Step sees it.

    ``status`` is present only on dispatcher settlement signals; ``effect_id`` names
    the Effect an engine settlement delivers (``settles``).
    """

    id: SignalID
    payload: JSON
    wait_id: WaitID | None = None
    status: SettlementStatus | None = None
    effect_id: EffectID | None = None

    @property
    def engine_owned(self) -> bool:
        return self.id.engine_owned

    def settles(self, effect: EffectID) -> bool:
        return self.effect_id == effect


# ---------------------------------------------------------------------------
# Transitions and Steps


@dataclass(frozen=True, slots=True)
class Continue:
    """Stay schedulable; the effects run in declaration order, one at a time."""

    effects: tuple[Effect, ...] = ()


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Adopt the step and record a strategy checkpoint (``kind``, ``acknowledges``).

    The checkpoint is durable no later than any later Step of the Process and
    before any later Effect of it is dispatched.
    """

    kind: str = "progress"
    acknowledges: JSON = None


@dataclass(frozen=True, slots=True)
class Wait:
    wait_id: WaitID


@dataclass(frozen=True, slots=True)
class Pause:
    reason: str


@dataclass(frozen=True, slots=True)
class OutputOf:
    """Where a completion's output is already stored: the result of one of the completing
    Process's own settled Effects, at ``path`` (object keys, outermost first)."""

    effect_id: EffectID
    path: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Complete:
    """End the Process with ``output``.

    ``output_of`` is a storage hint, not a second output: when the output is exactly the
    value at that place of a settled Effect's result (a Tool child completing with its
    tool's completion), ``ProcessTerminated`` refers to it instead of storing the same
    bytes again. The kernel checks the equality; a hint that does not hold is ignored
    and the output is stored inline.
    """

    output: JSON = None
    output_of: OutputOf | None = None


@dataclass(frozen=True, slots=True)
class Fail:
    failure: Failure


Transition = Continue | Checkpoint | Wait | Pause | Complete | Fail

TRANSITION_KINDS: dict[type, str] = {
    Continue: "continue",
    Checkpoint: "checkpoint",
    Wait: "wait",
    Pause: "pause",
    Complete: "complete",
    Fail: "fail",
}


NO_STATE: Any = object()


@dataclass(frozen=True, slots=True)
class Step:
    """What ``decide`` returns: the consumed prefix, the transition and the facts.

    ``next_state`` is an optional shortcut for a Strategy that computes its next state
    while deciding: it must equal ``evolve(state, facts, consumed)`` exactly (the fold of
    the stored facts, which is what recovery and audit use, must reach the same state).
    """

    consumed: int
    transition: Transition
    facts: JSON = None
    next_state: Any = field(default=NO_STATE, compare=False, repr=False)


def check_reason(reason: str) -> str:
    """A control's reason, trimmed: non-empty UTF-8 text of at most ``MAX_DIAGNOSTIC_BYTES``
    bytes (refused, not cut: what a host sends is stored as sent or not at all)."""
    text = reason.strip() if isinstance(reason, str) else ""
    if not text:
        raise InvalidInput("control.invalid", "a reason must be non-empty text",
                           hint='give a short reason, e.g. "canceled by the operator", or leave it out for the default',
                           recorded_hint=False)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidInput("control.invalid", "a reason must be valid UTF-8 text (it holds a lone surrogate)",
                           hint="remove the lone surrogate (decode bytes with errors='replace')", recorded_hint=False) from None
    if size > MAX_DIAGNOSTIC_BYTES:
        raise InvalidInput(
            "control.invalid", f"a reason is at most {MAX_DIAGNOSTIC_BYTES} bytes of UTF-8, this one is {size}",
            hint="shorten the reason",
        )
    return text


def check_child_operation(
    op: Operation, payload: Mapping[str, Any], programs: Mapping[str, ProgramRef], *,
    reason: Callable[[Any], object] = check_reason,
) -> None:
    """The shape a ``start_child``, ``signal_child`` or ``cancel_child`` payload must have for
    the kernel to settle it (the kernel's Step check, and the fold for stored ones): raises
    ``InvalidInput``, ``KeyError``, ``TypeError`` or ``ValueError``. A start of a Program the
    tree does not bind passes (a failed start the parent observes). ``reason`` checks a
    cancel's reason (the fold reads stored reasons more loosely than a Step is checked)."""
    if op is Operation.START_CHILD:
        try:
            ChildSpec.from_json(payload, programs)
        except InvalidInput as exc:
            if exc.code != "program.unbound":
                raise
            Budget.from_json(payload.get("budget"))
    elif op is Operation.SIGNAL_CHILD:
        ProcessID(payload["child"])
        signal = payload["signal"]
        SignalRequest(SignalID(signal["id"]), signal.get("payload"), signal.get("wait_id"))
    elif op is Operation.CANCEL_CHILD:
        ProcessID(payload["child"])
        reason(payload["reason"])


# ---------------------------------------------------------------------------
# Strategy and Program


class Strategy(Protocol):
    """The decide/evolve contract every Process behaviour implements (pure)."""

    def initial(self, input: JSON) -> Any: ...

    def decide(self, state: Any, window: Sequence[Signal]) -> Step: ...

    def evolve(self, state: Any, facts: JSON, consumed: Sequence[Signal]) -> Any: ...

    def encode_state(self, state: Any) -> JSON: ...

    def decode_state(self, data: JSON) -> Any: ...


PolicyFn = Callable[[Effect], EffectPolicy]
ExpandFn = Callable[[Any, JSON], JSON]
ResolutionCheckFn = Callable[["Program", "EffectRequest", "SettlementStatus", JSON], None]
"""``check_resolution(program, request, status, payload)``: raises ``InvalidInput`` when a host's
outcome of one of the Program's unknown dispatcher Effects is one its strategy would refuse."""


_NEVER = EffectPolicy()


def _never(effect: Effect) -> EffectPolicy:
    return _NEVER


SYNCHRONOUS_HINT = (
    "agentfold's API is synchronous: it calls dispatchers, models and tools from its own threads "
    "and never awaits what they return; define a plain `def` and run async code inside it "
    "(e.g. `asyncio.run(coro)`, or submit it to a thread that runs its own event loop)"
)


def is_async_callable(value: object) -> bool:
    """Whether calling ``value`` only builds an awaitable: an ``async def`` function or
    method, an async generator function, either behind ``functools.partial``, or an object
    whose ``__call__`` is one. agentfold never awaits, so such a callable never runs."""
    while isinstance(value, functools.partial):
        value = value.func
    if _async_code(value):
        return True
    if isinstance(value, type) or hasattr(value, "__code__") or hasattr(value, "__func__"):
        return False  # a class, or a plain function or method
    try:
        dunder = getattr(type(value), "__call__", None)  # noqa: B004 - its async-ness, not callability
    except Exception:  # noqa: BLE001 - an odd metaclass: not ours to judge
        return False
    return dunder is not None and _async_code(dunder)


#: Code flags of an ``async def`` function and of an async generator (``inspect.CO_COROUTINE``,
#: ``inspect.CO_ASYNC_GENERATOR``: the domain layer does not import ``inspect``).
_ASYNC_CODE_FLAGS = 0x80 | 0x200


def _async_code(value: object) -> bool:
    """Whether ``value`` is a function (or bound method) whose code is ``async def``."""
    function = getattr(value, "__func__", value)  # a bound method's function
    code = getattr(function, "__code__", None)
    flags = getattr(code, "co_flags", 0)
    return isinstance(flags, int) and bool(flags & _ASYNC_CODE_FLAGS)


def check_synchronous(what: str, fn: object, code: str) -> None:
    """Refuse (``code``) a callable agentfold would call, given as ``what``, that cannot be
    called or is ``async`` (nothing awaits it: it would never run)."""
    if not callable(fn):
        raise InvalidInput(code, f"{what} is not callable (of type {type(fn).__name__})")
    if is_async_callable(fn):
        raise InvalidInput(code, f"{what} is an async function", hint=SYNCHRONOUS_HINT)


def check_dispatcher(dispatcher: object, owner: str) -> None:
    """Refuse (``program.invalid``) a dispatcher the runtime could never call: one without a
    callable ``dispatch(request, context)``, or whose ``dispatch`` is async (never awaited,
    it would leave every Effect unknown although nothing ran)."""
    try:
        dispatch = getattr(dispatcher, "dispatch", None)
    except Exception as exc:  # a property of the caller's own object
        raise InvalidInput(
            "program.invalid", f"{owner}: reading its dispatcher's dispatch failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(dispatch):
        hint = ("pass an object with dispatch(request, context) -> Settlement, or wrap a plain function "
                "in FunctionDispatcher(fn)")
        if is_async_callable(dispatcher):
            raise InvalidInput(
                "program.invalid", f"{owner}: its dispatcher is an async function, not a Dispatcher",
                hint=f"{hint}; {SYNCHRONOUS_HINT}",
            )
        raise InvalidInput(
            "program.invalid",
            f"{owner}: its dispatcher (of type {type(dispatcher).__name__}) has no dispatch(request, context) method",
            hint=hint,
        )
    check_synchronous(f"{owner}: its dispatcher's dispatch ({type(dispatcher).__name__}.dispatch)", dispatch,
                      "program.invalid")


def _identity_expand(state: Any, payload: JSON) -> JSON:
    return payload


@dataclass(frozen=True, eq=False)
class Program:
    """One exact behaviour binding: Strategy + Descriptor + ProgramRef + child bindings.

    ``policy`` is the dispatcher's pure EffectPolicy function; the policy of each
    declared Effect is recorded with its declaration. ``expand_request`` rebuilds the
    full dispatcher payload from the Process state when an Effect's stored payload
    holds references instead of copies (so history stores each message once).
    """

    descriptor: Descriptor
    strategy: Strategy
    implementation_digest: Digest
    configuration_digest: Digest
    children: tuple[Program, ...] = ()
    policy: PolicyFn = _never
    expand_request: ExpandFn = _identity_expand
    configuration: JSON = None
    dispatcher: Any = field(default=None, compare=False)
    """The adapters' Dispatcher for this Program's dispatcher Effects; the domain never calls it."""
    active_children: int = field(default=0, compare=False)
    """The most children one of this Program's Processes runs at once, when the Program says
    (an Interaction: its tool window, ``max_concurrent_tool_calls``); 0: it does not say. See
    ``children_at_once``."""
    active_children_setting: str = field(default="", compare=False)
    """The setting behind ``active_children``, as the Program's builder names it (for messages:
    what to lower when tree limits are narrower)."""
    check_resolution: ResolutionCheckFn | None = field(default=None, compare=False)
    """Checks a host's definite outcome of one of this Program's unknown dispatcher Effects
    before it is recorded (``Kernel.resolve_effect``; the request is the one the dispatcher
    got, expanded, without an attempt id): it raises ``InvalidInput`` for an outcome the
    strategy would fail the Process on (an Interaction's model call settled with a payload
    that is no model result), so a host's mistake is refused while the host can still say
    what really happened. None: the kernel's rules only (a definite status, bounded JSON)."""
    ref: ProgramRef = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.descriptor, Descriptor):
            raise InvalidInput("program.invalid", f"a Program's descriptor is a Descriptor, not {self.descriptor!r:.100}")
        if not isinstance(self.children, (tuple, list)) or not all(isinstance(c, Program) for c in self.children):
            raise InvalidInput("program.invalid", f"program {self.descriptor.name}: children is a tuple of Programs, "
                               f"not {self.children!r:.100}")
        ref = ProgramRef(
            name=self.descriptor.name,
            contract_digest=self.descriptor.digest,
            implementation_digest=Digest(self.implementation_digest),
            configuration_digest=Digest(self.configuration_digest),
            bindings_digest=ProgramRef.bindings_of([c.ref for c in self.children]),
        )
        if self.dispatcher is not None:
            check_dispatcher(self.dispatcher, f"program {self.descriptor.name}")
        object.__setattr__(self, "ref", ref)

    def child(self, ref: ProgramRef) -> Program | None:
        """The exact child binding for ``ref``: this Program itself, or a bound child."""
        if ref == self.ref:
            return self
        for candidate in self.children:
            if candidate.ref == ref:
                return candidate
        return None

    def walk(self) -> list[Program]:
        """This Program and every Program reachable through its child bindings."""
        seen: dict[Digest, Program] = {}
        stack = [self]
        while stack:
            program = stack.pop()
            if program.ref.digest in seen:
                continue
            seen[program.ref.digest] = program
            stack.extend(program.children)
        return list(seen.values())


def children_at_once(program: Program) -> tuple[int, Program | None]:
    """The most children a Process of ``program``'s tree runs at once, as its Programs declare it
    (``Program.active_children``, the largest over the Program and every bound child), and the
    Program that declares it (None when none does). A tree whose ``max_active_children`` is lower
    would fail the calls beyond it with ``engine.child.tree_limit``, mid-run."""
    most, by = 0, None
    for candidate in program.walk():
        if candidate.active_children > most:
            most, by = candidate.active_children, candidate
    return most, by


ProgramResolver = Callable[[ProgramRef], Program | None]
