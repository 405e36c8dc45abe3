"""FirstSuccess and Tool-child behaviour the mutation audit "compete" (2026-12-05) found undefended.

Each test failed with a planted bug in agentfold/domain/competition.py or
agentfold/domain/interaction/tool_call.py that the rest of the suite let through (the audit's
report lists them). Real Runtimes on real SQLite files in
``tmp_path``, InputGates as race candidates; what is asserted is what a host observes: the
race's result (winner, candidates, failure) and the status of each candidate child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import FirstSuccessConfig, InputGateConfig, compile_first_success, compile_input_gate
from agentfold.adapters.tools import ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.canonical import MAX_TOOL_INPUT_BYTES
from tests.interaction.support import child_by_key, open_runtime
from tests.interaction.tools import WAIT, wait_until
from tests.team.test_first_success import answer

TEXT = {"type": "string"}
REQUESTS = [{"key": "a", "program": "compete.gate.a", "input": "qa"},
            {"key": "b", "program": "compete.gate.b", "input": "qb"}]


def only_candidate_b(key: str, outcome: dict[str, Any]) -> bool:
    return key == "b"


def payload_as_verdict(key: str, outcome: dict[str, Any]) -> Any:
    """A plausible user slip: returns the answer text (truthy), not a bool."""
    return outcome["result"]["output"]["payload"]


def race(accept: Any) -> Any:
    gates = [compile_input_gate(InputGateConfig(name, answer_schema=TEXT)) for name in ("compete.gate.a", "compete.gate.b")]
    return compile_first_success(FirstSuccessConfig(name="test.compete.race", candidates=gates, accept=accept,
                                                    max_candidates=2))


def test_accept_is_asked_with_the_key_of_the_candidate_whose_outcome_it_judges(tmp_path: Path) -> None:
    """docs/team.md: a completed candidate is offered to ``accept(key, outcome)``. An accept that
    judges by key (only "b") rejects a's result, so the race keeps waiting; b's result wins."""
    program = race(only_candidate_b)
    with open_runtime(f"sqlite:///{tmp_path / 'race.db'}", program) as runtime:
        handle = runtime.start(program, REQUESTS)
        answer(runtime, handle.tree_id, "a", "first")
        wait_until(lambda: child_by_key(runtime.capture(handle.tree_id), "a").terminal, "a to finish")
        assert not runtime.wait_idle(handle.tree_id).root.terminal, "the race ended on a rejected candidate"
        answer(runtime, handle.tree_id, "b", "second")
        result = handle.result(WAIT)
    assert result.status == "completed", result.termination
    assert result.output["winner"] == 1, result.output
    a, b = result.output["candidates"]
    assert a["outcome"]["key"] == "a" and a["outcome"]["result"]["output"]["payload"] == "first"
    assert b["outcome"]["key"] == "b" and b["outcome"]["result"]["output"]["payload"] == "second"


def test_an_accept_returning_a_truthy_non_bool_fails_the_race_instead_of_choosing_a_winner(tmp_path: Path) -> None:
    """docs/team.md: an ``accept`` that raises or returns something that is not a bool fails the
    race with ``coordination.accept.failed`` (execution) and cancels the candidates. Returning the
    answer text (truthy) must not silently make a the winner."""
    program = race(payload_as_verdict)
    with open_runtime(f"sqlite:///{tmp_path / 'race.db'}", program) as runtime:
        handle = runtime.start(program, REQUESTS)
        answer(runtime, handle.tree_id, "a", "yes")
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "failed", result.output
    failure = result.termination["failure"]
    assert (failure["kind"], failure["code"]) == ("execution", "coordination.accept.failed")
    assert "'a'" in failure["message"] and "str" in failure["message"], failure["message"]
    assert child_by_key(tree, "b").status == "canceled"


# ---------------------------------------------------------------------------
# The Tool child: an input request over its documented size opens no wait


class AskBig:
    name = "ask"
    description = "Asks a human with a prompt just over the documented 1 MiB."
    parameters = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        # a JSON string of MAX_TOOL_INPUT_BYTES - 1 characters is MAX + 1 bytes with its quotes
        raise ToolInputRequired("x" * (MAX_TOOL_INPUT_BYTES - 1), True, None)


def test_an_input_request_whose_prompt_exceeds_one_mib_opens_no_wait_and_is_reported(tmp_path: Path) -> None:
    """docs/interaction.md: an input request's prompt and state are at most 1 MiB of canonical
    JSON each. One byte over, the tool's request opens no wait a host would list; the call is
    left unknown with a diagnostic naming the limit, for the host to settle."""
    model = ScriptedModel([
        {"message": {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "name": "ask", "arguments": "{}"}]},
         "finish_reason": "tool_calls"},
        {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"},
    ])
    program = compile_interaction(InteractionConfig(name="ask.big", model=model, tools=[AskBig()]))
    store = EventStore(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]}, start_id="ask")
            runtime.wait_idle(run.tree_id)
            host = Host(runtime)
            assert host.pending("ask") == []
            [unknown] = host.unknown("ask")
            assert unknown["kind"] == "tool"
            assert f"exceeds {MAX_TOOL_INPUT_BYTES} bytes" in str(unknown["diagnostic"]), unknown["diagnostic"]
    finally:
        store.close()
