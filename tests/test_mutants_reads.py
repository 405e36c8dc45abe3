"""The read side while the read-model tables lag behind the store: behaviour the mutation audit
of the read side (2026-12-05, "reads") found undefended.

docs/http-api.md ("Positions and read-your-writes") promises that a read answers from the
tables for every run they have caught up with and folds, at query time, only the runs with
events the follower has not applied yet, so that reads are never stale; a listing pages by
whole runs, each entry exactly once. The suite checked that with current tables, or with no
tables at all; these tests put runs behind the tables (a real SQLite file, a real follower that
then stops, the runs changed afterwards, as between two polls of ``serve``'s follower or while
``project --follow`` is down) and read through ``Host`` (the same ``HostQueries`` as
``GET /runs`` and ``GET /pending-inputs``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.host import Host
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_input, scenario_program, validate_scenario
from agentfold.adapters.sources import default_sources
from tests.http_api.test_listing_pages import waits
from tests.interaction.tools import WAIT


def start_waiting(runtime: Runtime, k: int, start_id: str) -> str:
    """A run whose one round has ``k`` tool calls, each waiting for a human answer; once idle."""
    doc = validate_scenario(waits(k))
    handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id=start_id, configuration=doc)
    runtime.wait_idle(handle.tree_id, timeout=WAIT)
    return str(handle.tree_id)


def project(store: EventStore) -> int:
    """What ``agentfold project`` does: every event committed so far into the tables; their position."""
    Follower(store, default_sources().catalog()).catch_up()
    return ReadModels(store).position()


def cancel(runtime: Runtime, tree_id: str) -> None:
    """Cancel a run (as ``POST .../cancel``) and wait until it has ended."""
    root = runtime.capture(tree_id).root.process_id
    assert runtime.cancel(root, "called off") is True
    runtime.wait_idle(tree_id, timeout=WAIT)
    assert runtime.capture(tree_id).classification() == "terminal"


def flat(pages: list[list[str]]) -> list[str]:
    return [item for page in pages for item in page]


def in_time(read: Any, timeout: float = 20.0) -> Any:
    """``read()``'s answer, failing (instead of hanging the suite) if it does not return in time."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = read()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            box["error"] = exc

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"the read did not answer within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_runs_filtered_by_status_or_classification_see_the_runs_the_tables_have_not_caught_up_with(
    store: EventStore,
) -> None:
    """Mutant R7 (queries.py ``HostQueries.runs``: the status filter inverted for the runs folded
    at query time, ``run["status"] == status``) and R7b (the same for ``classification``): a run
    canceled after the follower's last batch was listed under ``status=waiting`` (its stale
    status) or left out of ``status=canceled``, and the waiting runs dropped. Mutant R41 (the
    same: the tables asked for ``limit`` rows only, not one more per run folded at query time):
    the lagging run's stale row took a page's place, the page came out short, its
    ``next_after`` null, and a client paging with ``limit=1`` never saw the run after it."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        trees = [start_waiting(runtime, 1, f"filter-{i}") for i in range(3)]
        position = project(store)
        cancel(runtime, trees[1])  # after the tables' position: the tables lag behind this run
        assert ReadModels(store).position() == position < store.max_notification_id()
        host = Host(runtime, default_sources())

        def listed(status: str | None = None, classification: str | None = None) -> list[str]:
            return [str(r["tree_id"]) for r in host.runs(status=status, classification=classification)]

        assert listed(status="waiting") == [trees[0], trees[2]]
        assert listed(status="canceled") == [trees[1]]
        assert listed(classification="parked") == [trees[0], trees[2]]
        assert listed(classification="terminal") == [trees[1]]
        assert listed(status="canceled", classification="terminal") == [trees[1]]
        assert listed(status="waiting", classification="terminal") == []
        # Every answer says the run's state now, not the one the tables recorded.
        assert [r["status"] for r in host.runs()] == ["waiting", "canceled", "waiting"]
        # The tables were read (their cursors), not bypassed by a fold of every run.
        assert all(str(r["cursor"]).startswith("m") for r in host.runs())

        # Page by page (GET /runs?status=waiting&limit=1): the lagging run's stale row fills
        # no page, and paging on until next_after is null still reaches the run after it.
        def paged(status: str | None = None, classification: str | None = None) -> list[list[str]]:
            out: list[list[str]] = []
            after = None
            while True:
                page = host.runs(status=status, classification=classification, limit=1, after=after)
                out.append([str(r["tree_id"]) for r in page])
                if page.next_after is None:  # type: ignore[attr-defined]
                    return out
                assert len(out) < 10, "paging does not end"
                after = page.next_after  # type: ignore[attr-defined]

        assert flat(paged(status="waiting")) == [trees[0], trees[2]]
        assert flat(paged(classification="parked")) == [trees[0], trees[2]]
        assert flat(paged()) == trees


def test_pages_of_pending_inputs_list_each_wait_once_when_a_lagging_run_no_longer_waits(store: EventStore) -> None:
    """Mutant R18 (read_models.py ``ReadModels.ordered``: ``(created_position, ord) >= (?, ?)``).
    A page skips the tables' rows of a run folded at query time and reads on from the last row
    it read: with ``>=`` that row came back, so the wait of the next run was listed twice on one
    page, and, when that row was the lagging run's own, ``GET /pending-inputs?limit=1`` never
    answered (the same row read again for ever)."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        # A (two waits), then D and E (one each); then F (one) after D: the tables know all four.
        a = start_waiting(runtime, 2, "pages-a")
        d = start_waiting(runtime, 1, "pages-d")
        e = start_waiting(runtime, 1, "pages-e")
        project(store)
        cancel(runtime, a)  # A's rows in the tables are stale: it waits for nothing now
        host = Host(runtime, default_sources())
        everything = in_time(lambda: host.pending())
        assert [w["tree_id"] for w in everything] == [d, e]

        def paged(limit: int) -> list[list[str]]:
            out: list[list[str]] = []
            after = None
            while True:
                page = in_time(lambda after=after: host.pending(limit=limit, after=after))
                out.append([str(w["wait_id"]) for w in page])
                if page.next_after is None:
                    return out
                assert len(out) < 10, "paging does not end"
                after = page.next_after

        waits_now = [str(w["wait_id"]) for w in everything]
        assert paged(2) == [waits_now]
        assert paged(1) == [[waits_now[0]], [waits_now[1]]]
        assert paged(3) == [waits_now]

        # The lagging run the last of the tables' rows: a page of one that must end.
        f = start_waiting(runtime, 1, "pages-f")
        project(store)
        cancel(runtime, f)
        assert [w["tree_id"] for w in in_time(lambda: host.pending(limit=1))] == [d]
        assert flat(paged(1)) == waits_now


