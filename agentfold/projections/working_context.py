"""An Interaction's working context at one tree cut: what its model saw and will see (pure).

The messages of an Interaction are never stored whole: the fold rebuilds them from the
facts of its Steps and the signals they consumed (``agentfold.domain.interaction.state``). This
view answers the auditor's question "what did the model see before it called this
tool?" for a tree folded up to any position (``agentfold replay``):

* ``messages``: the working context the state holds. During a tool round these are
  exactly the messages the round's model request contained (the round's assistant
  message and its tool results join the context only when the round finishes);
* ``model_request``: when the Process's current batch retains a model call or a context
  preparation (requested, in flight or settled but not yet consumed; ``kind`` says which),
  the request it sends, rebuilt exactly as the dispatcher receives it;
* ``next_model_request``: the messages the next model request would contain, when the
  history up to this cut determines them (``null`` while a tool round still waits for
  results, or once the Interaction completed; with a context processor, ``null`` until the
  model call is requested: the model receives what the processor returns).
"""

from __future__ import annotations

from typing import Any

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import ClassifiedError
from agentfold.domain.interaction.chat import tool_message
from agentfold.domain.interaction.interaction import InteractionStrategy
from agentfold.domain.interaction.state import InteractionState, Phase, round_tool_results
from agentfold.domain.program import Program, ProgramResolver
from agentfold.domain.tree import ProcessState, TreeState


def _model_call(process: ProcessState, program: Program, state: InteractionState) -> dict[str, JSON] | None:
    """The retained model (or context preparation) request of the current batch, expanded."""
    for record in process.batch:
        payload = record.payload
        if record.target != "dispatcher" or not isinstance(payload, dict):
            continue
        for name in ("model_call", "prepare_context"):
            if isinstance(payload.get(name), dict):
                try:
                    expanded: Any = program.expand_request(state, payload)
                except ClassifiedError:
                    expanded = payload  # the context moved on since the request (not expected)
                body = expanded[name]
                request = body.get("request") or {}
                return {
                    "kind": name,
                    "effect_id": record.effect_id,
                    "phase": record.phase,
                    "status": record.status.value if record.status is not None else None,
                    "model_call_sequence": body.get("model_call_sequence"),
                    "messages": request.get("messages", []),
                    "options": request.get("options", {}),
                    "advertised_tool_names": body.get("advertised_tool_names", []),
                    "applied_steer_signal_ids": body.get("applied_steer_signal_ids", []),
                }
    return None


def _prepares_context(program: Program) -> bool:
    """Whether the Interaction runs a context processor before each model call."""
    strategy = program.strategy
    return isinstance(strategy, InteractionStrategy) and strategy.definition.prepare_context


def _next_messages(state: InteractionState, request: dict[str, JSON] | None, prepared: bool) -> list[JSON] | None:
    steer = [m for _, messages in state.pending_steer for m in messages]
    phase = state.phase
    if phase is Phase.AWAITING_MODEL and request is not None:
        return list(request["messages"])  # already requested: these are the messages sent
    if prepared:
        # The model receives what the context processor returns: until its preparation
        # settles and the model call is requested, the history does not determine it.
        return None
    if phase is Phase.READY_MODEL:
        return [*state.messages, *steer]
    if phase is Phase.ROUND_COMPLETE and state.round is not None:
        r = state.round
        return [*state.messages, r.response["message"], tool_message(round_tool_results(r)), *steer]
    return None


def working_context(process: ProcessState, program: Program | None) -> dict[str, JSON] | None:
    """The working context of one Interaction Process, or None if it is not an Interaction."""
    state = process.state
    if not process.has_state or not isinstance(state, InteractionState) or program is None:
        return None
    if state.completed:
        return {"phase": Phase.COMPLETED.value, "messages": None, "model_request": None, "next_model_request": None}
    request = _model_call(process, program, state)
    upcoming = _next_messages(state, request, _prepares_context(program))
    return {
        "phase": state.phase.value,
        "model_call_count": state.model_call_count,
        "messages": list(state.messages),
        "pending_steer": [{"signal_id": sid, "messages": list(messages)} for sid, messages in state.pending_steer],
        "tool_round": state.round.to_json() if state.round is not None else None,
        "model_request": request,
        "next_model_request": {"messages": upcoming} if upcoming is not None else None,
    }


def working_contexts(tree: TreeState, programs: ProgramResolver | None) -> dict[str, JSON]:
    """The working context of every Interaction Process of a folded tree, by process id."""
    out: dict[str, JSON] = {}
    if programs is None:
        return out
    for process in tree.processes.values():
        context = working_context(process, programs(process.program))
        if context is not None:
            out[str(process.process_id)] = context
    return out


__all__ = ["working_context", "working_contexts"]
