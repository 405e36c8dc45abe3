"""The Tool child: one Process per tool call, one Effect per attempt (spec 3.1).

Phases: ``ready`` → declare the ``tool_call`` dispatcher Effect → ``awaiting_result``;
a definite completion completes the Process with it; an input request opens an input
wait (``interaction.tool_input``) whose prompt and response schema are retained by the
wait, so the kernel refuses an answer that does not match the schema and the wait
stays open; an admitted answer resumes the tool with a new Effect (same ToolCallRef,
new EffectID). A failed settlement (host failure before any work) fails the child.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentfold.domain.canonical import JSON, MAX_TOOL_INPUT_BYTES, canonical_bytes
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, recorded_text
from agentfold.domain.frozen import replace
from agentfold.domain.interaction.chat import ToolCall
from agentfold.domain.interaction.state import (
    is_dispatch_settlement,
    is_wait_opened,
    protocol_error,
    state_error,
    tool_completion,
)
from agentfold.domain.interaction.toolset import ToolManifest
from agentfold.domain.json_schema import SCHEMA_MAPS, accepts_nothing, check_schema
from agentfold.domain.program import (
    Complete,
    Continue,
    Descriptor,
    Fail,
    OutputOf,
    Signal,
    Step,
    Wait,
    dispatcher_effect,
    wait_effect,
)

TOOL_INPUT_WAIT_KEY = "interaction.tool_input"

TOOL_INPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["call"],
    "additionalProperties": False,
    "properties": {"call": {"type": "object", "required": ["id", "name"]}},
}
TOOL_OUTPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["disposition", "output"],
    "properties": {
        "disposition": {"enum": ["succeeded", "failed", "rejected"]},
        "output": {"type": "object"},
        "advertised_tool_names": {"type": "array", "items": {"type": "string"}},
    },
    "additionalProperties": False,
}


def input_response_schema(response_schema: JSON) -> JSON:
    """The schema the kernel enforces on an answer signal: ``{"input_response": <response>}``.

    The tool's schema moves under ``properties.input_response``, so its local ``$ref``s are
    rewritten to point there (``#/$defs/a`` -> ``#/properties/input_response/$defs/a``):
    resolved against the wrapper they named nothing, and no answer could ever be admitted."""
    return {
        "type": "object",
        "required": ["input_response"],
        "additionalProperties": False,
        "properties": {"input_response": _moved_refs(response_schema, "#/properties/input_response")},
    }


#: Keywords whose values are data, not schemas: a "$ref" member inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _moved_refs(schema: Any, prefix: str) -> Any:
    if isinstance(schema, list):
        return [_moved_refs(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = prefix + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: _moved_refs(sub, prefix) for name, sub in value.items()}
        else:
            moved[key] = _moved_refs(value, prefix)
    return moved


@dataclass(frozen=True, slots=True)
class ToolCallState:
    call: dict[str, Any]
    phase: str = "ready"  # ready | awaiting_result | awaiting_wait_open | waiting_input | completed
    attempts: int = 0
    input_request: dict[str, Any] | None = None
    wait_id: str | None = None
    answer: Any = None
    answered: bool = False

    def to_json(self) -> JSON:
        return {
            "call": self.call,
            "phase": self.phase,
            "attempts": self.attempts,
            "input_request": self.input_request,
            "wait_id": self.wait_id,
            "answer": self.answer,
            "answered": self.answered,
        }

    @classmethod
    def from_json(cls, value: Any) -> ToolCallState:
        return cls(
            value["call"], value["phase"], int(value.get("attempts", 0)), value.get("input_request"),
            value.get("wait_id"), value.get("answer"), bool(value.get("answered", False)),
        )


def _settlement_payload(signal: Signal) -> dict[str, Any]:
    payload = signal.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("tool_result"), dict):
        raise protocol_error("a tool settlement must carry {\"tool_result\": {...}}")
    body = payload["tool_result"]
    if ("completion" in body) == ("input_request" in body):
        raise protocol_error("a tool result holds exactly one of completion and input_request")
    return body  # type: ignore[no-any-return]


def check_input_request(value: Any) -> dict[str, Any]:
    """``{prompt, response_schema, state}``: all required, each at most 1 MiB as canonical JSON."""
    if not isinstance(value, dict) or set(value) != {"prompt", "response_schema", "state"}:
        raise protocol_error("an input request holds exactly prompt, response_schema and state")
    for name in ("prompt", "state"):
        if len(canonical_bytes(value[name])) > MAX_TOOL_INPUT_BYTES:
            raise protocol_error(f"the input request's {name} exceeds {MAX_TOOL_INPUT_BYTES} bytes")
    try:
        check_schema(value["response_schema"], "#response_schema")
    except Exception as exc:
        raise protocol_error(f"invalid response schema: {recorded_text(exc)}") from exc
    if accepts_nothing(value["response_schema"]):
        # Valid JSON Schema that no answer satisfies: the wait it opens could only be canceled.
        raise protocol_error("invalid response schema: it accepts no answer; use true or {} to accept any")
    return value


class ToolCallStrategy:
    """decide/evolve of a Tool child Process."""

    def __init__(self, manifest: ToolManifest) -> None:
        self.manifest = manifest

    def initial(self, input: JSON) -> ToolCallState:
        if not isinstance(input, dict) or "call" not in input:
            raise ClassifiedError(FailureKind.CONTRACT, "interaction.protocol.invalid", "a tool child needs {call}")
        call = ToolCall.from_json(input["call"])
        return ToolCallState(call.to_json())

    def encode_state(self, state: ToolCallState) -> JSON:
        return state.to_json()

    def decode_state(self, data: JSON) -> ToolCallState:
        return ToolCallState.from_json(data)

    def decide(self, state: ToolCallState, window: Sequence[Signal]) -> Step:
        if state.phase == "ready":
            return Step(0, Continue((self._effect(state),)), {"op": "call"})
        if state.phase == "awaiting_result":
            if not window or not is_dispatch_settlement(window[0]):
                raise state_error("a tool child waits for its tool settlement")
            signal = window[0]
            if signal.status is not None and signal.status.value == "failed":
                message = signal.payload if isinstance(signal.payload, str) and signal.payload else (
                    "the host failed the tool call before any external work"
                )
                return Step(1, Fail(Failure(FailureKind.EXTERNAL, "interaction.host.failed", message)), {"op": "fail"})
            body = _settlement_payload(signal)
            if "completion" in body:
                completion = tool_completion(body["completion"])
                for name in completion.get("advertised_tool_names", ()):
                    if not self.manifest.is_deferred(name):
                        raise ClassifiedError(
                            FailureKind.CONTRACT,
                            "interaction.tool.advertisement_invalid",
                            f"advertised tool {name!r} is not a bound deferred tool",
                        )
                # Stored once: ProcessTerminated refers to the settlement when they are equal.
                stored = OutputOf(signal.effect_id, ("tool_result", "completion")) if signal.effect_id else None
                return Step(1, Complete(completion, stored), {"op": "complete"})
            request = check_input_request(body["input_request"])
            effect = wait_effect(
                TOOL_INPUT_WAIT_KEY,
                prompt=request["prompt"],
                response_schema=input_response_schema(request["response_schema"]),
            )
            return Step(1, Continue((effect,)), {"op": "input_request"})
        if state.phase == "awaiting_wait_open":
            if not window or not is_wait_opened(window[0]):
                raise state_error("a tool child waits for its input wait to open")
            wait_id = window[0].payload["wait_id"]
            return Step(1, Wait(wait_id), {"op": "set_wait"})
        if state.phase == "waiting_input":
            for index, signal in enumerate(window):
                if signal.wait_id == state.wait_id and not signal.engine_owned:
                    payload = signal.payload
                    if not isinstance(payload, dict) or "input_response" not in payload:
                        raise protocol_error("a tool input answer carries {\"input_response\": ...}")
                    resumed = replace(state, phase="awaiting_result", answer=payload["input_response"], answered=True)
                    return Step(index + 1, Continue((self._effect(resumed),)), {"op": "resume"})
            raise state_error("a tool child in waiting_input needs the answer to its wait")
        raise state_error(f"a tool child in phase {state.phase} takes no Step")

    def _effect(self, state: ToolCallState) -> Any:
        return dispatcher_effect({"tool_call": {"attempt": state.attempts + 1, "resume": state.answered}})

    def evolve(self, state: ToolCallState, facts: JSON, consumed: Sequence[Signal]) -> ToolCallState:
        op = (facts or {}).get("op")
        if op == "call":
            return replace(state, phase="awaiting_result", attempts=state.attempts + 1)
        if op == "input_request":
            body = _settlement_payload(consumed[0])
            return replace(state, phase="awaiting_wait_open", input_request=body["input_request"], answered=False,
                           answer=None)
        if op == "set_wait":
            return replace(state, phase="waiting_input", wait_id=consumed[0].payload["wait_id"])
        if op == "resume":
            answer = next(s for s in consumed if s.wait_id == state.wait_id and not s.engine_owned)
            return replace(
                state, phase="awaiting_result", attempts=state.attempts + 1,
                answer=answer.payload["input_response"], answered=True,
            )
        if op in ("complete", "fail"):
            return replace(state, phase="completed")
        raise state_error(f"unknown tool child op {op!r}")

    def expand_request(self, state: ToolCallState, payload: JSON) -> JSON:
        """The full ``tool_call`` payload: the call, and the continuation when resuming."""
        body = payload.get("tool_call") if isinstance(payload, dict) else None
        if not isinstance(body, dict):
            return payload
        full: dict[str, Any] = {"invocation": {"call": state.call}, "attempt": body.get("attempt")}
        if body.get("resume"):
            full["resume"] = {"input_request": state.input_request, "input_response": state.answer}
        return {"tool_call": full}


def tool_program_descriptor(name: str) -> Descriptor:
    return Descriptor(name, "One tool call per Process.", TOOL_INPUT_SCHEMA, TOOL_OUTPUT_SCHEMA, None)
