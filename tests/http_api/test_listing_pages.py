"""GET /pending-inputs and GET /unknown-effects a page at a time (docs/http-api.md#pages).

Each test runs its own ``agentfold serve`` on a fresh store (SQLite file, PostgreSQL
database), with read models (cursors ``m...``) and without (``--no-follow``: every page
folds the live runs, cursors ``f...``): a page holds at most ``limit`` entries, whole runs
only (a run with more entries than ``limit`` comes alone), runs in creation order, and
paging on with ``next_after`` lists every entry exactly once.
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

import agentfold.adapters.queries as queries_module
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import default_sources
from agentfold.domain.errors import InvalidInput, StoreFailure
from tests.http_api.support import ApiServer, ok, problem, start_server
from tests.test_cli import agentfold
from tests.test_cli_interaction import LEFT_TO_HOST, approval

FOLLOW = [pytest.param(True, id="read-models"), pytest.param(False, id="folding")]


def waits(k: int) -> dict[str, Any]:
    """One round of ``k`` concurrent tool calls that each wait for a human answer (k=0: a run that just ends)."""
    doc = approval(None)
    if k == 0:
        doc["model"]["responses"] = doc["model"]["responses"][1:]
        return doc
    doc["model"]["responses"][0] = {"finish_reason": "tool_calls", "message": {"tool_calls": [
        {"id": f"call_{i}", "name": "approve", "arguments": '{"amount_eur": 1}'} for i in range(k)]}}
    doc["tools"][0]["concurrency"] = {"key": "", "concurrent": True}
    doc["limits"] = {"max_concurrent_tool_calls": k}
    return doc


def unknown_model_call() -> dict[str, Any]:
    """A run whose second model call is left to the host: one unknown effect."""
    return {
        "name": "left-to-host",
        "input": {"messages": [{"role": "user", "content": "Say hello."}]},
        "model": {"responses": [LEFT_TO_HOST]},
    }



def serve(store: str, tmp_path: Path, servers: list[ApiServer], follow: bool) -> httpx.Client:
    server = start_server(store, tmp_path, *(() if follow else ("--no-follow",)))
    servers.append(server)
    return server.client()


def start(c: httpx.Client, doc: dict[str, Any]) -> str:
    data = ok(c.post("/runs", json={"scenario": doc, "start_id": f"page-{uuid.uuid4().hex[:12]}", "wait": 30}), 201)
    assert data["idle"], data
    return str(data["tree"]["tree_id"])


def pages(c: httpx.Client, path: str, member: str, limit: int) -> list[list[dict[str, Any]]]:
    """Every page of a listing, following ``next_after`` from the first."""
    out: list[list[dict[str, Any]]] = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        page = ok(c.get(path, params=params))
        assert set(page) == {member, "next_after"}, page
        out.append(page[member])
        if page["next_after"] is None:
            return out
        assert len(out) < 100, "paging does not end"
        params["after"] = page["next_after"]


def trees_of(entries: list[dict[str, Any]]) -> list[str]:
    """The runs of a list of entries, in order, each once."""
    return list(dict.fromkeys(e["tree_id"] for e in entries))


@pytest.mark.parametrize("follow", FOLLOW)
def test_pending_inputs_page_by_whole_runs_in_creation_order_and_every_wait_once(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer], follow: bool
) -> None:
    c = serve(durable_store_url, tmp_path, servers, follow)
    counts = [1, 3, 0, 2, 1, 4]
    trees = [start(c, waits(k)) for k in counts]
    waiting = [t for t, k in zip(trees, counts, strict=True) if k]

    everything = ok(c.get("/pending-inputs", params={"limit": 500}))
    assert everything["next_after"] is None
    assert trees_of(everything["pending"]) == waiting
    assert [len([e for e in everything["pending"] if e["tree_id"] == t]) for t in waiting] == [1, 3, 2, 1, 4]

    # limit 2: [1], [3] (alone: more than a page), [2], [1] (its successor has 4), [4].
    paged = pages(c, "/pending-inputs", "pending", 2)
    assert [len(p) for p in paged] == [1, 3, 2, 1, 4]
    assert [trees_of(p) for p in paged] == [[t] for t in waiting]
    assert [e for p in paged for e in p] == everything["pending"]
    # limit 4: [1, 3] fill a page exactly; [2, 1]; [4].
    assert [[len([e for e in p if e["tree_id"] == t]) for t in trees_of(p)] for p in pages(
        c, "/pending-inputs", "pending", 4)] == [[1, 3], [2, 1], [4]]
    # The default page holds them all (100 entries).
    assert ok(c.get("/pending-inputs")) == everything


@pytest.mark.parametrize("follow", FOLLOW)
def test_a_run_that_ends_between_two_pages_neither_skips_nor_repeats_the_runs_after_it(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer], follow: bool
) -> None:
    c = serve(durable_store_url, tmp_path, servers, follow)
    trees = [start(c, waits(1)) for _ in range(4)]
    first = ok(c.get("/pending-inputs", params={"limit": 2}))
    assert trees_of(first["pending"]) == trees[:2] and first["next_after"] is not None
    # Both runs of the first page end (answered), and the first of the next page too.
    for wait in [*first["pending"], ok(c.get(f"/runs/{trees[2]}/pending-inputs"))["pending"][0]]:
        ok(c.post(f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer",
                  json={"response": {"approved": True}, "wait": 30}))
    second = ok(c.get("/pending-inputs", params={"limit": 2, "after": first["next_after"]}))
    assert (trees_of(second["pending"]), second["next_after"]) == ([trees[3]], None)


@pytest.mark.parametrize("follow", FOLLOW)
def test_unknown_effects_page_the_same_way(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer], follow: bool
) -> None:
    c = serve(durable_store_url, tmp_path, servers, follow)
    trees = [start(c, unknown_model_call()) for _ in range(3)]
    start(c, waits(1))  # a live run without unknown effects: in no page
    paged = pages(c, "/unknown-effects", "unknown_effects", 1)
    assert [trees_of(p) for p in paged] == [[t] for t in trees]
    assert [e["kind"] for p in paged for e in p] == ["model"] * 3


def test_cursors_are_checked_and_name_their_path(durable_store_url: str, tmp_path: Path,
                                                 servers: list[ApiServer]) -> None:
    c = serve(durable_store_url, tmp_path, servers, follow=False)
    start(c, waits(1))
    start(c, waits(1))
    folded = ok(c.get("/pending-inputs", params={"limit": 1}))
    assert folded["next_after"].startswith("f")
    created_at, tree_id = base64.urlsafe_b64decode(folded["next_after"][1:] + "==").decode().split("\n")

    def forged(text: str) -> str:
        return "f" + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    assert forged(f"{created_at}\n{tree_id}") == folded["next_after"]  # what a cursor holds
    later = created_at[:-2] + ("1Z" if created_at[-2] != "1" else "2Z")
    for path in ("/pending-inputs", "/unknown-effects"):
        for bad in ("zzz", "m12x", "m01", "m" + "9" * 40, "f!!", forged("2026\nnot-a-tree"), folded["next_after"] + "A",
                    forged(f"x\n{tree_id}"), forged(f"\n{tree_id}"), forged(f"{later}\n{tree_id}"),
                    forged(f"{created_at}\ntree:" + "0" * 32)):
            body = problem(c.get(path, params={"after": bad}), 422, "http.cursor_invalid")
            assert "next_after" in body["hint"]
        problem(c.get(path, params={"limit": 0}), 422, "http.request_invalid")
        problem(c.get(path, params={"limit": 501}), 422, "http.request_invalid")
        # No follower ever wrote read models here: a cursor from the tables' path cannot be honoured.
        body = problem(c.get(path, params={"after": "m5"}), 422, "http.cursor_invalid")
        assert "read models" in body["detail"] and "without after" in body["hint"]
    # A folded page's cursor still pages on once a follower has written the tables.
    projected = agentfold("project", "--json", store=durable_store_url)
    assert projected.code == 0, projected.stderr
    second = ok(c.get("/pending-inputs", params={"limit": 1, "after": folded["next_after"]}))
    assert len(second["pending"]) == 1 and second["pending"] != folded["pending"]


def test_python_host_pages_like_the_http_api_and_a_folded_page_stops_after_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    c_trees = []
    for k in (0, 0, 0, 0, 2):  # the waits are in the last run only
        path = tmp_path / f"run-{len(c_trees)}.json"
        doc = waits(k)
        if k == 0:  # a run that stays live without waiting for input: its model call is left unknown
            doc = unknown_model_call()
        path.write_text(json.dumps(doc))
        ran = agentfold("run", str(path), "--start-id", f"run-{len(c_trees)}", "--json", store=url)
        c_trees.append(json.loads(ran.stdout)["tree_id"])
    store = EventStore(url)
    runtime = Runtime(store, default_sources().catalog())
    try:
        host = Host(runtime)
        assert host.pending() == host.pending(limit=10)
        assert len(host.pending()) == 2 and host.pending(limit=10).next_after is None  # type: ignore[attr-defined]
        # A page that folds no more than 2 runs: the empty runs before the waits take two pages.
        monkeypatch.setattr(queries_module, "FOLD_PAGE_RUNS", 2)
        seen: list[list[str]] = []
        after = None
        while True:
            page = host.pending(limit=10, after=after)
            seen.append(trees_of(page))
            after = page.next_after  # type: ignore[attr-defined]
            if after is None:
                break
        assert seen == [[], [], [c_trees[4]]]
        with pytest.raises(InvalidInput) as refused:
            host.pending(c_trees[4], limit=1)
        assert refused.value.code == "host.page_invalid"
        for bad_limit in (0, -1, True, 1.5):
            with pytest.raises(InvalidInput) as refused:
                host.unknown(limit=bad_limit)  # type: ignore[arg-type]
            assert refused.value.code == "host.page_invalid"
        with pytest.raises(InvalidInput) as refused:
            host.unknown(after="m1")
        assert refused.value.code == "http.cursor_invalid"
        with pytest.raises(InvalidInput) as refused:
            host.pending(after=5)  # type: ignore[arg-type]
        assert refused.value.code == "host.page_invalid"
    finally:
        runtime.close()
        store.close()


def test_a_tables_cursor_met_while_the_read_models_lag_far_behind_is_503_projection_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by a review: this was a 504 http.timeout whose hint spoke of a write taking effect.
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    for i in range(3):
        path = tmp_path / f"run-{i}.json"
        path.write_text(json.dumps(waits(1)))
        ran = agentfold("run", str(path), "--start-id", f"run-{i}", "--json", store=url)
        assert ran.code == 0, ran.stderr  # parked on its wait
        if i == 0:
            assert agentfold("project", "--json", store=url).code == 0  # the tables hold run-0 only
    store = EventStore(url)
    try:
        queries = queries_module.HostQueries(store, default_sources())
        first = queries.pending_page(limit=1)
        assert first.next_after is not None and first.next_after.startswith("m")
        assert len(queries.pending_page(limit=1, after=first.next_after)) == 1  # two runs behind: folded
        monkeypatch.setattr(queries_module, "OVERLAY_LIMIT", 1)
        with pytest.raises(StoreFailure) as behind:
            queries.pending_page(limit=1, after=first.next_after)
        assert behind.value.code == "projection.behind" and "without after" in (behind.value.hint or "")
        assert len(queries.pending_page(limit=5)) == 3  # listed again from the start: by folding
    finally:
        store.close()
