"""The seed's three runnable examples (scope-agent-interaction.txt), with their exact printed output.

Go prints booleans as ``true``/``false``; each test builds the same line from our
values and compares it with the seed's ``Output:`` text.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import AdapterConfig, InteractionConfig, adapt, compile_interaction, steer_signal
from agentfold.adapters.models import ModelError, ModelRequest
from agentfold.adapters.runtime import Runtime
from agentfold.domain.budget import Budget
from agentfold.domain.interaction.interaction import STEER_SCHEMA
from agentfold.domain.interaction.refs import ToolCallRef
from agentfold.domain.json_schema import schema_errors


def go_bool(value: bool) -> str:
    return "true" if value else "false"


class GreetModel:
    """The seed's greetModel: reads the JSON request in the last message, greets by name."""

    def call(self, request: ModelRequest) -> dict[str, Any]:
        try:
            req = json.loads(request.messages[-1]["content"][0]["text"])
        except (KeyError, IndexError, ValueError) as exc:
            raise ModelError("greet model received an invalid request") from exc
        if not isinstance(req, dict) or not req.get("name"):
            raise ModelError("greet model received an invalid request")
        message = {"role": "assistant", "content": json.dumps({"message": "hi " + req["name"]})}
        return {"message": message, "finish_reason": "stop"}


def test_seed_adapt_example_greeter_prints_hi_ada(capsys: pytest.CaptureFixture[str]) -> None:
    """Seed ``func Adapt`` example: ``Output: hi ada``.

    The greeter is ``adapt`` around a one-call Interaction (``MaxModelCalls`` 1) with
    typed input ``{"name"}`` and output ``{"message"}``, run on a memory store.
    """
    greet = compile_interaction(
        InteractionConfig(
            name="example.greet", description="Produce a greeting from the request.", model=GreetModel(),
            max_model_calls=1,
        )
    )

    def build_input(req: Any) -> Any:
        return {"messages": [{"role": "user", "content": json.dumps(req)}]}

    def decode_output(output: Any) -> Any:
        return json.loads(output["model_response"]["message"]["content"][0]["text"])

    greeter = adapt(
        AdapterConfig(
            name="example.greeter", description="Greet a caller by name.", interaction=greet,
            build_input=build_input, decode_output=decode_output, budget=Budget.of(16, 16, 16),
            input_schema={"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            output_schema={"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}},
        )
    )
    store = EventStore("memory:")
    with Runtime(store) as engine:
        result = engine.start(greeter, {"name": "ada"}).result(timeout=30)
    store.close()
    assert result.status == "completed", result
    print(result.output["message"])
    assert capsys.readouterr().out == "hi ada\n"


def test_seed_tool_call_ref_example_prints_true_item_7_and_its_parts(capsys: pytest.CaptureFixture[str]) -> None:
    """Seed ``type ToolCallRef`` example: ``Output: true item-7`` / ``process:analysis 2 0``."""
    retained = ToolCallRef.parse("process:analysis/2/0")
    items = {retained: "item-7"}
    encoded = retained.to_json()
    restored = ToolCallRef.parse(encoded)
    print(go_bool(restored == retained), items[restored])
    print(restored.process_id, restored.model_call_sequence, restored.tool_call_index)
    assert capsys.readouterr().out == "true item-7\nprocess:analysis 2 0\n"


def test_seed_steer_signal_example_prints_id_valid_and_unaddressed(capsys: pytest.CaptureFixture[str]) -> None:
    """Seed ``func NewSteerSignal`` example: ``Output: signal:user-correction true false``.

    Valid means an Interaction admits it: its payload satisfies the Interaction's signal
    schema; ``addressesWait`` is whether it names a WaitID.
    """
    request = steer_signal(
        "signal:user-correction", {"role": "user", "content": [{"type": "text", "text": "Use the newer requirements."}]}
    )
    valid = not schema_errors(request.payload, STEER_SCHEMA)
    addresses_wait = request.wait_id is not None
    print(request.id, go_bool(valid), go_bool(addresses_wait))
    assert capsys.readouterr().out == "signal:user-correction true false\n"
