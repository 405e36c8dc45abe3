"""Host views of a folded tree: delegate attributions, pending tool inputs, gate inputs, unknown effects, run summary.

Pure functions of one tree cut (the tree must be folded with its Programs bound, so
Interaction and Tool child states are available).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentfold.domain.canonical import JSON, MAX_TOOL_INPUT_BYTES, normalize
from agentfold.domain.coordination import INPUT_WAIT_KEY
from agentfold.domain.errors import InvalidInput, NotFound
from agentfold.domain.ids import ProcessID, SignalID, WaitID
from agentfold.domain.interaction.chat import ToolCall
from agentfold.domain.interaction.refs import ToolCallRef, tool_call_ref_of_child
from agentfold.domain.interaction.state import InteractionState
from agentfold.domain.interaction.tool_call import ToolCallState
from agentfold.domain.json_schema import schema_errors
from agentfold.domain.program import ProgramResolver, SignalRequest
from agentfold.domain.requests import effect_request
from agentfold.domain.tree import TreeState


@dataclass(frozen=True, slots=True)
class DelegateAttribution:
    process_id: ProcessID
    """The requesting Interaction."""
    model_call_sequence: int
    tool_call_index: int
    call: ToolCall
    child_key: str
    child_process_id: ProcessID

    @property
    def reference(self) -> ToolCallRef:
        return ToolCallRef(self.process_id, self.model_call_sequence, self.tool_call_index)

    def to_json(self) -> dict[str, JSON]:
        return {
            "tool_call_ref": str(self.reference),
            "process_id": self.process_id,
            "model_call_sequence": self.model_call_sequence,
            "tool_call_index": self.tool_call_index,
            "tool_call": self.call.to_json() | {"arguments": self.call.arguments},
            "child_key": self.child_key,
            "child_process_id": self.child_process_id,
        }


def delegate_attributions(tree: TreeState, process_id: ProcessID) -> tuple[list[DelegateAttribution], bool]:
    """The Delegate starts of one Interaction in model call order; found=False if it is not one.

    Read from the Interaction's committed state, so a finished Delegate is still reported.
    """
    process = tree.processes.get(process_id)
    if process is None:
        raise NotFound("engine.process.not_found", f"process {process_id} is not in tree {tree.tree_id}")
    state = process.state
    if not process.has_state or not isinstance(state, InteractionState):
        return [], False
    out = [
        DelegateAttribution(
            process.process_id, int(d["model_call_sequence"]), int(d["tool_call_index"]),
            ToolCall.from_json(d["call"]), str(d["child_key"]), ProcessID(d["process_id"]),
        )
        for d in state.delegations
        if d.get("process_id")
    ]
    out.sort(key=lambda a: (a.model_call_sequence, a.tool_call_index))
    return out, True


@dataclass(frozen=True, slots=True)
class PendingToolInput:
    process_id: ProcessID
    """The Tool child that must receive the answer."""
    wait_id: WaitID
    prompt: JSON
    response_schema: JSON
    reference: ToolCallRef | None
    tree_id: str = ""

    def response_signal(self, signal_id: str, response: JSON) -> SignalRequest:
        """Validate the answer locally (schema, 1 MiB) and address it to this wait."""
        value = normalize(response, limit=MAX_TOOL_INPUT_BYTES, what="tool input answer")  # payload.too_large over 1 MiB
        problems = schema_errors(value, self.response_schema)
        if problems:
            raise InvalidInput(
                "engine.signal.schema",
                "the answer does not satisfy the wait's response schema: " + "; ".join(problems[:3]),
                hint="answer with JSON matching the response_schema of the pending input (`agentfold pending`, GET /pending-inputs)",
            )
        return SignalRequest(SignalID(signal_id), {"input_response": value}, self.wait_id)

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree_id": self.tree_id,
            "process_id": self.process_id,
            "wait_id": self.wait_id,
            "prompt": self.prompt,
            "response_schema": self.response_schema,
            "tool_call_ref": str(self.reference) if self.reference else None,
        }


def pending_tool_inputs(tree: TreeState) -> list[PendingToolInput]:
    """Every current Tool input wait, in the tree's Process order (also while paused), except
    the waits of a Process that is ending (``TreeState.ending``: a cancel, kill or deadline
    recorded on it or an ancestor, which its owner has not carried out yet): such a wait takes
    no answer (``engine.process.finished``)."""
    out = []
    for process in tree.processes.values():
        state = process.state
        if not process.has_state or not isinstance(state, ToolCallState) or process.terminal:
            continue
        if tree.ending(process) is not None:
            continue
        if process.current_wait is None or state.phase != "waiting_input" or state.wait_id != process.current_wait:
            continue
        request = state.input_request or {}
        out.append(
            PendingToolInput(
                process.process_id, process.current_wait, request.get("prompt"), request.get("response_schema"),
                tool_call_ref_of_child(process.parent_id, process.child_key), str(tree.tree_id),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class GateInput:
    """An InputGate (``agentfold.adapters.team.compile_input_gate``) that waits for its answer."""

    process_id: ProcessID
    """The gate Process that must receive the answer."""
    wait_id: WaitID
    request: JSON
    """What the gate asks (its input, the wait's prompt)."""
    answer_schema: JSON
    parent_id: ProcessID | None
    """The Process that started the gate (a collaboration, for a team worker)."""
    task: str | None
    """The gate's child key under its parent (a team task key)."""
    tree_id: str = ""

    def answer_signal(self, signal_id: str, answer: JSON) -> SignalRequest:
        """The answer addressed to this gate's wait (checked against its schema here, and again at admission)."""
        value = normalize(answer, limit=MAX_TOOL_INPUT_BYTES, what="gate answer")  # as a tool's answer: 1 MiB
        problems = schema_errors(value, self.answer_schema)
        if problems:
            raise InvalidInput(
                "engine.signal.schema",
                "the answer does not satisfy the gate's answer schema: " + "; ".join(problems[:3]),
                hint="answer with JSON matching the gate's answer_schema (each gate of the run's gates listing shows it)",
            )
        return SignalRequest(SignalID(signal_id), value, self.wait_id)

    def to_json(self) -> dict[str, JSON]:
        return {"tree_id": self.tree_id, "process_id": self.process_id, "wait_id": self.wait_id,
                "request": self.request, "answer_schema": self.answer_schema, "parent_id": self.parent_id,
                "task": self.task}



def gate_inputs(tree: TreeState) -> list[GateInput]:
    """Every InputGate whose current wait is open, in the tree's Process order (also while paused),
    except those of a Process that is ending (as ``pending_tool_inputs``).

    A gate is recognised by its wait (key ``coordination.input``), so no Program needs to be bound."""
    out = []
    for process in tree.processes.values():
        if process.terminal or process.current_wait is None or tree.ending(process) is not None:
            continue
        wait = process.waits.get(process.current_wait)
        if wait is None or wait.kind != "external" or wait.key != INPUT_WAIT_KEY or wait.closed or wait.answered_by is not None:
            continue
        out.append(GateInput(process.process_id, wait.wait_id, wait.prompt, wait.response_schema, process.parent_id,
                             str(process.child_key) if process.child_key is not None else None, str(tree.tree_id)))
    return out


def unknown_effects(tree: TreeState, programs: ProgramResolver | None = None) -> list[dict[str, Any]]:
    """Every effect whose outcome is unknown, with the request a host needs to investigate it."""
    out = []
    for process in tree.processes.values():
        for record in process.unknown_effects():
            if record.resolved_by is not None:
                continue
            program = programs(process.program) if programs is not None else None
            try:
                request = effect_request(tree, process.process_id, record.effect_id, program).payload
            except Exception:  # noqa: BLE001 - fall back to the stored payload
                request = record.payload
            kind = "other"
            if isinstance(request, dict):
                if "model_call" in request or "prepare_context" in request:
                    kind = "model" if "model_call" in request else "context"
                elif "tool_call" in request:
                    kind = "tool"
            ref = tool_call_ref_of_child(process.parent_id, process.child_key) if kind == "tool" else None
            if kind == "model":
                ref = None
            out.append(
                {
                    "tree_id": tree.tree_id,
                    "process_id": process.process_id,
                    "effect_id": record.effect_id,
                    "kind": kind,
                    "tool_call_ref": str(ref) if ref else None,
                    "step": record.step,
                    "index": record.index,
                    "process_status": process.status,
                    "diagnostic": record.diagnostic.to_json() if record.diagnostic else None,
                    "request": request,
                }
            )
    return out


def run_summary(tree: TreeState) -> dict[str, Any]:
    """Status per Process, root output and failure, usage."""
    root = tree.root
    unknown = bool(tree.unknown_ids)  # none: no Process's batch needs a look (a long run has thousands)
    return {
        "tree_id": tree.tree_id,
        "start_id": tree.start_id,
        "root_process_id": root.process_id,
        "status": root.status,
        "classification": tree.classification(),
        "output": root.output,
        "failure": root.termination.failure.to_json() if root.termination and root.termination.failure else None,
        "processes": [
            {
                "process_id": p.process_id,
                "parent_id": p.parent_id,
                "child_key": p.child_key,
                "program": p.program.name,
                "interaction": p.has_state and isinstance(p.state, InteractionState),
                "status": p.status,
                "usage": p.usage,
                "unknown_effect_ids": [r.effect_id for r in p.unknown_effects() if r.resolved_by is None] if unknown else [],
            }
            for p in tree.processes.values()
        ],
    }
