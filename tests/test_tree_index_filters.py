"""Listing the tree index with filters (``agentfold trees --status/--classification/--last``):
found by a scale audit, where `trees` on a store of 50,000 runs printed every row (22.8 MB of
JSON, 180 MB of memory) and an operator had no way to ask for the parked runs or the latest
ones. The filters run in the database on SQLite and PostgreSQL, and the same way in memory."""

from __future__ import annotations

import time
from pathlib import Path

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.recorders import HeadFilter
from agentfold.adapters.runtime import Runtime
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold, ok, refused


def test_the_index_filters_by_status_classification_and_the_latest_n(store_url: str) -> None:
    finishing = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="test.finishing")
    stuck = chain_program(lambda request, context: Settlement.unknown(), name="test.stuck")
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([finishing, stuck])) as runtime:
            for start, program in (("a", finishing), ("b", stuck), ("c", finishing), ("d", stuck), ("e", finishing)):
                handle = runtime.start(program, {"n": 2}, start_id=start)
                runtime.wait_idle(handle.tree_id)
                time.sleep(0.002)  # distinct creation times: "the latest" is well defined
        every = store.heads()
        assert [h.start_id for h in every] == ["a", "b", "c", "d", "e"]
        by_start = {h.start_id: h for h in every}
        assert {by_start[s].classification for s in "ace"} == {"terminal"}
        parked = by_start["b"].classification
        assert parked != "terminal" and by_start["d"].classification == parked

        def listed(**only: object) -> list[str]:
            return [h.start_id for h in store.heads(only=HeadFilter(**only))]  # type: ignore[arg-type]

        assert listed() == ["a", "b", "c", "d", "e"]
        assert listed(live_only=True) == ["b", "d"]
        assert listed(classification="terminal") == ["a", "c", "e"]
        assert listed(classification=parked) == ["b", "d"]
        assert listed(status=by_start["a"].status) == ["a", "c", "e"]
        assert listed(status=by_start["b"].status, classification="terminal") == []
        assert listed(last=2) == ["d", "e"]  # the latest two, oldest first
        assert listed(classification="terminal", last=2) == ["c", "e"]
        assert listed(live_only=True, last=10) == ["b", "d"]
        assert listed(live_only=True, last=3) == ["b", "d"]  # more than there are, fewer than twice
        assert listed(last=7) == ["a", "b", "c", "d", "e"]
        # A page: `limit` rows after the first `offset` of those that match (the fold path of GET /runs).
        assert listed(offset=1, limit=2) == ["b", "c"]
        assert listed(classification="terminal", offset=1, limit=5) == ["c", "e"]
        assert listed(offset=5, limit=2) == []
    finally:
        store.close()


def test_trees_takes_the_filters_and_refuses_bad_ones(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    for start in ("order-1", "order-2", "order-3"):
        ok(agentfold("kernel-demo-run", "--start-id", start, "--side-effect-log", str(tmp_path / start), store=store))
    last_two = ok(agentfold("trees", "--last", "2", "--json", store=store)).json()["trees"]
    assert [t["start_id"] for t in last_two] == ["order-2", "order-3"]
    completed = ok(agentfold("trees", "--status", "completed", "--classification", "terminal", "--json",
                             store=store)).json()["trees"]
    assert [t["start_id"] for t in completed] == ["order-1", "order-2", "order-3"]
    none = ok(agentfold("trees", "--classification", "parked", store=store))
    assert none.stdout.startswith("no parked trees in ")
    for bad in (["--last", "0"], ["--last", "x"], ["--status", "done"], ["--classification", "stuck"]):
        assert refused(agentfold("trees", *bad, store=store)).stderr.startswith("agentfold: error: cli.usage:")
