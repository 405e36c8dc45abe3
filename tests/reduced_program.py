"""A Program that reduces its context (tests/test_effective_messages.py), importable by a
server process under the same module name, so both build the same ProgramRef (the context
policy's qualified name is part of its configuration digest)."""

from __future__ import annotations

from typing import Any

from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.program import Program


def drop_system(messages: Any) -> list[dict[str, Any]]:
    return [m for m in messages if m["role"] != "system"]


def program() -> Program:
    """The first model call fails (its outcome unknown); a second would answer."""
    model = ScriptedModel([{"error": "HTTP 502 from the provider"}, {"finish_reason": "stop", "message": {
        "role": "assistant", "content": [{"type": "text", "text": "never asked"}]}}])
    return compile_interaction(InteractionConfig(name="test.reduced", model=model, context_policy=drop_system))


def sources() -> ProgramSources:
    return ProgramSources(programs=(program(),))
