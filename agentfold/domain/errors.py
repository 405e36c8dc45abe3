"""Failures and classified errors.

Two families, never mixed:

* a :class:`Failure` is a persisted fact: why a Process ended (kind + stable code +
  message), or the diagnostic of an Effect whose outcome is unknown;
* an :class:`AgentfoldError` is raised to a caller (host, CLI, HTTP client) when a
  request is refused. It carries a stable ``code``, what was wrong (``message``) and
  what to do (``hint``). A refused request changes nothing in the store.

Errors are classified by the domain that owns them (``engine.*``, ``interaction.*``,
``identity.*``, ``payload.*``), never by message text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Self

MAX_DIAGNOSTIC_BYTES = 4096
"""Upper bound of a Failure message, a pause reason and a control reason, in UTF-8 bytes."""

_QUALIFIED = re.compile(r"[a-z][a-z0-9._-]{0,127}")


def valid_qualified_name(value: str) -> bool:
    """1-128 bytes, first ``a-z``, then ``[a-z0-9._-]`` (kernel spec 1.5)."""
    return isinstance(value, str) and bool(_QUALIFIED.fullmatch(value)) and value.isascii()


class FailureKind(StrEnum):
    EXECUTION = "execution"
    CONTRACT = "contract"
    EXTERNAL = "external"
    PANIC = "panic"


def bounded_text(value: str, limit: int = MAX_DIAGNOSTIC_BYTES) -> str:
    """Trim and cut ``value`` to at most ``limit`` UTF-8 bytes on a character boundary."""
    text = value.strip()
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (a file name decoded with surrogateescape, say): no UTF-8 text, so
        # no history could hold it. Written as its escape (``\udc80``) instead.
        data = text.encode("utf-8", errors="backslashreplace")
        text = data.decode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore").rstrip()


@dataclass(frozen=True, slots=True)
class Failure:
    """Why something failed: kind, stable code, human message (bounded, no secrets)."""

    kind: FailureKind
    code: str
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FailureKind):
            object.__setattr__(self, "kind", FailureKind(self.kind))
        if not valid_qualified_name(self.code):
            raise InvalidInput("failure.invalid", f"failure code {self.code!r} is not a qualified name")
        message = bounded_text(self.message)
        if not message:
            raise InvalidInput("failure.invalid", "failure message must not be empty")
        object.__setattr__(self, "message", message)

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind.value, "code": self.code, "message": self.message}

    @classmethod
    def from_json(cls, value: Any) -> Failure:
        if not isinstance(value, dict) or set(value) != {"kind", "code", "message"}:
            raise InvalidInput("failure.invalid", f"not a failure object: {value!r}")
        try:
            kind = FailureKind(value["kind"])
        except ValueError as exc:
            raise InvalidInput("failure.invalid", f"unknown failure kind {value['kind']!r}") from exc
        return cls(kind, str(value["code"]), str(value["message"]))

    def __str__(self) -> str:
        return f"{self.kind.value} {self.code}: {self.message}"


class AgentfoldError(Exception):
    """A refused request, with a stable code, what was wrong and what to do.

    ``exit_status`` is what the CLI returns (2 = the caller's input was refused,
    1 = something else went wrong) and ``http_status`` what the HTTP API answers.
    """

    exit_status: ClassVar[int] = 1
    http_status: ClassVar[int] = 500

    def __init__(self, code: str, message: str, hint: str = "", *, recorded_hint: bool = True, **detail: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        # Whether a history that records this error's text (a Step that raised it: see
        # ``recorded_text``) records the hint too. Hints given to an error that a Program's
        # decide/evolve or an Interaction can raise after histories already recorded its text
        # without one pass False: a recorded history, and what ``audit drift`` compares with
        # it, must not change when advice is added or reworded.
        self.recorded_hint = recorded_hint
        self.details = detail

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}"
        if self.hint:
            text += f" ({self.hint})"
        return text

    def members(self) -> dict[str, Any]:
        """What the error names, as members of a problem document (HTTP API)."""
        return dict(self.details)

    def again(self) -> Self:
        """A copy to raise again: the same class, code, message, hint and details, without the
        traceback, cause or context of an earlier raise. An error kept to be raised later (a
        stopped owner line's, for every later ``result()``) is kept and raised as a copy: kept
        as raised, its traceback held the raising frames and all they named; raised again as
        itself, it grows by the raising frames each time."""
        fresh = type(self).__new__(type(self))
        fresh.args = self.args
        fresh.__dict__.update(self.__dict__)
        return fresh

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.hint:
            body["hint"] = self.hint
        if self.details:
            body["detail"] = self.details
        return body


def recorded_text(exc: BaseException) -> str:
    """An error's text as a history records it (a failed Step's message, a refusal the model
    reads): ``str(exc)``, without a hint given with ``recorded_hint=False``."""
    if isinstance(exc, AgentfoldError) and exc.hint and not exc.recorded_hint:
        return f"{exc.code}: {exc.message}"
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception whose own __str__ fails
        return f"({type(exc).__name__} whose text cannot be read)"


class InvalidInput(AgentfoldError):
    """The request itself is malformed (ids, payloads, schemas, sizes)."""

    exit_status = 2
    http_status = 422


class NotFound(AgentfoldError):
    """The named tree, process, effect or wait does not exist."""

    exit_status = 2
    http_status = 404


class Rejected(AgentfoldError):
    """The request is well formed but the current state refuses it (conflict)."""

    exit_status = 2
    http_status = 409


class ResourceLimitExceeded(Rejected):
    """Admitting the request would exceed a budget or a capacity limit."""


class Fenced(AgentfoldError):
    """This writer lost ownership of the tree; it stops and appends nothing more."""

    http_status = 409


class StoreFailure(AgentfoldError):
    """The event store failed; the outcome of the last append may be unknown."""

    http_status = 503


class ClassifiedError(Exception):
    """An error a Strategy raises from ``decide`` that carries its own Failure.

    The runtime persists exactly this classification as the Process failure
    (kernel spec 7: classified sentinels). Any other exception raised by ``decide``
    is classified ``execution`` / ``execution.step.failed``.
    """

    def __init__(self, kind: FailureKind, code: str, message: str) -> None:
        super().__init__(message)
        self.failure = Failure(kind, code, message)


# Engine failure codes persisted in terminations and diagnostics (kernel spec 7).
class EngineCode:
    CAPABILITY_DENIED = "engine.capability.denied"
    CHILD_ADMISSION_REJECTED = "engine.child.admission.rejected"
    CHILD_BUDGET_EXHAUSTED = "engine.child.budget_exhausted"
    CHILD_CAPABILITY_ESCALATION = "engine.child.capability_escalation"
    CHILD_CONTROL_NOT_OWNED = "engine.child.control.not_owned"
    CHILD_DEPLOYMENT_UNAVAILABLE = "engine.child.deployment_unavailable"
    CHILD_IDENTITY_CONFLICT = "engine.child.identity_conflict"
    CHILD_INPUT_INVALID = "engine.child.input.invalid"
    CHILD_REQUEST_INVALID = "engine.child.request.invalid"
    CHILD_SIGNAL_REJECTED = "engine.child.signal.rejected"
    CHILD_START_INTERRUPTED = "engine.child.start.interrupted"
    CHILD_TREE_LIMIT = "engine.child.tree_limit"
    COUNTER_EXHAUSTED = "engine.counter.exhausted"
    DISPATCH_CANCELED = "engine.dispatch.canceled"
    DISPATCH_DEADLINE = "engine.dispatch.deadline"
    DISPATCH_FAILED = "engine.dispatch.failed"
    DISPATCH_PANICKED = "engine.dispatch.panicked"
    DISPATCH_SETTLEMENT_INVALID = "engine.dispatch.settlement.invalid"
    DISPATCH_INTERRUPTED = "engine.dispatch.interrupted"
    LIMIT_EFFECTS = "engine.limit.effects"
    LIMIT_SIGNALS = "engine.limit.signals"
    LIMIT_STEPS = "engine.limit.steps"
    EFFECT_INVALID = "execution.effect.invalid"
    OUTPUT_INVALID = "execution.output.invalid"
    STEP_FAILED = "execution.step.failed"
    TRANSITION_INVALID = "execution.transition.invalid"
    PROCESS_START_FAILED = "engine.process.start.failed"