def test_a_result_a_paused_interaction_has_not_taken_yet_is_listed_under_its_own_round_and_call(
    store: EventStore,
) -> None:
    """Mutant R19 (projections/settled_results.py ``_round_entries``: the Tool child of a call
    looked up under the previous round's key). Results an Interaction has taken into its round
    were right either way; a result only its Tool child holds (the Interaction is paused, so it
    has not taken it yet) was read from the child of the same call index one round earlier:
    ``results`` said round 2's approval call returned round 1's ``"one"``. Both read paths."""
    doc = {
        "name": "two rounds",
        "input": {"messages": [{"role": "user", "content": "Look twice, then ask."}]},
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "c1", "name": "first", "arguments": "{}"}, {"id": "c2", "name": "first", "arguments": "{}"}]}},
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "c3", "name": "second", "arguments": "{}"},
                {"id": "c4", "name": "approve", "arguments": '{"amount_eur": 1}'}]}},
            {"finish_reason": "stop", "message": {"content": "done"}},
        ]},
        "tools": [
            {"name": "first", "result": {"output": "one"}},
            {"name": "second", "result": {"output": "two"}},
            {"name": "approve", "parameters": {"type": "object", "required": ["amount_eur"]},
             "result": {"input": {"prompt": {"question": "approve?"},
                                  "response_schema": {"type": "object", "required": ["approved"],
                                                      "properties": {"approved": {"type": "boolean"}}}},
                        "then": {"answer": True}}},
        ],
    }
    doc = validate_scenario(doc)
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id="rounds", configuration=doc)
        runtime.wait_idle(handle.tree_id, timeout=WAIT)
        host = Host(runtime, default_sources())
        [wait] = host.pending("rounds")
        assert wait["tool_call_ref"].endswith("/2/1")
        root = runtime.capture(handle.tree_id).root.process_id
        assert runtime.pause(root, "hold on") is True
        runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert host.answer(str(wait["process_id"]), str(wait["wait_id"]), {"approved": True}) is True
        runtime.wait_idle(handle.tree_id, timeout=WAIT)

        want = [(2, 0, "c3", {"content": [{"type": "text", "text": "two"}]}), (2, 1, "c4", {"details": {"approved": True}})]

        def entries() -> list[tuple[int, int, str, Any]]:
            return [(r["model_call_sequence"], e["tool_call_index"], e["call"]["id"], e["result"]["output"])
                    for r in host.results("rounds")["rounds"] for e in r["entries"]]

        assert entries() == want  # by folding (no tables yet)
        project(store)
        assert entries() == want  # from the read-model tables


