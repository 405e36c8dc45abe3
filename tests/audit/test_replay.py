"""`agentfold replay TREE --at POSITION`: time travel over a recorded Interaction run, calling nothing.

The run is the bundled trip-planner scenario, recorded with the CLI: a model call asks
for two tools (weather, book_hotel), a second asks for approve_budget, which waits for
a human answer; the answer arrives and a third model call ends the run. Every position
is replayed in this process with Programs whose dispatchers count their calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.domain.ids import TreeID
from tests.audit.support import CountingSources, Sql, cli, record_demo
from tests.test_cli import agentfold, ok

PHASES = {"planned": 0, "pending": 1, "settled": 2}


@pytest.fixture
def demo(durable_store_url: str, tmp_path: Path) -> tuple[str, TreeID, Path]:
    tree_id = record_demo(tmp_path / "run", durable_store_url)
    return durable_store_url, tree_id, tmp_path / "run" / "side-effects.jsonl"


def replay_all(capsys: pytest.CaptureFixture[str], store: str, tree_id: TreeID, last: int,
               counting: CountingSources) -> list[dict[str, Any]]:
    out = []
    for position in range(1, last + 1):
        ran = cli(capsys, "replay", str(tree_id), "--at", str(position), "--json", "--store", store,
                  sources=counting.sources())
        assert ran.code == 0, ran.stderr
        out.append(ran.json())
    return out


def test_replay_at_every_position_is_consistent_with_the_final_state_and_calls_nothing(
    capsys: pytest.CaptureFixture[str], demo: Any
) -> None:
    store, tree_id, log = demo
    log_before = log.read_bytes()
    assert log_before.count(b"\n") == 4  # weather, book_hotel, approve_budget twice (asked, then answered)
    shown = ok(agentfold("show", str(tree_id), "--json", store=store)).json()
    last = shown["version"]
    topics = [topic for _, topic, _ in Sql(store).rows(tree_id)]
    assert len(topics) == last

    counting = CountingSources()
    replays = replay_all(capsys, store, tree_id, last, counting)

    # Nothing was called: no dispatcher, no model, no tool (whose calls append to the log).
    assert counting.programs, "the scenario programs were bound for the replays"
    assert counting.calls == {}
    assert counting.model_requests() == 0
    assert log.read_bytes() == log_before

    # The last position is exactly what `show` prints.
    assert replays[-1]["tree"] == shown

    final = {p["process_id"]: p for p in shown["processes"]}
    order = list(final)
    seen_phase: dict[str, int] = {}
    previous: dict[str, dict[str, Any]] = {}
    for position, data in enumerate(replays, start=1):
        tree = data["tree"]
        assert (data["position"], tree["version"], data["event"]["position"]) == (position, position, position)
        assert data["version"] == last and data["programs_bound"] is True
        version = data["event"]["schema_version"]
        suffix = "" if version == 1 else f"@{version}"
        assert "domain.events:" + data["event"]["type"] + suffix == topics[position - 1]
        processes = {p["process_id"]: p for p in tree["processes"]}
        assert list(processes) == order[: len(processes)]  # processes appear in creation order, never vanish
        assert len(processes) >= len(previous)
        for pid, process in processes.items():
            end = final[pid]
            before = previous.get(pid)
            if before is not None:
                assert process["committed_steps"] >= before["committed_steps"]
                assert process["mailbox"]["arrivals"] >= before["mailbox"]["arrivals"]
                if before["termination"] is not None:  # terminal once, with the final outcome
                    assert process["status"] == before["status"] == end["status"]
                    assert process["termination"] == end["termination"]
            assert process["committed_steps"] <= end["committed_steps"]
            for effect in (process["prepared"] or {}).get("effects", []):
                rank = PHASES[effect["phase"]]
                assert rank >= seen_phase.get(effect["effect_id"], 0)  # planned -> pending -> settled
                seen_phase[effect["effect_id"]] = rank
        previous = processes
    assert seen_phase, "effects were observed in their batches"


def test_replay_shows_what_the_model_saw_before_it_asked_for_a_tool(
    capsys: pytest.CaptureFixture[str], demo: Any
) -> None:
    store, tree_id, _ = demo
    last = ok(agentfold("show", str(tree_id), "--json", store=store)).json()["version"]
    counting = CountingSources()
    replays = replay_all(capsys, store, tree_id, last, counting)
    root = replays[0]["tree"]["root_id"]
    contexts = [r["working_context"][root] for r in replays]

    # While model call 2 is in flight, its exact request is shown.
    in_flight = [c["model_request"] for c in contexts
                 if c["model_request"] and c["model_request"]["model_call_sequence"] == 2]
    assert in_flight
    sent = in_flight[0]["messages"]
    assert all(r["messages"] == sent for r in in_flight)
    texts = repr(sent)
    assert "sunny, 24 C" in texts and "H-1042" in texts  # round 1's tool results were in the context
    assert "call_budget" not in texts  # the call the model is about to make is not in its context
    # During the round it opened (approve_budget), the working context is what the model saw.
    round_two = [c for c in contexts if c.get("tool_round") and c["tool_round"]["sequence"] == 2]
    assert round_two and all(c["messages"] == sent for c in round_two)
    calls = round_two[0]["tool_round"]["response"]["message"]["tool_calls"]
    assert [c["name"] for c in calls] == ["approve_budget"]
    # Once the round completes, the next request would add the round's messages.
    complete = [c for c in contexts if c["phase"] == "round_complete" and c["tool_round"]["sequence"] == 2]
    assert complete
    upcoming = complete[-1]["next_model_request"]["messages"]
    assert upcoming[: len(sent)] == sent and upcoming[len(sent)]["role"] == "assistant"
    assert upcoming[len(sent) + 1]["role"] == "tool"
    assert contexts[-1]["phase"] == "completed"
    assert counting.calls == {} and counting.model_requests() == 0


def test_replay_refuses_positions_outside_the_history(capsys: pytest.CaptureFixture[str], demo: Any) -> None:
    store, tree_id, _ = demo
    last = ok(agentfold("show", str(tree_id), "--json", store=store)).json()["version"]
    for position in (0, last + 1):
        ran = cli(capsys, "replay", str(tree_id), "--at", str(position), "--json", "--store", store)
        assert ran.code == 2 and ran.stdout == ""
        assert ran.error()["code"] == "audit.position_out_of_range"
    ran = cli(capsys, "replay", "tree:" + "0" * 32, "--at", "1", "--json", "--store", store)
    assert ran.code == 2 and ran.error()["code"] == "engine.tree.not_found"


def test_replay_past_a_cut_tail_says_the_history_is_corrupt_not_that_the_position_is_wrong(
    capsys: pytest.CaptureFixture[str], demo: Any
) -> None:
    # Found by an audit review: with the tail cut under its index row, a position the row
    # proves was written was answered "no such position" (exit 2), while every other command
    # refuses the cut tree as corrupt.
    store, tree_id, _ = demo
    last = ok(agentfold("show", str(tree_id), "--json", store=store)).json()["version"]
    kept = last - 5
    Sql(store).delete(tree_id, *range(kept + 1, last + 1))
    for position in (kept + 1, last):
        ran = cli(capsys, "replay", str(tree_id), "--at", str(position), "--json", "--store", store)
        assert ran.code == 1 and ran.stdout == ""
        error = ran.error()
        assert (error["code"], error["detail"]["position"], error["detail"]["rule"]) == (
            "store.corrupt", kept + 1, "index.head_mismatch"
        )
    ran = cli(capsys, "replay", str(tree_id), "--at", str(last + 1), "--json", "--store", store)
    assert ran.code == 2 and ran.error()["code"] == "audit.position_out_of_range"
    assert cli(capsys, "replay", str(tree_id), "--at", str(kept), "--json", "--store", store).code == 0


def test_replay_past_the_end_the_index_row_anchors_is_corrupt_as_every_load_says(
    capsys: pytest.CaptureFixture[str], demo: Any
) -> None:
    """Found by an audit walkthrough: with the index row rolled back by hand (events stored past
    it), ``show`` refused the tree (index.head_mismatch, "events were added past it") while
    ``replay --at LAST`` showed the state, exit 0: replay shows what every load derives."""
    store, tree_id, _ = demo
    last = ok(agentfold("show", str(tree_id), "--json", store=store)).json()["version"]
    kept = last - 2
    digest = ok(agentfold("replay", str(tree_id), "--at", str(kept), "--json", store=store)).json()["event"]["digest"]
    Sql(store).set_head(tree_id, kept, digest)
    for position in (kept + 1, last):
        ran = cli(capsys, "replay", str(tree_id), "--at", str(position), "--json", "--store", store)
        assert ran.code == 1 and ran.stdout == "", ran.stdout
        error = ran.error()
        assert (error["code"], error["detail"]["position"], error["detail"]["rule"]) == (
            "store.corrupt", kept + 1, "index.head_mismatch"), error
        assert "events were added past it" in error["message"]
    assert cli(capsys, "replay", str(tree_id), "--at", str(kept), "--json", "--store", store).code == 0


def test_replay_text_names_the_event_and_the_working_context(demo: Any) -> None:
    store, tree_id, _ = demo
    ran = ok(agentfold("replay", str(tree_id), "--at", "3", store=store))
    assert f"{tree_id} at position 3 of" in ran.stdout
    assert "working context of" in ran.stdout
