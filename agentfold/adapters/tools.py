"""Executable tools and the Tool child's dispatcher.

A :class:`Tool` runs one call: ``call(invocation, arguments)`` returns a
:class:`ToolOutput`. Its outcome maps, in this precedence (spec 3.2):

1. an invalid call (unknown tool, arguments that do not parse or violate the
   parameters schema) → a definite *rejected* result, before the tool runs;
2. a returned ToolOutput → *succeeded*;
3. a raised :class:`ToolFailure` → a definite model-visible error result, disposition
   ``rejected`` or ``failed`` (even when caused by a cancellation);
4. a raised :class:`ToolInputRequired` → an input request (the child opens a wait);
5. anything else raised (errors, timeouts, cancellation, bugs) → **unknown**: the
   runtime records it and a host must settle it; it is never retried on its own.

Observers see each attempt (started / settled); their exceptions are isolated and
counted, never change a settlement.
"""

from __future__ import annotations

import inspect
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentfold.adapters.dispatch import DispatchContext
from agentfold.domain.canonical import JSON, normalize
from agentfold.domain.errors import InvalidInput, recorded_text
from agentfold.domain.ids import EffectAttemptID, EffectID
from agentfold.domain.interaction.chat import ToolCall
from agentfold.domain.interaction.refs import ToolCallRef, tool_call_ref_of_child
from agentfold.domain.interaction.tool_call import check_input_request
from agentfold.domain.interaction.toolset import Classifier, ToolManifest, ToolSpec
from agentfold.domain.kernel import brief_repr
from agentfold.domain.program import check_synchronous
from agentfold.domain.requests import EffectRequest, Relation, Settlement


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A tool's model-visible output: text content and optional structured details."""

    content: tuple[str, ...] = ()
    details: JSON = None

    def __post_init__(self) -> None:
        # Checked when made: a str was taken as its letters (five one-letter text parts sent to
        # the model as a succeeded result) and other values as their repr.
        content = self.content
        if isinstance(content, (str, bytes)) or not isinstance(content, (tuple, list)) or not all(
            isinstance(part, str) for part in content
        ):
            raise InvalidInput(
                "tool.output_invalid", f"a ToolOutput's content is a tuple of texts, not {brief_repr(content)}",
                hint='ToolOutput.text("...") for one text; ToolOutput(("a", "b")) for several',
            )
        object.__setattr__(self, "content", tuple(content))

    @classmethod
    def text(cls, text: str, details: JSON = None) -> ToolOutput:
        return cls((text,), details)

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {}
        if self.content:
            out["content"] = [{"type": "text", "text": t} for t in self.content]
        if self.details is not None:
            out["details"] = normalize(self.details, what="tool details")
        return out


