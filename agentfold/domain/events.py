"""The event catalogue: every fact of a root tree's history (DESIGN.md "The event stream").

Events are frozen pydantic models with a schema version. Payloads are JSON values;
each piece of content is stored once, in the event that brought it:

* a dispatcher result lives in its ``EffectSettled``; the settlement Signal a Step
  later sees is derived from it by the fold, never stored again;
* a child's input lives in the start-child ``EffectDeclared``; ``ProcessStarted``
  refers to that Effect;
* a child-wait satisfaction is derived by the fold from the children's terminations.

``SignalAdmitted`` therefore records only input that enters a mailbox from outside
the fold's own derivations: host signals, steering, tool-input answers, and signals
a parent delivers with ``signal_child``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Strict

from agentfold.domain.budget import Budget
from agentfold.domain.errors import Failure
from agentfold.domain.ids import (
    EffectAttemptID,
    EffectID,
    ProcessID,
    SignalID,
    StartID,
    TreeID,
    TreeIncarnationID,
    WaitID,
)
from agentfold.domain.input_changes import holds_input_patch
from agentfold.domain.program import ProgramRef

SCHEMA_VERSION = 1

#: A count or position the kernel computes: a whole number as stored, never ``true`` or
#: ``"1"`` read as 1 (pydantic's lax mode would take both from a forged or hand-edited event).
#: ``StepCommitted.consumed`` stays lax: the kernel stored a Strategy's ``Step(True, ...)``
#: as ``true`` until 2026-12-04.
StrictCount = Annotated[int, Strict()]


class TreeEvent(BaseModel):
    """Base of every event: the Process it concerns and the schema version."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=False)
    schema_version: ClassVar[int] = SCHEMA_VERSION
    process_id: ProcessID

    @classmethod
    def model_construct(cls, _fields_set: set[str] | None = None, **values: Any) -> Self:  # type: ignore[override]
        """An event from values that are already valid, without validating them again.

        The kernel builds every event it emits this way, several per Effect. Same result as
        pydantic's ``model_construct`` for these models (no aliases, validators or private
        attributes) at about half its cost; an unknown or missing field raises ``TypeError``
        instead of being dropped. Field defaults are immutable (None, tuples, strings,
        frozen models), so one default instance is shared.
        """
        spec = _CONSTRUCT.get(cls)
        if spec is None:
            spec = _construct_spec(cls)
        defaults, required = spec
        if not values.keys() >= required:
            missing = next(name for name in defaults if name in required and name not in values)
            raise TypeError(f"{cls.__name__}.model_construct() needs {missing}")
        # Safe: the defaults in field order, overwritten in place by the given values, hold the same
        # keys in the same order as filling field by field; an unknown name adds a key (refused below).
        data = defaults.copy()
        data.update(values)
        if len(data) != len(defaults):
            raise TypeError(f"{cls.__name__}.model_construct() got unknown fields {sorted(set(values) - set(defaults))}")
        event = _new_object(cls)
        # Safe: BaseModel's own slot descriptors, what object.__setattr__ looks up by name each time.
        _set_dict(event, data)
        _set_fields_set(event, set(values) if _fields_set is None else _fields_set)
        _set_extra(event, None)
        _set_private(event, None)
        return event


_REQUIRED: Any = object()
_FIELD_DEFAULTS: dict[type[TreeEvent], tuple[tuple[str, Any], ...]] = {}


def _field_defaults(cls: type[TreeEvent]) -> tuple[tuple[str, Any], ...]:
    """Each field of ``cls`` with its default (``_REQUIRED`` for a required one), in order."""
    fields = _FIELD_DEFAULTS[cls] = tuple(
        (name, _REQUIRED if f.is_required() else f.get_default(call_default_factory=True))
        for name, f in cls.model_fields.items()
    )
    return fields


#: Per event class: its fields' defaults by name in field order (``_REQUIRED`` for a required
#: field) and the names of its required fields (``model_construct``).
_CONSTRUCT: dict[type[TreeEvent], tuple[dict[str, Any], frozenset[str]]] = {}


def _construct_spec(cls: type[TreeEvent]) -> tuple[dict[str, Any], frozenset[str]]:
    fields = _FIELD_DEFAULTS.get(cls) or _field_defaults(cls)
    spec = _CONSTRUCT[cls] = (dict(fields), frozenset(name for name, default in fields if default is _REQUIRED))
    return spec


_new_object = object.__new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


class TreeLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_depth: int = 16
    max_children: int | None = None
    max_active_children: int = 16
    max_tree_processes: int | None = None
    max_pending_signals: int = 10_000


class TreeStarted(TreeEvent):
    """A root Process is started (always position 1). ``process_id`` is the root."""

    tree_id: TreeID
    start_id: StartID
    incarnation_id: TreeIncarnationID
    program: ProgramRef
    input: Any = None
    budget: Budget = Budget()
    capabilities: tuple[str, ...] = ()
    limits: TreeLimits = TreeLimits()
    configuration: Any = None
    """The program's configuration document (e.g. a scenario), so later commands need no file."""
    programs: tuple[ProgramRef, ...] = ()
    """Every ProgramRef bound under the root program (its child bindings, recursively); child
    starts name their program by text ref, resolved here."""


class WriterActivated(TreeEvent):
    """A runtime takes ownership of an existing tree (recovery). ``process_id`` is the root."""

    incarnation_id: TreeIncarnationID
    previous_incarnation_id: TreeIncarnationID


class ProcessStarted(TreeEvent):
    """A child joins the tree and settles its parent's start-child Effect (succeeded).

    Everything else about the child (key, program, input, grant, capabilities) is the
    start-child Effect's payload, stored once with its declaration.
    """

    parent_id: ProcessID
    start_effect_id: EffectID


class SignalAdmitted(TreeEvent):
    signal_id: SignalID
    wait_id: WaitID | None = None
    payload: Any = None
    source: Literal["host", "parent"] = "host"


TransitionKind = Literal["continue", "checkpoint", "wait", "pause", "complete", "fail"]


class StepCommitted(TreeEvent):
    """A Step's decision is adopted: its facts are applied and ``consumed`` signals leave the mailbox.

    ``effects`` EffectDeclared events follow immediately. ``complete`` and ``fail``
    are followed by the Process's ``ProcessTerminated``; ``checkpoint`` by its
    ``CheckpointCommitted``.
    """

    step: StrictCount
    consumed: int
    kind: TransitionKind
    facts: Any = None
    effects: StrictCount = 0
    wait_id: WaitID | None = None
    reason: str | None = None


class EffectDeclared(TreeEvent):
    effect_id: EffectID
    step: StrictCount
    index: StrictCount
    target: Literal["framework", "dispatcher"]
    payload: Any = None
    replay: Literal["never", "same_identity"] = "never"
    capabilities: tuple[str, ...] = ()


class EffectDispatched(TreeEvent):
    """Dispatch permission, committed before the dispatcher is called, by the writer
    (incarnation) that holds the tree."""

    effect_id: EffectID
    attempt_id: EffectAttemptID
    incarnation_id: TreeIncarnationID


class EffectSettled(TreeEvent):
    """An outcome: succeeded / failed (definite) or unknown (with a diagnostic)."""

    effect_id: EffectID
    status: Literal["succeeded", "failed", "unknown"]
    payload: Any = None
    attempt_id: EffectAttemptID | None = None
    diagnostic: Failure | None = None


class EffectResolved(TreeEvent):
    """A host (or a definite replay) settles an unknown Effect."""

    effect_id: EffectID
    status: Literal["succeeded", "failed"]
    payload: Any = None
    resolved_by: Literal["host", "replay"] = "host"
    attempt_id: EffectAttemptID | None = None


class CheckpointCommitted(TreeEvent):
    step: StrictCount
    kind: str
    acknowledges: Any = None


ControlKind = Literal["pause", "resume", "cancel", "kill", "deadline"]


class ControlRequested(TreeEvent):
    control: ControlKind
    reason: str = ""
    owner: Literal["host", "parent"] = "host"


TerminalStatus = Literal["completed", "failed", "canceled", "timed_out", "killed"]
Cause = Literal[
    "completion",
    "engine_kill",
    "host_deadline",
    "parent_deadline",
    "host_cancellation",
    "parent_cancellation",
    "execution_failure",
    "contract_failure",
    "external_failure",
    "panic",
]


