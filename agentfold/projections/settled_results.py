"""SettledResults: the definite tool results of each open Interaction round (spec 6.1).

A pure function of one folded tree cut. Rounds come child-before-parent (reverse
creation order), entries in original call index order; the projection is sparse:
unknown outcomes, input waits, calls never started and Delegates whose subtree is not
fully terminal and resolved produce no entry. ``json()`` has the exact member order
of the seed (``process_id, root_id, parent_id?, child_key?, model_call_sequence,
call_count, entries``; empty members omitted) and ``digest()`` is ``sha256:`` over
those bytes. It reads recovery facts; it authorizes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.ids import ChildKey, Digest, ProcessID, child_process_id
from agentfold.domain.interaction.chat import ToolCall
from agentfold.domain.interaction.refs import ToolCallRef, delegate_child_key, tool_child_key
from agentfold.domain.interaction.state import InteractionState, Round
from agentfold.domain.tree import ProcessState, TreeState


@dataclass(frozen=True, slots=True)
class ResultEntry:
    tool_call_index: int
    call: ToolCall
    output: dict[str, Any]
    disposition: str

    def json_value(self) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.call.id, "name": self.call.name}
        if self.call.arguments:
            call["arguments"] = self.call.arguments
        output: dict[str, Any] = {}
        if self.output.get("content"):
            output["content"] = [{"type": "text", "text": p.get("text", "")} for p in self.output["content"]]
        if self.output.get("details") is not None:
            output["details"] = orjson.loads(canonical_bytes(self.output["details"]))
        result: dict[str, Any] = {"id": self.call.id, "name": self.call.name, "output": output}
        if self.disposition != "succeeded":
            result["is_error"] = True
        return {"tool_call_index": self.tool_call_index, "call": call, "result": result, "disposition": self.disposition}


@dataclass(frozen=True, slots=True)
class RoundResults:
    process_id: ProcessID
    root_id: ProcessID
    parent_id: ProcessID | None
    child_key: str | None
    model_call_sequence: int
    call_count: int
    entries: tuple[ResultEntry, ...]

    @property
    def complete(self) -> bool:
        return self.call_count > 0 and len(self.entries) == self.call_count

    def reference(self, tool_call_index: int) -> ToolCallRef | None:
        """The reference of any call of the admitted round, even one without an entry."""
        if 0 <= tool_call_index < self.call_count:
            return ToolCallRef(self.process_id, self.model_call_sequence, tool_call_index)
        return None

    def json_value(self) -> dict[str, Any]:
        body: dict[str, Any] = {"process_id": self.process_id, "root_id": self.root_id}
        if self.parent_id is not None:
            body["parent_id"] = self.parent_id
        if self.child_key is not None:
            body["child_key"] = self.child_key
        body["model_call_sequence"] = self.model_call_sequence
        body["call_count"] = self.call_count
        body["entries"] = [e.json_value() for e in self.entries]
        return body

    def json(self) -> bytes:
        """Deterministic bytes in the seed's member order (not key-sorted)."""
        return orjson.dumps(self.json_value())

    def digest(self) -> Digest:
        return Digest.of(self.json())


def _child(tree: TreeState, parent: ProcessState, key: str) -> ProcessState | None:
    pid = parent.child_keys.get(ChildKey(key))
    return tree.processes.get(pid) if pid is not None else None


def _tool_result(child: ProcessState) -> dict[str, Any] | None:
    if child.status == "completed" and isinstance(child.output, dict):
        return child.output
    for record in child.batch:
        if record.target == "dispatcher" and record.definite and record.status is not None and record.status.value == "succeeded":
            completion = (record.result or {}).get("tool_result", {}).get("completion")
            if completion is not None:
                return completion  # type: ignore[no-any-return]
    for signal in child.pending():
        if signal.status is not None and signal.status.value == "succeeded" and isinstance(signal.payload, dict):
            completion = signal.payload.get("tool_result", {}).get("completion")
            if completion is not None:
                return completion  # type: ignore[no-any-return]
    return None


def _subtree_settled(tree: TreeState, pid: ProcessID) -> bool:
    return all(p.terminal and not p.unknown_effects() for p in tree.subtree(pid))


def _delegate_result(child: ProcessState) -> dict[str, Any]:
    if child.status == "completed":
        return {"disposition": "succeeded", "output": {"details": child.output}}
    term = child.termination
    text = f"error: delegated worker child ended with {child.status} ({term.cause if term else ''})"
    if term is not None and term.reason:
        text += f": {term.reason}"
    return {"disposition": "failed", "output": {"content": [{"type": "text", "text": text}]}}


def _start_refusals(parent: ProcessState) -> dict[str, dict[str, Any]]:
    refusals: dict[str, dict[str, Any]] = {}
    for record in parent.batch:
        if record.operation == "start_child" and record.definite and record.status is not None and record.status.value == "failed":
            refusals[str(record.payload.get("key"))] = record.result or {}
    for signal in parent.pending():
        payload = signal.payload
        if signal.source == "engine" and isinstance(payload, dict) and "key" in payload and payload.get("failure"):
            refusals[str(payload["key"])] = payload
    return refusals


def _round_entries(tree: TreeState, process: ProcessState, r: Round) -> list[ResultEntry]:
    entries: list[ResultEntry] = []
    refusals = _start_refusals(process)
    batch = r.batch
    for index, call in enumerate(r.calls):
        result: dict[str, Any] | None = None
        if index < len(r.results):
            result = r.results[index]
        elif batch is not None and batch.start <= index < batch.start + len(batch.invocations):
            result = batch.invocations[index - batch.start].result
        if result is None:
            tool_child = _child(tree, process, tool_child_key(r.sequence, index))
            if tool_child is not None:
                result = _tool_result(tool_child)
            else:
                key = delegate_child_key(r.sequence, call.id, call.name)
                delegate = _child(tree, process, key)
                if delegate is None:
                    refusal = refusals.get(key)
                    if refusal and refusal.get("failure"):
                        f = refusal["failure"]
                        text = f"error: delegated worker child start failed: {f['code']}: {f['message']}"
                        result = {"disposition": "rejected", "output": {"content": [{"type": "text", "text": text}]}}
                elif _subtree_settled(tree, delegate.process_id):
                    result = _delegate_result(delegate)
        if result is not None:
            entries.append(ResultEntry(index, call, result.get("output") or {}, str(result["disposition"])))
    return entries


def settled_results(tree: TreeState) -> list[RoundResults]:
    """Every open round's definite results, child-before-parent, then by call index."""
    rounds: list[RoundResults] = []
    for process in reversed(list(tree.processes.values())):
        state = process.state
        if not process.has_state or not isinstance(state, InteractionState) or state.completed or state.round is None:
            continue
        r = state.round
        if state.model_call_count <= 0 or not r.calls:
            continue
        entries = _round_entries(tree, process, r)
        if not entries:
            continue
        rounds.append(
            RoundResults(
                process.process_id, process.root_id, process.parent_id, process.child_key,
                r.sequence, len(r.calls), tuple(entries),
            )
        )
    return rounds


__all__ = ["ResultEntry", "RoundResults", "child_process_id", "settled_results"]
