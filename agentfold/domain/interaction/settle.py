"""Recovery helpers: build the settlement of an unknown Interaction Effect without calling anything.

A host that investigated an unknown outcome builds the definite settlement with one of
these and submits it with ``Runtime.resolve_unknown_effect``. Each validates the
request against the exact Program that made it (another ToolSet or Interaction is
refused), and the result against the same rules live dispatch follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentfold.domain.canonical import JSON, normalize
from agentfold.domain.errors import ClassifiedError, InvalidInput
from agentfold.domain.interaction.chat import FINISH_REASONS, ToolCall, parse_messages, parse_parts, parse_response
from agentfold.domain.interaction.interaction import InteractionStrategy, response_problem, tool_calls_not_completed
from agentfold.domain.interaction.tool_call import ToolCallStrategy, check_input_request
from agentfold.domain.program import Program, SettlementStatus
from agentfold.domain.requests import EffectRequest, Settlement

DISPOSITIONS = ("succeeded", "failed", "rejected")


def _refuse(message: str) -> InvalidInput:
    return InvalidInput(
        "interaction.settlement.invalid", message,
        hint="a tool call is resolved with its output (and disposition), a model call with the model's response, "
        "a context preparation with the prepared messages (`agentfold unknown` says which; docs/interaction.md#recovery)",
    )


def _check_program(program: Program, request: EffectRequest) -> None:
    if not isinstance(program, Program):
        raise _refuse("the exact Program that made the request is required")
    if not isinstance(request, EffectRequest):
        raise _refuse("the original EffectRequest of the unknown effect is required")
    if request.program != program.ref:
        raise _refuse(
            f"the effect was requested by {request.program.name} ({request.program.digest}), "
            f"not by this program ({program.ref.digest})"
        )


def tool_output_json(output: JSON) -> dict[str, Any]:
    """Accept text, ``{content?, details?}`` and return the canonical tool output.

    ``content`` is text or a list whose items are text or canonical text parts
    (``{"type": "text", "text": ...}``, as ``unknown``/``results`` show them); anything
    else is refused with the JSON path of the fault, never coerced to text.
    """
    if isinstance(output, str):
        return {"content": [{"type": "text", "text": output}]}
    if not isinstance(output, dict):
        raise _refuse(
            f"output: a tool output is text or an object with content and/or details, not {_json_type(output)}"
        )
    extra = set(output) - {"content", "details"}
    if extra:
        raise _refuse(
            f"output.{sorted(extra)[0]}: is not a tool output member (a tool output has content and/or details)"
        )
    out: dict[str, Any] = {}
    content = output.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise _refuse(f'output.content: must be text or a list of texts, not {_json_type(content)}')
    try:
        parts = parse_parts(content, "output.content")
    except InvalidInput as exc:
        raise _refuse(f"{exc.message} (content is text or a list of texts)") from exc
    if parts and content != "":
        out["content"] = parts
    if output.get("details") is not None:
        try:
            out["details"] = normalize(output["details"], what="tool details")
        except InvalidInput as exc:
            raise _refuse(f"output.details: {exc.message}") from exc
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def settle_tool_result(
    program: Program,
    request: EffectRequest,
    output: JSON,
    disposition: str = "succeeded",
    advertised_tool_names: Sequence[str] = (),
) -> Settlement:
    """The settlement of an investigated tool call; the call must still be admitted by the binding."""
    _check_program(program, request)
    strategy = program.strategy
    if not isinstance(strategy, ToolCallStrategy):
        raise _refuse("this program does not run tool calls")
    body = request.payload.get("tool_call") if isinstance(request.payload, dict) else None
    if not isinstance(body, dict) or not isinstance(body.get("invocation"), dict):
        raise _refuse("the request is not a tool call")
    call = ToolCall.from_json(body["invocation"].get("call"))
    spec = strategy.manifest.tool(call.name)
    if spec is None:
        raise _refuse(f'tool "{call.name}" is not bound to this ToolSet')
    # Read as leniently as any release that may have run the call (an unknown outcome from
    # before 2026-12-05 stays resolvable); this release's dispatcher refuses more before running.
    _, problem = spec.prepare(call, exact=False)
    if problem is not None:
        raise _refuse(f"the call's arguments are not admitted: {problem}")
    if disposition not in DISPOSITIONS:
        raise _refuse(f"disposition must be one of {list(DISPOSITIONS)}")
    names = list(dict.fromkeys(advertised_tool_names))
    if names and disposition != "succeeded":
        raise _refuse("a failed or rejected result cannot advertise tools")
    for name in names:
        if not strategy.manifest.is_deferred(name):
            raise _refuse(f"{name!r} is not a bound deferred tool")
    completion: dict[str, Any] = {"disposition": disposition, "output": tool_output_json(output)}
    if names:
        completion["advertised_tool_names"] = list(dict.fromkeys(names))  # first-seen order, as the dispatcher
    return Settlement.succeeded({"tool_result": {"completion": completion}})


def settle_model_result(
    program: Program,
    request: EffectRequest,
    response: JSON,
    effective_messages: Sequence[dict[str, Any]] | None = None,
) -> Settlement:
    """The settlement of an investigated model call: the response and, if they differ, the
    messages actually sent (made durable as the new working context). Only a Program with a
    context policy sends other messages than the request's; without one, effective messages
    must be exactly the request's (then they change nothing)."""
    _check_program(program, request)
    if not isinstance(program.strategy, InteractionStrategy):
        raise _refuse("this program does not call a model")
    body = request.payload.get("model_call") if isinstance(request.payload, dict) else None
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        raise _refuse("the request is not a model call (rebuild it with its program to expand it)")
    if response is None:
        raise _refuse("a model settlement needs a response")
    try:
        parsed = parse_response(response, admitting=True)
    except InvalidInput as exc:
        raise _refuse(f"invalid model response: {exc.message}") from exc
    if parsed["finish_reason"] not in FINISH_REASONS:
        # The model dispatcher leaves a call with another reason unknown; a host states what
        # happened in this vocabulary, so a typo never ends a run.
        raise _refuse(
            f"invalid model response: unknown finish reason {parsed['finish_reason']!r} "
            f"(one of {', '.join(FINISH_REASONS)})"
        )
    problem = response_problem(parsed) or tool_calls_not_completed(parsed)
    if problem is not None:
        # The Interaction would fail the run for good on this response: refuse it now, while
        # the host can still state what the model really answered.
        raise _refuse(f"invalid model response: response: {problem}")
    result: dict[str, Any] = {"response": parsed}
    if effective_messages is None and program.strategy.definition.context_policy is not None:
        # The policy may have changed what was sent; only the host knows the messages the
        # model actually received, and the working context must become exactly those.
        raise _refuse("this program reduces its context: give the effective messages the model received")
    if effective_messages is not None:
        try:
            messages = parse_messages(list(effective_messages), "effective_messages")
        except (InvalidInput, TypeError) as exc:
            raise _refuse(f"invalid effective messages: {getattr(exc, 'message', exc)}") from exc
        if not messages:
            raise _refuse("the effective messages cannot be empty")
        if messages != list(body["request"]["messages"]):
            if program.strategy.definition.context_policy is None:
                # Without a policy the dispatcher sends the working context as it is: the
                # request's messages are exactly what the model received. Other messages
                # would not record what happened but rewrite the conversation the next
                # model call starts from.
                raise _refuse(
                    "effective messages differ from the messages of the request, but this program has no "
                    "context policy: the model received exactly the request's messages; omit the effective "
                    "messages (or give exactly the request's)"
                )
            result["replacement_messages"] = messages
    return Settlement.succeeded({"model_result": result})


