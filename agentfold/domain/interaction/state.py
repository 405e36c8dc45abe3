"""Interaction state, its derived phase, and the primitive ops that change it.

The state is never stored whole. Each Step records ``facts = {"ops": [...]}``: a list
of primitive ops. ``apply_op`` applies one op, reading bulk content (model responses,
tool results, child outputs, steering messages) from the Signals the Step consumed,
so every message is stored once, in the event that brought it. ``decide`` builds its
ops by applying them to a working copy, and ``evolve`` applies the same ops again:
the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import ClassifiedError, FailureKind, recorded_text
from agentfold.domain.frozen import replace
from agentfold.domain.interaction.chat import (
    ToolCall,
    ToolResult,
    message_calls,
    parse_messages,
    parse_response,
    tool_message,
)
from agentfold.domain.program import Signal


class Phase(StrEnum):
    READY_MODEL = "ready_model"
    AWAITING_CONTEXT = "awaiting_context"
    AWAITING_MODEL = "awaiting_model"
    ADVANCING_TOOLS = "advancing_tools"
    AWAITING_CHILD_STARTS = "awaiting_child_starts"
    AWAITING_CHILD_WAIT_OPEN = "awaiting_child_wait_open"
    WAITING_CHILDREN = "waiting_children"
    ROUND_COMPLETE = "round_complete"
    COMPLETED = "completed"


def state_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, "interaction.state.invalid", message)


def protocol_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, "interaction.protocol.invalid", message)


@dataclass(frozen=True, slots=True)
class Invocation:
    requested: bool = False
    process_id: str | None = None
    result: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.process_id is not None and self.result is None

    @property
    def starting(self) -> bool:
        return self.requested and self.process_id is None and self.result is None

    def to_json(self) -> JSON:
        if not self.requested:
            return None
        body: dict[str, JSON] = {}
        if self.process_id is not None:
            body["process_id"] = self.process_id
        if self.result is not None:
            body["result"] = self.result
        return body

    @classmethod
    def from_json(cls, value: Any) -> Invocation:
        if value is None:
            return cls()
        return cls(True, value.get("process_id"), value.get("result"))


@dataclass(frozen=True, slots=True)
class Batch:
    kind: str  # tool | delegate
    start: int
    invocations: tuple[Invocation, ...]
    wait_key: str | None = None
    wait_id: str | None = None

    def offset_of(self, process_id: str) -> int | None:
        for offset, inv in enumerate(self.invocations):
            if inv.process_id == process_id:
                return offset
        return None

    def to_json(self) -> JSON:
        return {
            "kind": self.kind,
            "start": self.start,
            "invocations": [i.to_json() for i in self.invocations],
            "wait_key": self.wait_key,
            "wait_id": self.wait_id,
        }

    @classmethod
    def from_json(cls, value: Any) -> Batch:
        return cls(
            value["kind"], int(value["start"]), tuple(Invocation.from_json(i) for i in value["invocations"]),
            value.get("wait_key"), value.get("wait_id"),
        )


@dataclass(frozen=True, slots=True)
class Round:
    sequence: int
    response: dict[str, Any]
    calls: tuple[ToolCall, ...]
    results: tuple[dict[str, Any], ...] = ()
    batch: Batch | None = None

    @property
    def finish_reason(self) -> str:
        return str(self.response["finish_reason"])

    @property
    def cursor(self) -> int:
        return len(self.results)

    def to_json(self) -> JSON:
        return {
            "sequence": self.sequence,
            "response": self.response,
            "results": list(self.results),
            "batch": self.batch.to_json() if self.batch else None,
        }

    @classmethod
    def from_json(cls, value: Any) -> Round:
        response = value["response"]
        return cls(
            int(value["sequence"]), response, tuple(message_calls(response["message"])),
            tuple(value.get("results", ())), Batch.from_json(value["batch"]) if value.get("batch") else None,
        )


@dataclass(frozen=True, slots=True)
class InteractionState:
    messages: tuple[dict[str, Any], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    model_call_count: int = 0
    advertised: tuple[str, ...] = ()
    round: Round | None = None
    pending_steer: tuple[tuple[str, tuple[dict[str, Any], ...]], ...] = ()
    artifacts: tuple[dict[str, Any], ...] = ()
    completed: bool = False
    preparing: int = 0
    preparing_steer: tuple[str, ...] = ()
    delegations: tuple[dict[str, Any], ...] = ()
    """Every Delegate start requested by this Interaction, kept for the whole run (attributions)."""

    @property
    def phase(self) -> Phase:
        """Derived from the facts, never stored (spec 2.3)."""
        if self.completed:
            return Phase.COMPLETED
        r = self.round
        if r is None:
            if self.preparing:
                return Phase.AWAITING_CONTEXT
            if self.model_call_count == 0:
                return Phase.READY_MODEL
            return Phase.AWAITING_MODEL
        b = r.batch
        if b is not None:
            if any(i.starting for i in b.invocations):
                return Phase.AWAITING_CHILD_STARTS
            if b.wait_id is not None:
                return Phase.WAITING_CHILDREN
            return Phase.AWAITING_CHILD_WAIT_OPEN
        if r.cursor == len(r.calls):
            return Phase.ROUND_COMPLETE
        return Phase.ADVANCING_TOOLS

    def to_json(self) -> JSON:
        if self.completed:
            return {"completed": True, "delegations": list(self.delegations)}
        return {
            "messages": list(self.messages),
            "options": self.options,
            "model_call_count": self.model_call_count,
            "advertised_tool_names": list(self.advertised),
            "tool_round": self.round.to_json() if self.round else None,
            "pending_steer": [{"signal_id": sid, "messages": list(msgs)} for sid, msgs in self.pending_steer],
            "artifact_records": list(self.artifacts),
            "preparing": self.preparing,
            "preparing_steer": list(self.preparing_steer),
            "delegations": list(self.delegations),
        }

    @classmethod
    def from_json(cls, value: Any) -> InteractionState:
        if value.get("completed"):
            return cls(completed=True, delegations=tuple(value.get("delegations", ())))
        return cls(
            messages=tuple(value["messages"]),
            options=value.get("options") or {},
            model_call_count=int(value["model_call_count"]),
            advertised=tuple(value.get("advertised_tool_names", ())),
            round=Round.from_json(value["tool_round"]) if value.get("tool_round") else None,
            pending_steer=tuple((p["signal_id"], tuple(p["messages"])) for p in value.get("pending_steer", ())),
            artifacts=tuple(value.get("artifact_records", ())),
            preparing=int(value.get("preparing", 0)),
            preparing_steer=tuple(value.get("preparing_steer", ())),
            delegations=tuple(value.get("delegations", ())),
        )


# ---------------------------------------------------------------------------
# Signals the Interaction reads


def is_steer(signal: Signal) -> bool:
    return (
        not signal.engine_owned
        and signal.wait_id is None
        and isinstance(signal.payload, dict)
        and set(signal.payload) == {"steer"}
    )


def steer_messages(signal: Signal) -> tuple[dict[str, Any], ...]:
    body = signal.payload.get("steer") if isinstance(signal.payload, dict) else None
    messages = body.get("messages") if isinstance(body, dict) else None
    try:
        parsed = parse_messages(messages, "steer.messages")
    except Exception as exc:
        raise ClassifiedError(FailureKind.CONTRACT, "interaction.signal.invalid", f"invalid steer: {recorded_text(exc)}") from exc
    if not parsed or any(m["role"] != "user" for m in parsed):
        raise ClassifiedError(
            FailureKind.CONTRACT, "interaction.signal.invalid", "invalid steer: it needs one or more user messages"
        )
    return tuple(parsed)


def is_dispatch_settlement(signal: Signal) -> bool:
    return signal.engine_owned and signal.wait_id is None and signal.status is not None


def is_child_start(signal: Signal) -> bool:
    return (
        signal.engine_owned
        and signal.wait_id is None
        and signal.status is None
        and isinstance(signal.payload, dict)
        and "key" in signal.payload
    )


def is_wait_opened(signal: Signal) -> bool:
    return (
        signal.engine_owned
        and isinstance(signal.payload, dict)
        and signal.payload.get("operation") in ("wait", "wait_children")
    )


def is_child_wait_satisfied(signal: Signal, wait_id: str | None) -> bool:
    return (
        signal.engine_owned
        and signal.wait_id is not None
        and signal.wait_id == wait_id
        and isinstance(signal.payload, dict)
        and signal.payload.get("operation") == "child_wait_satisfied"
    )


def _first(consumed: Sequence[Signal], predicate: Any, what: str) -> Signal:
    for signal in consumed:
        if predicate(signal):
            return signal
    raise state_error(f"the step consumed no {what}")


def model_result(consumed: Sequence[Signal]) -> dict[str, Any]:
    """The ``model_result`` payload of the consumed model settlement."""
    signal = _first(consumed, is_dispatch_settlement, "model settlement")
    payload = signal.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("model_result"), dict):
        raise protocol_error("a model settlement must carry {\"model_result\": {...}}")
    return payload["model_result"]  # type: ignore[no-any-return]


def merge_steer(state: InteractionState, consumed: Sequence[Signal]) -> InteractionState:
    steer = tuple((str(s.id), steer_messages(s)) for s in consumed if is_steer(s))
    if not steer:
        return state
    known = {sid for sid, _ in state.pending_steer}
    fresh = tuple(item for item in steer if item[0] not in known)
    return replace(state, pending_steer=state.pending_steer + fresh)


# ---------------------------------------------------------------------------
# Primitive ops


def _round(state: InteractionState) -> Round:
    if state.round is None:
        raise state_error("no tool round is open")
    return state.round


def _batch(state: InteractionState) -> Batch:
    b = _round(state).batch
    if b is None:
        raise state_error("no child batch is open")
    return b


def _require_calls(r: Round, count: int) -> None:
    """A result or a batch only for calls the round's model response made: a recorded history
    that claims more (a forged or mismatched response) is refused at that Step, not at the
    round's end, and also when the round never ends (a run waiting inside it)."""
    if r.cursor + count > len(r.calls):
        raise state_error(
            f"model call {r.sequence} asked for {len(r.calls)} tool call(s); "
            f"there is no call at index {r.cursor + count - 1}"
        )