class ToolFailureInvalid(InvalidInput, ValueError):
    """A ToolFailure made with a kind other than failed/rejected, or an output that is no text or
    ToolOutput (``tool.failure_invalid``). Still a ValueError, as before it was classified."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("tool.failure_invalid", message, hint=hint)


class ToolFailure(Exception):
    """A definite unsuccessful outcome: ``failed`` (it ran and failed) or ``rejected`` (refused)."""

    def __init__(self, kind: str, output: ToolOutput | str, cause: BaseException | None = None) -> None:
        if not isinstance(kind, str) or kind not in ("failed", "rejected"):
            raise ToolFailureInvalid(
                f"a ToolFailure's kind is 'failed' (it ran and failed) or 'rejected' (it refused), not {brief_repr(kind)}",
                hint='raise ToolFailure("failed", "what went wrong") or ToolFailure("rejected", "why not")',
            )
        if not isinstance(output, (str, ToolOutput)):
            raise ToolFailureInvalid(
                f"a ToolFailure's output is a text or a ToolOutput, not {brief_repr(output)}",
                hint='raise ToolFailure("failed", "what went wrong"), or with ToolOutput.text("...", details)',
            )
        self.kind = kind
        self.output = ToolOutput.text(output) if isinstance(output, str) else output
        super().__init__(f"{kind}: {self.output.content}")
        self.__cause__ = cause


class ToolInputRequired(Exception):
    """Control flow, not a failure: the tool needs an answer before it can continue."""

    def __init__(self, prompt: JSON, response_schema: JSON, state: JSON) -> None:
        super().__init__("tool input required")
        self.request = {"prompt": prompt, "response_schema": response_schema, "state": state}


@dataclass(frozen=True, slots=True)
class InputContinuation:
    state: JSON
    response: JSON


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """The attribution of one actual tool call attempt."""

    call: ToolCall
    effect_id: EffectID
    attempt_id: EffectAttemptID | None
    relation: Relation
    step: int
    reference: ToolCallRef | None
    continuation: InputContinuation | None = None
    context: DispatchContext | None = None


class Tool(Protocol):
    """An executable tool; ``call`` is synchronous (a plain ``def``). Optional attributes: ``direct_result`` (bool), ``concurrency``
    (a pure classifier ``(call, arguments) -> (key, concurrent)``), ``advertise``
    (``(invocation, output) -> [deferred tool names]``, pure)."""

    name: str
    description: str
    parameters: JSON

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput: ...


_MISSING: Any = object()


def tool_spec(tool: Tool) -> ToolSpec:
    """The frozen, pure scheduling view of an executable tool.

    Reading the optional declarations runs the tool's own code (properties); any error
    there rejects the ToolSet at construction, never later at a Step. So does a tool the
    dispatcher could never run (no ``description``, no callable ``call``, an ``async def``
    ``call``, ``concurrency`` or ``advertise``): refused here, it never becomes an unknown
    Effect that a human must resolve although no call happened.
    """
    try:
        classifier: Classifier | None = getattr(tool, "concurrency", None)
        direct = bool(getattr(tool, "direct_result", False))
        name = tool.name
        description = getattr(tool, "description", _MISSING)
        parameters = getattr(tool, "parameters", {"type": "object"})
        call = getattr(tool, "call", None)
        advertise = getattr(tool, "advertise", None)
    except Exception as exc:
        raise InvalidInput(
            "interaction.toolset.invalid",
            f"reading the declarations of tool {getattr(type(tool), '__name__', tool)!r} failed: "
            f"{type(exc).__name__}: {exc}",
        ) from exc
    if description is _MISSING:
        raise InvalidInput(
            "interaction.toolset.invalid", f"tool {name!r} has no description",
            hint="give it a description attribute: the text the model reads to decide when to call it",
        )
    spec = ToolSpec(
        name=name,
        description=description,
        parameters=parameters,
        direct_result=direct,
        concurrency=classifier,
    )
    if not callable(call):
        raise InvalidInput(
            "interaction.toolset.invalid", f"tool {name!r} has no call(invocation, arguments) method",
            hint="give it a method call(invocation, arguments) that returns a ToolOutput",
        )
    for what, fn in (("call method", call), ("concurrency policy", classifier), ("advertise function", advertise)):
        if fn is not None:
            check_synchronous(f"tool {name!r}: its {what}", fn, "interaction.toolset.invalid")
    return spec


def tool_invocation_from_request(request: EffectRequest) -> ToolInvocation:
    """The attribution retained by a Tool Effect request (e.g. one rebuilt for recovery).

    Performs no call and resolves nothing; a request that is not a tool call (a model
    call, say) is refused. A retained request has no attempt id until dispatched again.
    """
    body = request.payload.get("tool_call") if isinstance(request, EffectRequest) and isinstance(request.payload, dict) else None
    if not isinstance(body, dict) or not isinstance(body.get("invocation"), dict):
        raise InvalidInput("interaction.tool_invocation.invalid", "the request is not a tool call")
    call = ToolCall.from_json(body["invocation"].get("call"))
    return ToolInvocation(
        call=call,
        effect_id=request.effect_id,
        attempt_id=request.attempt_id,
        relation=request.relation,
        step=request.step,
        reference=tool_call_ref_of_child(request.relation.parent_id, request.relation.child_key),
    )


def _in_cause_chain(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in the error chain of ``exc``, depth first: the exception, its
    explicit cause (``raise X from Y``) and the members of an exception group, as Go's
    ``errors.As`` walks wrapped and joined errors (spec 3.2: "the error chain contains").
    Implicit context (an exception raised while handling another) does not count.
    """
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending and len(seen) < 256:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        following: list[BaseException] = []
        if current.__cause__ is not None:
            following.append(current.__cause__)
        if isinstance(current, BaseExceptionGroup):
            following.extend(current.exceptions)
        pending.extend(reversed(following))
    return None


@dataclass(frozen=True, slots=True)
class ToolSettlementObservation:
    """What an observer sees when a tool attempt ends."""

    disposition: str | None  # succeeded | failed | rejected | None (input required or unknown)
    input_required: bool = False
    failure: str = ""


class ToolObserver(Protocol):
    def on_tool_started(self, invocation: ToolInvocation) -> None: ...

    def on_tool_settled(self, invocation: ToolInvocation, settlement: ToolSettlementObservation) -> None: ...


