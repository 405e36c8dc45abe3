"""Hostile resolutions of unknown tool and model calls (docs/cli.md#resolve, docs/http-api.md).

A host's description of an outcome that the Interaction could not use is refused when it
is given (``interaction.settlement.invalid``, exit status 2 / HTTP 422, with what was
wrong), and nothing is appended: the effect stays unknown and a correct resolution
still completes the run. Before these checks, a malformed tool ``content`` crashed the
command (``cli.internal`` / HTTP 500) or was coerced to text, and a model response the
Interaction rejects was accepted and then failed the run for good.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import InvalidInput
from tests.test_cli import agentfold, refused, sqlite_url, store_version
from tests.test_cli_interaction import FINAL, LEFT_TO_HOST, run_json, two_call_round, unknowns, write

# (tool output, what the refusal must name)
BAD_TOOL_OUTPUTS: list[tuple[Any, str]] = [
    ({"content": [1]}, "output.content[0]"),
    ({"content": [None]}, "output.content[0]"),
    ({"content": 5}, "output.content"),
    ({"content": True}, "output.content"),
    ({"content": {"text": "x"}}, "output.content"),
    ({"content": [{"text": 3}]}, "output.content[0]"),
    ({"content": ["ok", {"type": "image", "url": "x"}]}, "output.content[1]"),
    ([1], "output"),
    (5, "output"),
    (None, "output"),
    ({"content": "x", "colour": 1}, "output.colour"),
]

# Model responses the Interaction would fail the run on (interaction.model.invalid_response).
#: Model responses the Interaction would fail the run on, with what the refusal says.
BAD_MODEL_RESPONSES: list[tuple[dict[str, Any], str]] = [
    ({"finish_reason": "eos", "message": {"content": "done"}}, "unknown finish reason 'eos'"),
    ({"finish_reason": "error", "message": {}}, "unknown finish reason 'error'"),
    ({"finish_reason": "tool_calls", "message": {"tool_calls": [
        {"id": "same", "name": "alpha", "arguments": "{}"}, {"id": "same", "name": "beta", "arguments": "{}"}]}},
     "tool call ids must be unique"),
]


def _parked_tool_call(store: str, tmp_path: Path) -> tuple[str, str]:
    """A run whose beta call is unknown; returns (tree id, effect id)."""
    doc = two_call_round(None, beta={"error": "the beta API timed out"}, final=FINAL)
    tree = run_json(store, write(tmp_path, doc, "round.json"), "--start-id", "hostile-tool")
    [entry] = unknowns(store, tree["tree_id"])
    assert entry["kind"] == "tool"
    return tree["tree_id"], entry["effect_id"]


def _parked_model_call(store: str, tmp_path: Path) -> tuple[str, str]:
    doc = {"name": "m", "input": {"messages": [{"role": "user", "content": "hi"}]},
           "model": {"responses": [LEFT_TO_HOST]}}
    tree = run_json(store, write(tmp_path, doc, "model.json"), "--start-id", "hostile-model")
    [entry] = unknowns(store, tree["tree_id"])
    assert entry["kind"] == "model"
    return tree["tree_id"], entry["effect_id"]


def test_a_malformed_tool_output_is_refused_with_its_path_and_appends_nothing(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    tree_id, effect = _parked_tool_call(store, tmp_path)
    before = store_version(store, tree_id)

    def attempt(case: tuple[Any, str]) -> tuple[Any, str, Any]:
        return case[0], case[1], agentfold("resolve", effect, "--output", json.dumps(case[0]), "--json", store=store)

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(attempt, BAD_TOOL_OUTPUTS))
    for output, where, ran in outcomes:
        error = refused(ran).error()
        assert error["code"] == "interaction.settlement.invalid", (output, ran.stderr)
        assert error["message"].startswith(f"{where}:"), (output, error)
    assert store_version(store, tree_id) == before
    assert [e["effect_id"] for e in unknowns(store, tree_id)] == [effect]

    # Canonical text parts (what `unknown` and `results` show) and plain texts are accepted.
    resolved = agentfold("resolve", effect, "--output",
                         json.dumps({"content": ["b is", {"type": "text", "text": "B"}], "details": {"b": 1}}),
                         "--json", store=store)
    assert resolved.code == 0, resolved.stderr
    output = resolved.json()["resolution"]["payload"]["tool_result"]["completion"]["output"]
    assert output == {"content": [{"type": "text", "text": "b is"}, {"type": "text", "text": "B"}],
                      "details": {"b": 1}}
    assert resolved.json()["tree"]["status"] == "completed"


def test_a_model_response_the_interaction_would_reject_is_refused_at_resolution(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    tree_id, effect = _parked_model_call(store, tmp_path)
    before = store_version(store, tree_id)

    def attempt(response: dict[str, Any]) -> Any:
        return agentfold("resolve", effect, "--model-response", json.dumps(response), "--json", store=store)

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(attempt, [response for response, _ in BAD_MODEL_RESPONSES]))
    for (response, said), ran in zip(BAD_MODEL_RESPONSES, outcomes, strict=True):
        error = refused(ran).error()
        assert error["code"] == "interaction.settlement.invalid", (response, ran.stderr)
        assert said in error["message"], error
    assert store_version(store, tree_id) == before
    assert [e["effect_id"] for e in unknowns(store, tree_id)] == [effect]

    # The run was not failed: the true answer still completes it.
    done = agentfold("resolve", effect, "--model-response", json.dumps(FINAL), "--json", store=store)
    assert done.code == 0, done.stderr
    assert done.json()["tree"]["status"] == "completed"


def test_effective_messages_cannot_rewrite_the_context_without_a_context_policy(tmp_path: Path) -> None:
    """``agentfold resolve --effective-messages`` with other messages than the request's, for a
    Program without a context policy, replaced the stored conversation (a review found the
    next model request starting with the forged messages): the model received the request's
    messages exactly, so others are refused and nothing is appended."""
    store = sqlite_url(tmp_path)
    tree_id, effect = _parked_model_call(store, tmp_path)
    [entry] = unknowns(store, tree_id)
    sent = entry["request"]["model_call"]["request"]["messages"]
    before = store_version(store, tree_id)
    for forged in ([{"role": "user", "content": "FORGED"}], [*sent, {"role": "user", "content": "more"}]):
        error = refused(agentfold("resolve", effect, "--model-response", json.dumps(FINAL), "--effective-messages",
                                  json.dumps(forged), "--json", store=store)).error()
        assert error["code"] == "interaction.settlement.invalid", error
        assert "this program has no context policy" in error["message"], error
        assert "omit the effective messages" in error["message"], error
    assert store_version(store, tree_id) == before
    assert [e["effect_id"] for e in unknowns(store, tree_id)] == [effect]
    # The request's own messages change nothing: accepted, no replacement recorded.
    done = agentfold("resolve", effect, "--model-response", json.dumps(FINAL), "--effective-messages",
                     json.dumps(sent), "--json", store=store)
    assert done.code == 0, done.stderr
    assert set(done.json()["resolution"]["payload"]["model_result"]) == {"response"}
    assert done.json()["tree"]["status"] == "completed"


def test_the_python_host_refuses_effective_messages_that_rewrite_the_context_without_a_policy(tmp_path: Path) -> None:
    """``Host.resolve(effective_messages=...)`` shares the rule (agentfold.adapters.resolution)."""
    program = compile_interaction(InteractionConfig(name="test.no-policy", model=ScriptedModel([
        {"error": "HTTP 502 from the provider"}, {"finish_reason": "stop", "message": {"content": "never asked"}}])))
    store = EventStore(sqlite_url(tmp_path))
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "what is up?"}]})
            [effect] = list(runtime.wait_idle(handle.tree_id).unknown_ids)
            events = len(store.read_raw(handle.tree_id))
            host = Host(runtime)
            with pytest.raises(InvalidInput, match="this program has no context policy") as refusal:
                host.resolve(effect, model_response=FINAL, effective_messages=[{"role": "user", "content": "FORGED"}])
            assert refusal.value.code == "interaction.settlement.invalid"
            assert len(store.read_raw(handle.tree_id)) == events  # nothing appended
            settlement = host.resolve(effect, model_response=FINAL,
                                      effective_messages=[{"role": "user", "content": "what is up?"}])
            assert set(settlement.payload["model_result"]) == {"response"}  # type: ignore[index]
            assert runtime.result(handle.tree_id, 30).status == "completed"
    finally:
        store.close()
