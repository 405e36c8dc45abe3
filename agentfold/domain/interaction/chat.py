"""Chat values: messages, tool calls, tool results, responses, usage.

Canonical JSON shapes (members with empty values are omitted):

* Message: ``{"role": "system"|"user"|"assistant"|"tool", "content": [{"type": "text", "text": ...}],
  "tool_calls": [ToolCall], "tool_results": [ToolResult]}`` - tool calls only on assistant
  messages, tool results only (and always) on tool messages;
* ToolCall: ``{"id", "name", "arguments"}`` (arguments is JSON text, possibly empty);
* ToolResult: ``{"id", "name", "output": {"content": [parts], "details": any}, "is_error": true}``;
* Response: ``{"message": Message, "finish_reason": str, "usage": {...}}``.

Parsing accepts a plain string for ``content`` (one text part) and normalizes it.
The working context of an Interaction holds canonical message JSON.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentfold.domain.canonical import JSON, normalize
from agentfold.domain.errors import InvalidInput

ROLES = ("system", "user", "assistant", "tool")
#: The portable finish reasons (Scope's ``chat.FinishReason``): a model dispatcher refuses any
#: other (the call's outcome is then unknown), and model adapters map a provider's own reasons
#: onto these. Stored histories are read with any ``[a-z][a-z0-9_]*`` reason.
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "refusal", "other")
_FINISH = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _bad(path: str, message: str) -> InvalidInput:
    return InvalidInput("chat.invalid", f"{path}: {message}", path=path)


def text_part(text: str) -> dict[str, JSON]:
    return {"type": "text", "text": text}


def parse_parts(value: Any, path: str) -> list[dict[str, JSON]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [text_part(value)]
    if not isinstance(value, list):
        raise _bad(path, "content must be a string or a list of parts")
    parts = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            parts.append(text_part(part))
            continue
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{path}[{i}]", 'a part must be {"type": "text", "text": "..."}')
        if set(part) - {"type", "text"}:
            raise _bad(f"{path}[{i}]", f"unexpected part members {sorted(set(part) - {'type', 'text'})}")
        parts.append(text_part(part["text"]))
    return parts


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise _bad("tool_call.id", "must be a non-empty string")
        if not isinstance(self.name, str) or not self.name:
            raise _bad("tool_call.name", "must be a non-empty string")
        if not isinstance(self.arguments, str):
            raise _bad("tool_call.arguments", "must be JSON text")

    def to_json(self) -> dict[str, JSON]:
        body: dict[str, JSON] = {"id": self.id, "name": self.name}
        if self.arguments:
            body["arguments"] = self.arguments
        return body

    @classmethod
    def from_json(cls, value: Any, path: str = "tool_call") -> ToolCall:
        if not isinstance(value, dict):
            raise _bad(path, "must be an object")
        extra = set(value) - {"id", "name", "arguments"}
        if extra:
            raise _bad(path, f"unexpected members {sorted(extra)}")
        arguments = value.get("arguments", "")
        if isinstance(arguments, (dict, list)):
            import orjson

            arguments = orjson.dumps(arguments).decode()
        try:
            return cls(value.get("id", ""), value.get("name", ""), arguments if arguments is not None else "")
        except InvalidInput as exc:
            raise _bad(path, exc.message) from exc


@dataclass(frozen=True, slots=True)
class ToolResult:
    id: str
    name: str
    content: tuple[str, ...] = ()
    details: JSON = None
    is_error: bool = False

    def output_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {}
        if self.content:
            out["content"] = [text_part(t) for t in self.content]
        if self.details is not None:
            out["details"] = self.details
        return out

    def to_json(self) -> dict[str, JSON]:
        body: dict[str, JSON] = {"id": self.id, "name": self.name, "output": self.output_json()}
        if self.is_error:
            body["is_error"] = True
        return body

    @classmethod
    def from_json(cls, value: Any, path: str = "tool_result") -> ToolResult:
        if not isinstance(value, dict) or not isinstance(value.get("id"), str) or not isinstance(value.get("name"), str):
            raise _bad(path, "a tool result needs string id and name")
        output = value.get("output") or {}
        if not isinstance(output, dict) or set(output) - {"content", "details"}:
            raise _bad(f"{path}.output", "must be {content?, details?}")
        parts = parse_parts(output.get("content"), f"{path}.output.content")
        return cls(
            value["id"], value["name"], tuple(str(p["text"]) for p in parts), output.get("details"),
            bool(value.get("is_error", False)),
        )


def parse_message(value: Any, path: str = "message") -> dict[str, JSON]:
    """Validate one message and return its canonical JSON."""
    if not isinstance(value, dict):
        raise _bad(path, "a message must be an object")
    extra = set(value) - {"role", "content", "tool_calls", "tool_results"}
    if extra:
        raise _bad(path, f"unexpected members {sorted(extra)}")
    role = value.get("role")
    if role not in ROLES:
        raise _bad(f"{path}.role", f"must be one of {list(ROLES)}, got {role!r}")
    body: dict[str, JSON] = {"role": role}
    parts = parse_parts(value.get("content"), f"{path}.content")
    if parts:
        body["content"] = parts
    calls = value.get("tool_calls") or []
    if calls:
        if role != "assistant":
            raise _bad(f"{path}.tool_calls", "only assistant messages carry tool calls")
        if not isinstance(calls, list):
            raise _bad(f"{path}.tool_calls", "must be a list")
        body["tool_calls"] = [ToolCall.from_json(c, f"{path}.tool_calls[{i}]").to_json() for i, c in enumerate(calls)]
    results = value.get("tool_results") or []
    if role == "tool":
        if not isinstance(results, list) or not results:
            raise _bad(f"{path}.tool_results", "a tool message carries at least one tool result")
        body["tool_results"] = [
            ToolResult.from_json(r, f"{path}.tool_results[{i}]").to_json() for i, r in enumerate(results)
        ]
    elif results:
        raise _bad(f"{path}.tool_results", "only tool messages carry tool results")
    if role in ("system", "user") and not parts:
        raise _bad(f"{path}.content", f"a {role} message needs text")
    return normalize(body, what="message")  # type: ignore[no-any-return]


def parse_messages(value: Any, path: str = "messages") -> list[dict[str, JSON]]:
    if not isinstance(value, list):
        raise _bad(path, "must be a list of messages")
    return [parse_message(m, f"{path}[{i}]") for i, m in enumerate(value)]


def message_text(message: dict[str, Any]) -> str:
    return "".join(str(p.get("text", "")) for p in message.get("content", []))


def user_message(text: str) -> dict[str, JSON]:
    return {"role": "user", "content": [text_part(text)]}


def assistant_message(text: str = "", calls: Sequence[ToolCall] = ()) -> dict[str, JSON]:
    body: dict[str, JSON] = {"role": "assistant"}
    if text:
        body["content"] = [text_part(text)]
    if calls:
        body["tool_calls"] = [c.to_json() for c in calls]
    return body


def tool_message(results: Sequence[ToolResult]) -> dict[str, JSON]:
    return {"role": "tool", "tool_results": [r.to_json() for r in results]}


def message_calls(message: dict[str, Any]) -> list[ToolCall]:
    return [ToolCall.from_json(c) for c in message.get("tool_calls", [])]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


def parse_response(
    value: Any, path: str = "response", *, unique_call_ids: bool = True, admitting: bool = False
) -> dict[str, JSON]:
    """Validate a model response and return its canonical JSON.

    Raises ``chat.invalid`` for a structurally invalid response: a missing or
    non-assistant message, an invalid finish reason, duplicate tool call ids (unless
    ``unique_call_ids`` is off: the model dispatcher records such a response, and the
    Interaction refuses it, as Scope's does). ``admitting``: the response is new (a model's
    answer, a host's resolution), not read back from a history: usage counts that are
    booleans are refused too (a history an earlier release recorded with them still folds).
    """
    if not isinstance(value, dict):
        raise _bad(path, "a response must be an object")
    extra = set(value) - {"message", "finish_reason", "usage"}
    if extra:
        raise _bad(path, f"unexpected members {sorted(extra)}")
    message = parse_message(value.get("message"), f"{path}.message")
    if message["role"] != "assistant":
        raise _bad(f"{path}.message.role", "a response message must come from the assistant")
    reason = value.get("finish_reason")
    if not isinstance(reason, str) or not _FINISH.fullmatch(reason):
        raise _bad(f"{path}.finish_reason", f"invalid finish reason {reason!r}")
    ids = [c["id"] for c in message.get("tool_calls", [])]
    if unique_call_ids and len(set(ids)) != len(ids):
        raise _bad(f"{path}.message.tool_calls", "tool call ids must be unique within a response")
    body: dict[str, JSON] = {"message": message, "finish_reason": reason}
    usage = value.get("usage")
    if usage is not None:
        if not isinstance(usage, dict) or any(
            not isinstance(usage.get(k, 0), int) or usage.get(k, 0) < 0
            or (admitting and isinstance(usage.get(k, 0), bool))
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        ) or set(usage) - {"prompt_tokens", "completion_tokens", "total_tokens"}:
            raise _bad(f"{path}.usage", "usage holds non-negative prompt_tokens, completion_tokens, total_tokens")
        body["usage"] = Usage(
            usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), usage.get("total_tokens", 0)
        ).to_json()
    return body


@dataclass(frozen=True, slots=True)
class ChatInput:
    """An Interaction's input: messages and options (never executable tool definitions)."""

    messages: tuple[dict[str, JSON], ...]
    options: dict[str, JSON] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSON]:
        body: dict[str, JSON] = {"messages": list(self.messages)}
        if self.options:
            body["options"] = self.options
        return body

    @classmethod
    def parse(cls, value: Any, path: str = "input") -> ChatInput:
        if not isinstance(value, dict):
            raise _bad(path, "input must be an object with messages")
        extra = set(value) - {"messages", "options"}
        if extra:
            raise _bad(path, f"unexpected members {sorted(extra)}")
        messages = parse_messages(value.get("messages"), f"{path}.messages")
        if not messages:
            raise _bad(f"{path}.messages", "at least one message is needed")
        options = value.get("options") or {}
        if not isinstance(options, dict):
            raise _bad(f"{path}.options", "must be an object")
        if "tools" in options or "tool_choice" in options:
            raise _bad(f"{path}.options", "tools and tool_choice come from the program, not the input")
        return cls(tuple(messages), normalize(options))


INPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["messages"],
    "properties": {"messages": {"type": "array", "minItems": 1}, "options": {"type": "object"}},
    "additionalProperties": False,
}

OUTPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["model_calls"],
    "properties": {
        "model_response": {"type": "object"},
        "direct_tool_results": {"type": "array", "minItems": 1},
        "model_calls": {"type": "integer", "minimum": 1},
    },
    "additionalProperties": False,
}