@dataclass(slots=True)
class ObservationFailures:
    """Isolated observer exceptions, counted per callback; the last diagnostic is kept."""

    counts: dict[str, int] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, callback: str, exc: BaseException) -> None:
        with self._lock:
            self.counts[callback] = self.counts.get(callback, 0) + 1
            self.last[callback] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4096]


def observe(failures: ObservationFailures, callback: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - observers are observational only
        failures.record(callback, exc)


def completion(disposition: str, output: ToolOutput, advertised: Sequence[str] = ()) -> dict[str, JSON]:
    body: dict[str, JSON] = {"disposition": disposition, "output": output.to_json()}
    if advertised:
        body["advertised_tool_names"] = list(advertised)
    return {"tool_result": {"completion": body}}


class ToolDispatcher:
    """Executes the ``tool_call`` Effect of a Tool child."""

    def __init__(
        self, manifest: ToolManifest, tools: Sequence[Tool], observer: ToolObserver | None = None
    ) -> None:
        self.manifest = manifest
        self.tools = {t.name: t for t in tools}
        self.observer = observer
        self.observation_failures = ObservationFailures()

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        body = request.payload.get("tool_call") if isinstance(request.payload, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("invocation"), dict):
            return Settlement.failed("the tool dispatcher received a payload that is not a tool_call")
        call = ToolCall.from_json(body["invocation"]["call"])
        resume = body.get("resume")
        continuation = None
        if isinstance(resume, dict):
            continuation = InputContinuation(resume["input_request"]["state"], resume.get("input_response"))
        invocation = ToolInvocation(
            call=call,
            effect_id=request.effect_id,
            attempt_id=request.attempt_id,
            relation=request.relation,
            step=request.step,
            reference=tool_call_ref_of_child(request.relation.parent_id, request.relation.child_key),
            continuation=continuation,
            context=context,
        )
        spec = self.manifest.tool(call.name)
        tool = self.tools.get(call.name)
        if spec is None or tool is None:
            return Settlement.succeeded(
                completion("rejected", ToolOutput.text(f'error: tool "{call.name}" is not available'))
            )
        arguments, problem = spec.prepare(call)
        if problem is not None:
            return Settlement.succeeded(completion("rejected", ToolOutput.text(f"error: invalid arguments: {problem}")))
        if self.observer is not None:
            observe(self.observation_failures, "tool_started", lambda: self.observer.on_tool_started(invocation))  # type: ignore[union-attr]
        observed = ToolSettlementObservation(None, failure="the tool raised")
        try:
            try:
                output = tool.call(invocation, arguments)
            except Exception as raised:
                failure = _in_cause_chain(raised, ToolFailure)
                if failure is not None:
                    # A definite outcome even when caused by a cancellation or a deadline.
                    assert isinstance(failure, ToolFailure)
                    observed = ToolSettlementObservation(failure.kind)
                    return Settlement.succeeded(completion(failure.kind, failure.output))
                required = _in_cause_chain(raised, ToolInputRequired)
                if required is None:
                    raise
                assert isinstance(required, ToolInputRequired)
                observed = ToolSettlementObservation(None, input_required=True)
                try:
                    check_input_request(normalize(required.request, what="input request"))
                except Exception as exc:
                    raise RuntimeError(f"invalid input request: {exc}") from exc
                return Settlement.succeeded({"tool_result": {"input_request": required.request}})
            if not isinstance(output, ToolOutput):
                if inspect.iscoroutine(output):
                    output.close()  # never run: no "was never awaited" warning; still unknown below
                raise TypeError(f"tool {call.name} returned {type(output).__name__}, not a ToolOutput")
            advertised: list[str] = []
            advertise = getattr(tool, "advertise", None)
            if advertise is not None:
                advertised = list(dict.fromkeys(advertise(invocation, output)))  # first-seen order, as Scope
            result = completion("succeeded", output, advertised)
            normalize(result, what="tool result")
            observed = ToolSettlementObservation("succeeded")
            return Settlement.succeeded(result)
        except InvalidInput as exc:
            observed = ToolSettlementObservation(None, failure=exc.message)
            raise RuntimeError(f"tool {call.name} produced an invalid result: {exc.message}") from exc
        except Exception as exc:
            observed = ToolSettlementObservation(None, failure=f"{type(exc).__name__}: {recorded_text(exc)}")
            raise
        finally:
            if self.observer is not None:
                final = observed
                observe(
                    self.observation_failures,
                    "tool_settled",
                    lambda: self.observer.on_tool_settled(invocation, final),  # type: ignore[union-attr]
                )