def _with_batch(state: InteractionState, batch: Batch | None) -> InteractionState:
    return replace(state, round=replace(_round(state), batch=batch))


def apply_op(
    state: InteractionState, op: dict[str, Any], consumed: Sequence[Signal], delegate_names: frozenset[str]
) -> InteractionState:
    name = op.get("op")
    if name == "replace_context":
        replacement = model_result(consumed).get("replacement_messages")
        return replace(state, messages=tuple(parse_messages(replacement, "replacement_messages")))
    if name == "prepared_context":
        signal = _first(consumed, is_dispatch_settlement, "context settlement")
        body = signal.payload.get("prepared_context") if isinstance(signal.payload, dict) else None
        if not isinstance(body, dict):
            raise protocol_error("a context settlement must carry {\"prepared_context\": {\"messages\": [...]}}")
        return replace(state, messages=tuple(parse_messages(body.get("messages"), "prepared_context.messages")))
    if name == "append_response":
        response = parse_response(model_result(consumed).get("response"))
        return replace(state, messages=(*state.messages, response["message"]))
    if name == "apply_steer":
        ids = list(op.get("ids", []))
        if ids != [sid for sid, _ in state.pending_steer]:
            raise state_error("applied steer ids differ from the pending steer")
        added = tuple(m for _, msgs in state.pending_steer for m in msgs)
        return replace(state, messages=(*state.messages, *added), pending_steer=())
    if name == "prepare":
        return replace(state, preparing=int(op["sequence"]), preparing_steer=tuple(op.get("steer", ())))
    if name == "model_call":
        return replace(state, model_call_count=int(op["sequence"]), preparing=0, preparing_steer=())
    if name == "admit_round":
        response = parse_response(model_result(consumed).get("response"))
        calls = tuple(message_calls(response["message"]))
        return replace(state, round=Round(state.model_call_count, response, calls))
    if name == "reject":
        r = _round(state)
        _require_calls(r, 1)
        result = {"disposition": "rejected", "output": {"content": [{"type": "text", "text": str(op["text"])}]}}
        return replace(state, round=replace(r, results=(*r.results, result)))
    if name == "start_batch":
        size, requested = int(op["size"]), int(op["request"])
        fresh = tuple(Invocation(requested=i < requested) for i in range(size))
        r = _round(state)
        _require_calls(r, size)
        new = _with_batch(state, Batch(str(op["kind"]), r.cursor, fresh))
        if op["kind"] == "delegate":
            from agentfold.domain.interaction.refs import delegate_child_key

            added = tuple(
                {
                    "model_call_sequence": r.sequence,
                    "tool_call_index": r.cursor + offset,
                    "call": r.calls[r.cursor + offset].to_json(),
                    "child_key": delegate_child_key(r.sequence, r.calls[r.cursor + offset].id,
                                                    r.calls[r.cursor + offset].name),
                    "process_id": None,
                }
                for offset in range(size)
            )
            new = replace(new, delegations=new.delegations + added)
        return new
    if name == "request":
        b = _batch(state)
        count = int(op["count"])
        marked: list[Invocation] = list(b.invocations)
        for offset, inv in enumerate(marked):
            if count and not inv.requested:
                marked[offset] = replace(inv, requested=True)
                count -= 1
        return _with_batch(state, replace(b, invocations=tuple(marked)))
    if name == "record_starts":
        b = _batch(state)
        starts = [s for s in consumed if is_child_start(s)]
        rejected = {int(k): v for k, v in (op.get("rejected") or {}).items()}
        started: list[Invocation] = list(b.invocations)
        pending = [offset for offset, inv in enumerate(started) if inv.starting]
        if len(starts) != len(pending):
            raise state_error(f"expected {len(pending)} child start results, got {len(starts)}")
        delegations = list(state.delegations)
        for offset, signal in zip(pending, starts, strict=True):
            pid = signal.payload.get("process_id")
            if pid is not None:
                started[offset] = replace(started[offset], process_id=pid)
                if b.kind == "delegate":
                    key = signal.payload.get("key")
                    for i, entry in enumerate(delegations):
                        if entry["child_key"] == key and entry["process_id"] is None:
                            delegations[i] = {**entry, "process_id": pid}
            else:
                text = rejected.get(offset, "error: child start failed")
                started[offset] = replace(
                    started[offset],
                    result={"disposition": "rejected", "output": {"content": [{"type": "text", "text": text}]}},
                )
        state = replace(state, delegations=tuple(delegations))
        return _with_batch(state, replace(b, invocations=tuple(started)))
    if name == "open_wait":
        return _with_batch(state, replace(_batch(state), wait_key=str(op["key"]), wait_id=None))
    if name == "set_wait":
        signal = _first(consumed, is_wait_opened, "wait opening")
        return _with_batch(state, replace(_batch(state), wait_id=str(signal.payload["wait_id"])))
    if name == "record_outcomes":
        b = _batch(state)
        signal = _first(consumed, lambda s: is_child_wait_satisfied(s, b.wait_id), "child wait satisfaction")
        failed = {int(k): v for k, v in (op.get("failed") or {}).items()}
        settled: list[Invocation] = list(b.invocations)
        for outcome in signal.payload["outcomes"]:
            position = b.offset_of(outcome["process_id"])
            if position is None:
                raise state_error(f"outcome for unknown child {outcome['process_id']}")
            result = outcome["result"]
            if position in failed:
                record = {"disposition": "failed", "output": {"content": [{"type": "text", "text": failed[position]}]}}
            elif b.kind == "tool":
                record = tool_completion(result.get("output"))
            else:
                record = {"disposition": "succeeded", "output": {"details": result.get("output")}}
            settled[position] = replace(settled[position], result=record)
        return _with_batch(state, replace(b, invocations=tuple(settled), wait_key=None, wait_id=None))
    if name == "finish_batch":
        r = _round(state)
        b = _batch(state)
        results = list(r.results)
        advertised = list(state.advertised)
        for inv in b.invocations:
            if inv.result is None:
                raise state_error("a batch finished with a call without a result")
            record = dict(inv.result)
            for n in record.pop("advertised_tool_names", ()) or ():
                if n not in advertised:
                    advertised.append(n)
            results.append(record)
        return replace(state, round=replace(r, results=tuple(results), batch=None), advertised=tuple(advertised))
    if name == "finish_round":
        r = _round(state)
        artifacts = list(state.artifacts)
        for call, outcome_record in zip(r.calls, r.results, strict=True):
            if call.name in delegate_names and outcome_record["disposition"] == "succeeded":
                artifacts.append(
                    {
                        "model_call_sequence": r.sequence,
                        "tool_call_id": call.id,
                        "delegate_name": call.name,
                        "output": outcome_record["output"].get("details"),
                    }
                )
        messages = (*state.messages, r.response["message"], tool_message(round_tool_results(r)))
        return replace(state, messages=messages, round=None, artifacts=tuple(artifacts))
    if name == "user":
        return replace(
            state, messages=(*state.messages, {"role": "user", "content": [{"type": "text", "text": str(op["text"])}]})
        )
    if name == "complete":
        return InteractionState(completed=True, delegations=state.delegations)
    raise state_error(f"unknown interaction op {name!r}")


def tool_completion(value: Any) -> dict[str, Any]:
    """Validate a Tool child's output: ``{disposition, output, advertised_tool_names?}``."""
    if not isinstance(value, dict) or value.get("disposition") not in ("succeeded", "failed", "rejected"):
        raise protocol_error(f"invalid tool completion {str(value)[:200]}")
    output = value.get("output") or {}
    if not isinstance(output, dict) or set(output) - {"content", "details"}:
        raise protocol_error("a tool completion output must be {content?, details?}")
    record: dict[str, Any] = {"disposition": value["disposition"], "output": output}
    advertised = value.get("advertised_tool_names")
    if advertised:
        if value["disposition"] != "succeeded":
            raise protocol_error("only a succeeded tool call may advertise tools")
        record["advertised_tool_names"] = list(advertised)
    return record


def round_tool_results(r: Round) -> list[ToolResult]:
    """Model-visible results of a complete round, in original call order."""
    out = []
    for call, result in zip(r.calls, r.results, strict=True):
        output = result.get("output") or {}
        parts = output.get("content") or []
        out.append(
            ToolResult(
                call.id,
                call.name,
                tuple(str(p.get("text", "")) for p in parts),
                output.get("details"),
                result["disposition"] != "succeeded",
            )
        )
    return out
