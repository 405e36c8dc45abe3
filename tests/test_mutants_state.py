"""The Interaction's round bookkeeping, as the mutation audit "state" found undefended.

Each test failed with a planted bug in ``agentfold/domain/interaction/state.py`` or
``interaction.py`` that the rest of the suite let through (the audit's report lists them):
a direct-result round that ended the run although one of its calls failed, a deferred tool
advertised twice that reached the model twice, child-wait keys that did not say how many
results the window had so far. In-process and fast: scenario files (docs/scenarios.md) run
by a Runtime on a memory store; what is asserted is what a user observes: the run's Output,
the request stored for the model call, the wait keys in the stored history.
"""

from __future__ import annotations

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_catalog, scenario_input, scenario_program, validate_scenario
from tests.test_mutants_scen import calls, parked_call, stop


def test_a_direct_result_round_with_one_failed_call_goes_back_to_the_model() -> None:
    # docs/scenarios.md (direct_result): the round ends the run only when its calls all target
    # direct-result tools AND all succeed. One of two failed: the model is called again and its
    # answer is the Output. (Mutant: "all succeeded" read as "any succeeded" ended the run with
    # the two tool results, the failure among them, and never asked the model.)
    doc = validate_scenario({
        "name": "direct-but-failed",
        "model": {"responses": [calls("lookup", "book"), stop("the booking failed; try later")]},
        "tools": [
            {"name": "lookup", "direct_result": True, "result": {"output": "found"}},
            {"name": "book", "direct_result": True, "result": {"failure": {"kind": "failed", "output": "no rooms"}}},
        ],
    })
    with Runtime(EventStore("memory:"), scenario_catalog()) as runtime:
        handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id="direct", configuration=doc)
        result = handle.result(timeout=30)
    assert result.status == "completed"
    assert "direct_tool_results" not in result.output
    assert result.output["model_calls"] == 2
    assert result.output["model_response"]["message"]["content"] == [
        {"type": "text", "text": "the booking failed; try later"}
    ]


def test_a_deferred_tool_advertised_again_is_offered_to_the_model_once() -> None:
    # docs/interaction.md §10: advertised names are merged (first-seen order). The finder runs in
    # two rounds and advertises "secret" both times; the third model call is offered it once
    # (a tool named twice in a request is refused by hosted models). The script ends after two
    # responses, so the third model call is unknown and parks the run with its request stored.
    # (Mutant: the merge appended without looking, giving ["secret", "secret"].)
    third_call = parked_call({
        "name": "advertised-twice",
        "model": {"responses": [calls("finder"), calls("finder")]},
        "tools": [{"name": "finder", "advertises": ["secret"], "result": {"output": "found it"}},
                  {"name": "secret", "deferred": True, "result": {"output": "ran"}}],
    }, "twice")
    assert third_call["model_call_sequence"] == 3
    assert third_call["advertised_tool_names"] == ["secret"]


def test_each_tool_window_waits_under_the_documented_key_of_its_results_so_far() -> None:
    # docs/interaction.md ("Windows", "The events of a round"): the child wait of a window is
    # keyed interaction.children:<sequence>:<window start>:<results so far>. Two calls one at a
    # time: the windows start at 0 and 1, each waits before any of its results.
    # (Mutant: the key counted the active children instead of the results: ...:1:0:1, ...:1:1:1.)
    doc = validate_scenario({
        "name": "two-windows",
        "model": {"responses": [calls("alpha", "beta"), stop("done")]},
        "tools": [{"name": "alpha", "result": {"output": "a"}}, {"name": "beta", "result": {"output": "b"}}],
    })
    store = EventStore("memory:")
    with Runtime(store, scenario_catalog()) as runtime:
        handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id="keys", configuration=doc)
        assert handle.result(timeout=30).status == "completed"
    keys = [
        e.event.payload["key"]
        for e in store.read(handle.tree_id)
        if type(e.event).__name__ == "EffectDeclared"
        and isinstance(e.event.payload, dict)
        and e.event.payload.get("operation") == "wait_children"
    ]
    assert keys == ["interaction.children:1:0:0", "interaction.children:1:1:0"]