def settle_prepared_context(program: Program, request: EffectRequest, messages: Sequence[dict[str, Any]]) -> Settlement:
    """The settlement of an investigated context preparation (never re-running the processor)."""
    _check_program(program, request)
    if not isinstance(program.strategy, InteractionStrategy):
        raise _refuse("this program does not prepare model context")
    if not isinstance(request.payload, dict) or "prepare_context" not in request.payload:
        raise _refuse("the request is not a context preparation")
    try:
        parsed = parse_messages(list(messages), "messages")
    except (InvalidInput, TypeError) as exc:
        raise _refuse(f"invalid prepared messages: {getattr(exc, 'message', exc)}") from exc
    if not parsed:
        raise _refuse("the prepared context cannot be empty")
    return Settlement.succeeded({"prepared_context": {"messages": parsed}})


def check_resolution(program: Program, request: EffectRequest, status: SettlementStatus, payload: JSON) -> None:
    """``Program.check_resolution`` of an Interaction and of its ToolSet's Tool children: a
    host's succeeded outcome must be exactly what these helpers build for it (what a live
    dispatcher returns); otherwise the Interaction would fail the run on it (a model call
    settled with ``{"answer": 1}``: ``interaction.protocol.invalid``). A failed outcome is the
    host's documented way to fail the call (``interaction.host.failed``) and is not checked."""
    if status is not SettlementStatus.SUCCEEDED:
        return
    body = request.payload if isinstance(request.payload, dict) else {}
    got = payload if isinstance(payload, dict) else None
    if "model_call" in body:
        result = got.get("model_result") if got is not None else None
        if got is None or set(got) != {"model_result"} or not isinstance(result, dict) or not result.keys() <= {
            "response", "replacement_messages"
        }:
            raise _refuse('a model call\'s outcome is {"model_result": {"response": {...}}} (with '
                          '"replacement_messages" for a program that reduces its context): build it with '
                          "settle_model_result")
        effective = result.get("replacement_messages")
        model_call = body["model_call"] if isinstance(body["model_call"], dict) else {}
        if effective is None and isinstance(program.strategy, InteractionStrategy) and (
            program.strategy.definition.context_policy is not None
        ):
            # No replacement recorded: the model received exactly the request's messages.
            effective = (model_call.get("request") or {}).get("messages")
        expected = settle_model_result(program, request, result.get("response"), effective)
    elif "prepare_context" in body:
        prepared = got.get("prepared_context") if got is not None else None
        if got is None or set(got) != {"prepared_context"} or not isinstance(prepared, dict) or set(prepared) != {"messages"}:
            raise _refuse('a context preparation\'s outcome is {"prepared_context": {"messages": [...]}}: build it '
                          "with settle_prepared_context")
        messages = prepared["messages"]
        if not isinstance(messages, list):
            raise _refuse("prepared_context.messages is a list of messages")
        expected = settle_prepared_context(program, request, messages)
    elif "tool_call" in body:
        result = got.get("tool_result") if got is not None else None
        if got is None or set(got) != {"tool_result"} or not isinstance(result, dict) or set(result) not in (
            {"completion"}, {"input_request"}
        ):
            raise _refuse('a tool call\'s outcome is {"tool_result": {"completion": {"disposition": ..., "output": '
                          '...}}}: build it with settle_tool_result')
        if "input_request" in result:
            try:
                check_input_request(result["input_request"])
            except ClassifiedError as exc:
                raise _refuse(exc.failure.message) from exc
            return
        completion = result["completion"]
        if not isinstance(completion, dict) or not completion.keys() <= {"disposition", "output", "advertised_tool_names"}:
            raise _refuse("a tool call's completion holds disposition, output and advertised_tool_names only")
        advertised = completion.get("advertised_tool_names") or []
        if not isinstance(advertised, list) or not all(isinstance(name, str) for name in advertised):
            raise _refuse("advertised_tool_names is a list of tool names")
        disposition = completion.get("disposition")
        if not isinstance(disposition, str):
            raise _refuse(f"disposition must be one of {list(DISPOSITIONS)}")
        expected = settle_tool_result(program, request, completion.get("output", {}), disposition, advertised)
    else:
        return
    if expected.payload != payload:
        raise _refuse("the outcome is not in the form the settle helpers build for it (settle_model_result, "
                      "settle_tool_result, settle_prepared_context): build it with them")