class OutputRef(BaseModel):
    """A completed Process's output, stored where it already is: the result of one of the
    Process's own settled Effects, at ``path`` (object keys, outermost first)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    effect_id: EffectID
    path: tuple[str, ...] = ()


class ProcessTerminated(TreeEvent):
    """First terminal outcome wins; the status never changes afterwards.

    A completed Process's output is ``output``, or, when it is exactly a value its own
    settled Effect already recorded (a Tool child ending with its tool's completion),
    ``output_of`` points there and ``output`` is absent: the content is stored once.
    Such an event is schema version 2 (topic ``ProcessTerminated@2``).
    """

    status: TerminalStatus
    cause: Cause
    reason: str = ""
    failure: Failure | None = None
    output: Any = None
    output_of: OutputRef | None = None
    unresolved_effect_ids: tuple[EffectID, ...] = ()


EVENT_TYPES: dict[str, type[TreeEvent]] = {
    cls.__name__: cls
    for cls in (
        TreeStarted,
        WriterActivated,
        ProcessStarted,
        SignalAdmitted,
        StepCommitted,
        EffectDeclared,
        EffectDispatched,
        EffectSettled,
        EffectResolved,
        CheckpointCommitted,
        ControlRequested,
        ProcessTerminated,
    )
}

AnyEvent = (
    TreeStarted
    | WriterActivated
    | ProcessStarted
    | SignalAdmitted
    | StepCommitted
    | EffectDeclared
    | EffectDispatched
    | EffectSettled
    | EffectResolved
    | CheckpointCommitted
    | ControlRequested
    | ProcessTerminated
)


def event_type(event: TreeEvent) -> str:
    return type(event).__name__


#: The newest schema version of each event type that has more than version 1.
#: ``ProcessTerminated`` 2 adds ``output_of``; a version-1 reader must refuse it (it
#: would take the missing ``output`` for null), so the version is in the topic.
#: ``EffectDeclared`` 2: a start-child payload may hold ``input_patch`` instead of ``input``
#: (agentfold.domain.input_changes), which a version-1 reader would take for a null input.
EVENT_VERSIONS: dict[str, int] = {"ProcessTerminated": 2, "EffectDeclared": 2}


def event_version(event: TreeEvent) -> int:
    """The schema version an event is stored under: the lowest that can carry it, so an
    event without the newer fields stays byte-identical to what older releases wrote."""
    cls = type(event)  # the event types are final (and an isinstance check on them is slow)
    if cls is ProcessTerminated:
        return 2 if event.output_of is not None else 1  # type: ignore[attr-defined]
    if cls is EffectDeclared:
        return 2 if holds_input_patch(event.target, event.payload) else 1  # type: ignore[attr-defined]
    return 1


def event_body(event: TreeEvent) -> dict[str, Any]:
    """The event's fields as JSON values (what is stored and digested); defaults are omitted.

    A field's default is therefore part of the event's schema version: changing one
    needs a new schema version and an upcaster.

    Exactly ``event.model_dump(mode="json", exclude_defaults=True)``. Every event of an
    Effect is encoded once, so the common case skips pydantic's serializer (a third of an
    encode): when every field to keep is already a JSON value (ids are ``str``, payloads
    and facts were normalized), the body is those values, tuples as lists; a nested model
    or any other type takes pydantic's path.
    """
    cls = type(event)
    fields = _FIELD_DEFAULTS.get(cls)
    if fields is None:
        fields = _field_defaults(cls)
    values = event.__dict__
    body: dict[str, Any] = {}
    passed = _PASSED_TYPES
    for name, default in fields:
        value = values[name]
        if default is not _REQUIRED and (value is default or value == default):
            continue
        if type(value) in passed:  # safe: a type that passed the isinstance check below before
            body[name] = value
            continue
        if isinstance(value, tuple):
            if not all(isinstance(item, str) for item in value):
                return event.model_dump(mode="json", exclude_defaults=True)
            value = [str(item) for item in value]
        elif value is not None and not isinstance(value, _JSON_FIELD_TYPES):
            return event.model_dump(mode="json", exclude_defaults=True)
        else:
            passed.add(type(value))  # None or a JSON type: whether it passes depends on the type alone
        body[name] = value
    return body


#: Field values ``event_body`` passes through as they are (normalized JSON values, ids as ``str``).
_JSON_FIELD_TYPES = (str, int, float, dict, list)
#: The exact types of the field values ``event_body`` has passed through (None and subclasses of
#: ``_JSON_FIELD_TYPES`` other than tuple: ids, ints, dicts...); a set lookup instead of isinstance.
_PASSED_TYPES: set[type] = set()


def event_from_body(type_name: str, body: dict[str, Any]) -> TreeEvent:
    """Rebuild an event from its stored type name and body, validating every field."""
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise ValueError(f"unknown event type {type_name!r}")
    return cls.model_validate(body)
