"""compile_interaction refuses what could only fail later as an unknown Effect.

A tool without a callable ``call``, no model (or one without ``call``), a limit of the
wrong type, a tool without a description, or an ``async`` model, tool or callback: each
used to compile, then leave the run with an unknown Effect a human had to resolve
although no call ever happened (or raise an unclassified TypeError). Each is now a
classified refusal at compile time, before any run exists.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import Delegate, InteractionConfig, compile_interaction
from agentfold.adapters.models import ModelRequest, ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolFailure, ToolInvocation, ToolOutput
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import Digest
from agentfold.domain.program import Complete, Descriptor, Program, Step
from tests.interaction.support import unknown_of
from tests.kernel_programs import JsonStrategy


class GoodTool:
    name = "lookup"
    description = "Looks a thing up."
    parameters: JSON = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        return ToolOutput.text("found")


class NoCallTool:
    name = "nocall"
    description = "Has no call method."
    parameters: JSON = {"type": "object"}


class CallIsDataTool(NoCallTool):
    call = "not a method"


class NoDescriptionTool:
    name = "nodesc"
    parameters: JSON = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        return ToolOutput.text("x")


class EmptyDescriptionTool(NoDescriptionTool):
    description = ""


class AsyncTool(GoodTool):
    name = "asynctool"

    async def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:  # type: ignore[override]
        return ToolOutput.text("never runs")


class _AsyncCallable:
    async def __call__(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        return ToolOutput.text("never runs")


class AsyncCallableTool(GoodTool):
    name = "asyncobj"
    call = _AsyncCallable()  # type: ignore[assignment]


class AsyncAdvertiseTool(GoodTool):
    name = "asyncadv"

    async def advertise(self, invocation: ToolInvocation, output: ToolOutput) -> list[str]:
        return []


class AsyncModel:
    async def call(self, request: ModelRequest) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": "never"}, "finish_reason": "stop"}


class ModelWithoutCall:
    pass


class AsyncProcessor:
    async def prepare_context(self, request: ModelRequest) -> list[dict[str, Any]]:
        return []


class AsyncModelObserver:
    async def on_model_started(self, request: ModelRequest) -> None:
        return None

    def on_model_settled(self, request: ModelRequest, outcome: str, response: dict[str, Any] | None) -> None:
        return None


def model() -> ScriptedModel:
    return ScriptedModel([{"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}])


def refusal(**fields: Any) -> InvalidInput:
    config: dict[str, Any] = {"name": "refusals.agent", "model": model(), "tools": [GoodTool()]} | fields
    with pytest.raises(InvalidInput) as caught:
        compile_interaction(InteractionConfig(**config))
    return caught.value


def test_a_well_formed_config_compiles_and_runs() -> None:
    """The control: the checks below refuse only the broken configurations."""
    program = compile_interaction(InteractionConfig(name="refusals.ok", model=model(), tools=[GoodTool()],
                                                    max_model_calls=3, max_concurrent_tool_calls=2))
    store = EventStore("memory:")
    with Runtime(store) as runtime:
        result = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]}).result(timeout=30)
    store.close()
    assert result.status == "completed"


@pytest.mark.parametrize("tool", [NoCallTool(), CallIsDataTool()], ids=["missing", "not-callable"])
def test_a_tool_without_a_callable_call_is_refused_at_compile_time(tool: Any) -> None:
    """It used to compile, and its first call was an unknown Effect ("AttributeError: ... no attribute 'call'")."""
    error = refusal(tools=[tool])
    assert error.code == "interaction.toolset.invalid"
    assert "tool 'nocall' has no call(invocation, arguments) method" in error.message
    assert "call(invocation, arguments)" in error.hint


def test_a_deferred_tool_without_call_is_refused_too() -> None:
    error = refusal(deferred_tools=[NoCallTool()])
    assert error.code == "interaction.toolset.invalid"
    assert "'nocall'" in error.message


def test_a_tool_without_a_description_is_refused() -> None:
    """Docs list ``description`` as required (what the model reads); a missing one is refused,
    an explicitly empty one is accepted."""
    error = refusal(tools=[NoDescriptionTool()])
    assert error.code == "interaction.toolset.invalid"
    assert error.message == "tool 'nodesc' has no description"
    assert "description attribute" in error.hint
    compile_interaction(InteractionConfig(name="refusals.emptydesc", model=model(), tools=[EmptyDescriptionTool()]))


@pytest.mark.parametrize("bad_model", [None, ModelWithoutCall()], ids=["none", "no-call"])
def test_no_model_or_a_model_without_call_is_refused(bad_model: Any) -> None:
    """It used to compile, and the first model call was an unknown Effect (AttributeError)."""
    error = refusal(model=bad_model)
    assert error.code == "interaction.definition.invalid"
    assert "InteractionConfig.model" in error.message
    assert "OpenAIChatModel" in error.hint


@pytest.mark.parametrize(
    ("field", "value", "type_name"),
    [
        ("max_model_calls", "5", "str"),
        ("max_model_calls", 5.0, "float"),
        ("max_model_calls", True, "bool"),
        ("max_concurrent_tool_calls", "2", "str"),
        ("max_concurrent_tool_calls", 1.5, "float"),
        ("max_concurrent_tool_calls", None, "NoneType"),
    ],
)
def test_a_limit_of_the_wrong_type_is_a_classified_refusal_naming_field_value_and_type(
    field: str, value: Any, type_name: str
) -> None:
    """``max_model_calls="5"`` used to raise an unclassified TypeError ('<=' not supported ...)."""
    error = refusal(**{field: value})
    assert error.code == "interaction.definition.invalid"
    assert f"InteractionConfig.{field} is {value!r} (of type {type_name}); it must be an int" in error.message
    assert f"{field}=" in error.hint


@pytest.mark.parametrize("description", [5, None, "agent \udc80"])
def test_a_description_that_is_not_text_is_refused(description: Any) -> None:
    # Accepted before (and digested as a number); a lone surrogate raised a bare TypeError.
    error = refusal(description=description)
    assert error.code == "interaction.definition.invalid"
    assert "InteractionConfig.description is" in error.message, error.message


@pytest.mark.parametrize(("field", "value"), [("max_model_calls", 0), ("max_model_calls", 2**64),
                                              ("max_concurrent_tool_calls", -1)])
def test_a_limit_out_of_range_keeps_its_code(field: str, value: int) -> None:
    error = refusal(**{field: value})
    assert error.code == "interaction.definition.invalid"
    assert f"InteractionConfig.{field} is {value}" in error.message


@pytest.mark.parametrize(
    ("fields", "code", "named"),
    [
        ({"tools": [AsyncTool()]}, "interaction.toolset.invalid", "tool 'asynctool': its call method"),
        ({"tools": [AsyncCallableTool()]}, "interaction.toolset.invalid", "tool 'asyncobj': its call method"),
        ({"tools": [AsyncAdvertiseTool()]}, "interaction.toolset.invalid", "tool 'asyncadv': its advertise function"),
        ({"model": AsyncModel()}, "interaction.definition.invalid", "InteractionConfig.model.call (AsyncModel.call)"),
        ({"context_processor": AsyncProcessor()}, "interaction.definition.invalid",
         "InteractionConfig.context_processor.prepare_context"),
        ({"model_observer": AsyncModelObserver()}, "interaction.definition.invalid",
         "InteractionConfig.model_observer.on_model_started"),
    ],
    ids=["tool", "tool-callable-object", "tool-advertise", "model", "context-processor", "model-observer"],
)
def test_async_collaborators_are_refused_at_compile_time(fields: dict[str, Any], code: str, named: str) -> None:
    """An ``async def`` tool or model used to compile; nothing awaited it, so each call printed
    "coroutine ... was never awaited" and was recorded unknown although nothing ran."""
    error = refusal(**fields)
    assert error.code == code
    assert error.message == f"{named} is an async function"
    assert "synchronous" in error.hint and "asyncio.run" in error.hint


def test_async_callbacks_and_delegate_input_builders_are_refused() -> None:
    async def validator(candidate: Any) -> Any:
        return None

    async def build(arguments: JSON) -> JSON:
        return arguments

    error = refusal(completion_validator=validator)
    assert (error.code, error.message) == ("interaction.definition.invalid",
                                           "InteractionConfig.completion_validator is an async function")

    class Echo(JsonStrategy):
        def initial(self, input: JSON) -> JSON:
            return input

        def decide(self, state: Any, window: Any) -> Step:
            return Step(0, Complete(state))

    child = Program(Descriptor("refusals.child", "", {"type": "object"}), Echo(),
                    Digest.of(b"i"), Digest.of(b"c"))
    error = refusal(delegates=[Delegate("helper", "Helps.", child, build_input=build)])
    assert (error.code, error.message) == ("interaction.delegate.invalid",
                                           "delegate 'helper': build_input is an async function")


@pytest.mark.parametrize("content", ["hello", ("a", {"weird": True}, None), 5, b"raw"])
def test_a_tool_output_whose_content_is_not_texts_is_refused_when_made(content: Any) -> None:
    """Found by a docs walkthrough: ``ToolOutput(content="hello")`` was sent to the model as
    five one-letter text parts (a succeeded result), other values as their repr."""
    with pytest.raises(InvalidInput) as refused:
        ToolOutput(content)
    assert refused.value.code == "tool.output_invalid"
    assert ToolOutput(["a", "b"]).content == ("a", "b")  # a list is taken as the tuple it means
    assert ToolOutput.text("hello").to_json() == {"content": [{"type": "text", "text": "hello"}]}


@pytest.mark.parametrize("field", ["tools", "deferred_tools", "delegates"])
@pytest.mark.parametrize("value", [GoodTool(), "lookup", None, {"lookup": GoodTool()}, iter([GoodTool()])],
                         ids=["one-tool", "str", "none", "dict", "generator"])
def test_tools_and_delegates_that_are_no_list_are_refused(field: str, value: Any) -> None:
    """Found by a docs walkthrough: ``tools=my_tool`` (one tool, not in a list) raised a bare
    ``TypeError: 'GoodTool' object is not iterable``; a string was iterated letter by letter."""
    fields: dict[str, Any] = {field: value}
    if field != "tools":
        fields["tools"] = [GoodTool()]
    error = refusal(**fields)
    assert error.code == "interaction.definition.invalid"
    assert error.message.startswith(f"InteractionConfig.{field} is ")
    assert "not a list of" in error.message
    assert error.hint == f"pass a list, also for one: {field}=[...]"


@pytest.mark.parametrize(("kind", "output", "said"), [
    ("maybe", "no", "kind is 'failed' (it ran and failed) or 'rejected' (it refused), not 'maybe'"),
    (None, "no", "not None"),
    ("failed", 42, "output is a text or a ToolOutput, not 42"),
])
def test_a_tool_failure_of_no_known_kind_is_refused_and_its_call_is_unknown_saying_so(
    kind: Any, output: Any, said: str
) -> None:
    """``ToolFailure("maybe", ...)`` raised a bare ValueError, and ``ToolFailure("failed", 42)`` an
    AttributeError from inside its own constructor: now ``tool.failure_invalid`` (still a
    ValueError). Raised inside a tool, the call's outcome is unknown (never guessed as failed or
    rejected), and the unknown Effect says why."""
    with pytest.raises(ValueError) as refused:
        ToolFailure(kind, output)
    assert isinstance(refused.value, InvalidInput)
    assert refused.value.code == "tool.failure_invalid" and said in refused.value.message
    assert ToolFailure("rejected", "no").output == ToolOutput.text("no")

    class Refuser(GoodTool):
        def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
            raise ToolFailure(kind, output)

    calls = ScriptedModel([{"finish_reason": "tool_calls", "message": {"role": "assistant", "tool_calls": [
        {"id": "c1", "name": "lookup", "arguments": "{}"}]}}])
    program = compile_interaction(InteractionConfig(name="refusals.failure", model=calls, tools=[Refuser()]))
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]})
            tree = runtime.wait_idle(handle.tree_id, timeout=30)
            [unknown] = unknown_of(runtime, tree)
    finally:
        store.close()
    assert tree.root.status == "waiting"  # for its tool call, whose outcome a host must settle: nothing guessed
    assert unknown["kind"] == "tool" and unknown["diagnostic"]["code"] == "engine.dispatch.failed"
    assert said in unknown["diagnostic"]["message"], unknown["diagnostic"]


def test_a_delegate_whose_interaction_grants_its_tool_calls_more_than_its_budget_holds_is_refused() -> None:
    """Found by an app-builder review: a Delegate with a finite budget over an Interaction with tools
    and the default (unlimited) tool_budget compiled, then every delegated call failed at run time
    (engine.child.budget_exhausted: "the parent's steps quota is finite, so the child's must be
    finite too"), while the scenario compiler refuses the same configuration."""
    from agentfold.domain.budget import Budget

    def worker(**fields: Any) -> Program:
        return compile_interaction(InteractionConfig(name="refusals.worker", model=model(), tools=[GoodTool()], **fields))

    def boss(program: Program, budget: Budget) -> InteractionConfig:
        return InteractionConfig(name="refusals.boss", model=model(), delegates=[
            Delegate("helper", "Helps.", program, {"type": "object"}, budget=budget)])

    finite = Budget.of(steps=50, effects=20)
    for child, words in (
        (worker(), "the parent's steps quota is finite, so the child's must be finite too"),
        (worker(tool_budget=Budget.of(steps=60, effects=10)), "the child's steps quota 60 exceeds the parent's maximum 50"),
    ):
        with pytest.raises(InvalidInput) as caught:
            compile_interaction(boss(child, finite))
        error = caught.value
        assert error.code == "interaction.delegate.invalid", error
        assert "delegate 'helper'" in error.message and "tool_budget" in error.message and words in error.message
        assert "finite tool_budget" in error.hint
    # What fits is accepted: a finite tool_budget within the Delegate's, or an unlimited Delegate budget.
    compile_interaction(boss(worker(tool_budget=Budget.of(steps=10, effects=5)), finite))
    compile_interaction(boss(worker(), Budget()))