def test_a_read_models_cursor_on_a_store_without_read_models_is_refused_not_retried(store: EventStore) -> None:
    """Mutant R48 (queries.py ``HostQueries.runs_page``: an ``m`` cursor on a store with no
    read-model tables answered as tables that lag, ``projection.behind``). docs/http-api.md: a
    cursor this API did not return is ``422 http.cursor_invalid``, and so is an ``m`` cursor on
    a store with no read models; ``projection.behind`` is a ``503`` whose hint says to retry,
    which never helps there. (The pending-inputs and unknown-effects listings were checked
    already, ``GET /runs`` was not.)"""
    from agentfold.domain.errors import InvalidInput

    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        start_waiting(runtime, 1, "cursor-0")
        assert not ReadModels.exist(store)
        host = Host(runtime, default_sources())
        assert [str(r["cursor"])[0] for r in host.runs()] == ["f"]
        for listing in (lambda: host.runs(after="m5"), lambda: host.pending(limit=1, after="m5")):
            with pytest.raises(InvalidInput) as refused:
                listing()
            assert refused.value.code == "http.cursor_invalid"
            assert refused.value.http_status == 422
            assert "read models" in refused.value.message and "without after" in (refused.value.hint or "")
        assert not ReadModels.exist(store)  # the refusal created no tables


def test_a_batch_the_database_refuses_for_good_fails_project_instead_of_retrying_for_ever(
    store: EventStore, tmp_path: Path
) -> None:
    """Only a moved tracking position (another follower committed first) is retried. Any other
    constraint failure of a batch (here an operator's trigger; a bug inserting a row twice would
    do the same) fails every retry alike: ``project`` took it for a moved position, started
    again from the same position, and never ended, without a word. It now fails, names the
    refusal, and leaves the tables where they were."""
    import subprocess
    import sys

    from tests.audit.support import Sql

    url = store.url
    with Runtime(store, default_sources().catalog()) as runtime:
        start_waiting(runtime, 1, "refused-0")
    before = project(store)
    Sql(url)._run("CREATE TRIGGER refuse_runs BEFORE INSERT ON agentfold_rm_runs "
                  "BEGIN SELECT RAISE(ABORT, 'refused by the operator'); END")
    with Runtime(store, default_sources().catalog()) as runtime:
        start_waiting(runtime, 1, "refused-1")
    done = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", "project", "--store", url],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "refused by the operator" in done.stderr
    assert ReadModels(store).position() == before  # nothing of the refused batch was written
