"""What a host's resolution of an unknown Effect means: one rule for the CLI and the HTTP API.

A host describes the outcome it found out: a model call's response (``model_response``,
with ``effective_messages`` when the Program reduces its context), or an ``output`` with a
``disposition`` (tool calls) or a ``status`` (other Effects). The Program's own settle
helpers turn it into the definite :class:`Settlement` the kernel records, so a resolved
call looks exactly like one the dispatcher returned.

The front ends parse their input (JSON text, a request body) and say how they name the
members and how they report a misuse; the rules are here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import NotFound, bounded_text
from agentfold.domain.ids import EffectID
from agentfold.domain.interaction.settle import settle_model_result, settle_prepared_context, settle_tool_result
from agentfold.domain.json_schema import schema_errors
from agentfold.domain.kernel import resolvable
from agentfold.domain.program import ProgramResolver
from agentfold.domain.requests import Settlement, effect_request
from agentfold.domain.tree import TreeState

ABSENT: Any = object()
"""A member the host did not give (``None`` is a JSON value)."""

STATUSES = ("succeeded", "failed")
"""The outcomes a ``status`` may name (an Effect that is neither a tool nor a model call)."""


def settlement_for(
    tree: TreeState,
    programs: ProgramResolver | None,
    effect_id: EffectID,
    *,
    model_response: JSON = ABSENT,
    effective_messages: JSON = ABSENT,
    output: JSON = ABSENT,
    disposition: str | None = None,
    status: str | None = None,
    name: Callable[[str], str] = str,
    usage: Callable[[str], Exception],
    wrong_kind: Callable[[str], Exception],
) -> Settlement:
    """The definite settlement a host's description of ``effect_id``'s outcome stands for.

    ``name`` spells a member as the front end does (``--model-response``, ``model_response``);
    ``usage`` builds the error for members that do not go together, ``wrong_kind`` the one for
    members that do not fit the kind of Effect (a model call vs anything else).
    """
    # First whether it may be resolved at all: a host that lost a race to another host's
    # resolution is told so (engine.effect.not_pending), not that its description does not
    # fit the kind of Effect (the effect is no longer there to tell its kind).
    found = resolvable(tree, effect_id)
    # A status is exactly one of two words: anything else ("fail", "FAILED", 0) is refused
    # rather than read as success.
    if status is not None and (not isinstance(status, str) or status not in STATUSES):
        raise usage(f"{name('status')} is {' or '.join(repr(s) for s in STATUSES)}, not {status!r}")
    program = programs(found[0].program) if programs is not None else None
    request = None
    if program is not None and found[1].target == "dispatcher":
        request = effect_request(tree, found[0].process_id, effect_id, program)
    payload = request.payload if request is not None else None
    is_tool = isinstance(payload, dict) and "tool_call" in payload
    is_model = isinstance(payload, dict) and "model_call" in payload
    is_context = isinstance(payload, dict) and "prepare_context" in payload
    if effective_messages is not ABSENT and model_response is ABSENT:
        raise usage(f"{name('effective_messages')} goes with {name('model_response')} (a model call)")
    if model_response is not ABSENT:
        if output is not ABSENT or disposition is not None or status is not None:
            raise usage(f"{name('model_response')} takes no {name('output')}, {name('disposition')} or {name('status')}")
        if program is None and found[1].target == "dispatcher":
            # Whether it is a model call, and what a model response must hold, only its Program knows.
            raise NotFound(
                "engine.program.unavailable",
                f"effect {effect_id} belongs to a Process of Program {found[0].program.name} "
                f"({found[0].program.digest}), which this process does not bind: a model response is checked "
                "by the Program that made the call",
                hint="resolve it with the deployment's own command or server, which binds the Program "
                "(docs/python.md, operating)",
            )
        if not is_model or program is None or request is None:
            raise wrong_kind(f"effect {effect_id} is not a model call; give {name('output')}")
        response = model_response
        if isinstance(response, dict) and isinstance(response.get("message"), dict):
            # The shape of a scenario's model response: the message role may be left out.
            response = {**response, "message": {"role": "assistant", **response["message"]}}
        if effective_messages is ABSENT:
            return settle_model_result(program, request, response)
        if not isinstance(effective_messages, list):
            raise usage(f"{name('effective_messages')} is a list of the messages the model received")
        # A program with a context policy: the messages the model actually received become
        # the working context (settle_model_result refuses a model response without them).
        # Without a policy the model received the request's messages exactly: others are
        # refused there, not adopted (they would rewrite the conversation).
        return settle_model_result(program, request, response, effective_messages)
    if output is ABSENT:
        raise usage(f"give {name('output')} (or {name('model_response')} for a model call)")
    if is_model:
        raise wrong_kind(f"effect {effect_id} is a model call; give {name('model_response')}")
    if is_context and status == "failed":
        # The run fails with this text (interaction.host.failed): a failure without one (an
        # empty list, as if the messages were given) left only a generic message.
        if disposition is not None:
            raise usage(f"{name('disposition')} applies to tool calls only; use {name('status')}")
        if not isinstance(output, str) or not output.strip():
            raise usage(f"a failed context preparation is resolved with {name('output')}: the failure's text")
        return Settlement.failed(bounded_text(output))
    if is_context and program is not None and request is not None:
        # The messages the context processor produced: a list of messages, {"messages": [...]}
        # or the settlement's own form {"prepared_context": {"messages": [...]}}, written as the
        # helper writes them (settle_prepared_context), as a live dispatcher's.
        if disposition is not None:
            raise usage(f"{name('disposition')} applies to tool calls only; use {name('status')}")
        messages = output
        if isinstance(messages, dict) and set(messages) == {"prepared_context"}:
            messages = messages["prepared_context"]
        if isinstance(messages, dict) and set(messages) == {"messages"}:
            messages = messages["messages"]
        if not isinstance(messages, list):
            raise usage(f"a context preparation is resolved with {name('output')}: the list of messages the "
                        "context processor prepared (or {\"messages\": [...]})")
        return settle_prepared_context(program, request, messages)
    if is_tool and program is not None and request is not None:
        # A tool call's outcome is its disposition; a status would silently be ignored.
        if status is not None:
            raise usage(f"a tool call is resolved with {name('disposition')}, not {name('status')}")
        return settle_tool_result(program, request, output, disposition or "succeeded")
    if disposition is not None:
        raise usage(f"{name('disposition')} applies to tool calls only; use {name('status')}")
    if is_transform(payload if request is not None else found[1].payload):
        # A transform's call: the output is what its function returned; a failure's output is
        # the error text the Process fails with (transform.failed).
        if status == "failed":
            if not isinstance(output, str) or not output.strip():
                raise usage(f"a failed transform call is resolved with {name('output')}: the error's text")
            return Settlement.failed({"error": bounded_text(output)})
        if program is not None:
            # What the Process would complete with: refused now rather than failing the run.
            problems = schema_errors(output, program.descriptor.output_schema)
            if problems:
                raise usage(f"{name('output')} is not what transform {program.descriptor.name} returns "
                            f"(its output schema): {'; '.join(problems[:3])}")
        return Settlement.succeeded({"output": output})
    return Settlement.failed(output) if status == "failed" else Settlement.succeeded(output)


def is_transform(payload: JSON) -> bool:
    """Whether a dispatcher request is a transform's call (``agentfold.adapters.team.transform``)."""
    return isinstance(payload, dict) and set(payload) == {"transform"} and isinstance(payload["transform"], dict)


__all__ = ["ABSENT", "STATUSES", "is_transform", "settlement_for"]
