"""Store-wide listings a page at a time (``GET /pending-inputs``, ``GET /runs``, ``Host.pending``,
``Host.runs``): behaviour the mutation audit of paging (2026-12-05, "pages") found undefended.

docs/http-api.md ("Pages") and docs/python.md promise that following ``next_after`` from the
first page lists every entry exactly once, runs in creation order, whole runs only, and that a
tree whose history cannot be read is named (``corrupt``), not dropped. The suite checked that
with tables that were current and with corrupt trees in one unpaged answer; these tests page
(``limit=1``) over runs the tables have not caught up with yet and over a corrupt tree, with and
without read models, on a real SQLite file, through ``Host`` (the same ``HostQueries`` as the
HTTP API); and check that a finished run's damage spoils no listing of live runs and that a cursor
past 64 bits is refused before it reaches SQL.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import agentfold.adapters.queries as queries_module
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import default_sources
from agentfold.domain.ids import TreeID
from tests.test_mutants_reads import in_time, project, start_waiting


def every_page(read: Callable[[str | None], Any]) -> list[Any]:
    """Every page of a listing, following ``next_after`` from the first (each read bounded in time)."""
    pages: list[Any] = []
    after = None
    while True:
        page = in_time(lambda after=after: read(after))
        pages.append(page)
        after = page.next_after
        if after is None:
            return pages
        assert len(pages) < 12, f"paging does not end: {[[e['tree_id'] for e in p] for p in pages]}"


def trees(page: list[dict[str, Any]]) -> list[str]:
    return [str(e["tree_id"]) for e in page]


def damage(db: Path, tree_id: str) -> None:
    """Change one byte of the tree's last event stored uncompressed (its digest chain breaks there)."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT originator_version, state FROM agentfold_events WHERE originator_id=? "
            "ORDER BY originator_version DESC", (TreeID(tree_id).uuid.hex,)).fetchall()
        version, state = next((v, s) for v, s in rows if s[:1] != b"\x01" and b'"timestamp":"2' in s)
        conn.execute("UPDATE agentfold_events SET state=? WHERE originator_id=? AND originator_version=?",
                     (state.replace(b'"timestamp":"2', b'"timestamp":"1', 1), TreeID(tree_id).uuid.hex, version))


def test_pages_of_pending_inputs_list_each_run_started_after_the_tables_position_once(store: EventStore) -> None:
    """Mutant P7 (queries.py ``_table_page``: a run the tables have not caught up with is listed
    when ``created >= after``): a page that ended with such a run (its cursor ``m<its creation>``)
    listed it again on the next page, for ever with ``limit=1``."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        a = start_waiting(runtime, 1, "fresh-a")
        b = start_waiting(runtime, 1, "fresh-b")
        position = project(store)
        c = start_waiting(runtime, 1, "fresh-c")  # after the tables' position: folded at query time
        d = start_waiting(runtime, 1, "fresh-d")
        assert ReadModels(store).position() == position < store.max_notification_id()
        host = Host(runtime, default_sources())
        pages = every_page(lambda after: host.pending(limit=1, after=after))
        assert [trees(p) for p in pages] == [[a], [b], [c], [d]]
        assert all(p.next_after is None or p.next_after.startswith("m") for p in pages)  # the tables' path
        pages = every_page(lambda after: host.runs(limit=1, after=after))
        assert [trees(p) for p in pages] == [[a], [b], [c], [d], []]  # a full page of runs always pages on


@pytest.mark.parametrize("tables", [pytest.param(True, id="read-models"), pytest.param(False, id="folding")])
def test_a_corrupt_tree_is_named_by_exactly_one_page_of_a_paged_listing(
    store: EventStore, db: Path, monkeypatch: pytest.MonkeyPatch, tables: bool
) -> None:
    """Mutant P12 (queries.py ``_table_page``: a corrupt tree named by every page after the
    cursor, not only the one whose range holds it) and P9 (queries.py ``_fold_page``: the
    cursor not moved past a corrupt tree): a client collecting ``corrupt`` page by page was told
    of the same damaged run twice (once before the run listed ahead of it), or (folding, a
    page that stops after its budget of folded runs right after the damaged one) paged for
    ever, each page naming it again."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        a, bad, c, d = (start_waiting(runtime, 1, f"corrupt-{i}") for i in range(4))
    damage(db, bad)
    if tables:
        project(store)  # the follower records the damaged tree and skips it
    else:
        monkeypatch.setattr(queries_module, "FOLD_PAGE_RUNS", 1)  # a page folds one run at most
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        host = Host(runtime, default_sources())
        for read in (lambda after: host.pending(limit=1, after=after),
                     lambda after: host.runs(limit=1, after=after)):
            pages = every_page(read)
            assert [e for p in pages for e in trees(p)] == [a, c, d]
            assert [trees(p.corrupt) for p in pages if p.corrupt] == [[bad]]
            # ... named by the page after the run listed before it (creation order)
            named = next(i for i, p in enumerate(pages) if p.corrupt)
            assert [e for p in pages[:named] for e in trees(p)] == [a]


@pytest.mark.parametrize("tables", [pytest.param(True, id="read-models"), pytest.param(False, id="folding")])
def test_a_filtered_page_that_meets_a_corrupt_run_fills_up_with_runs_that_match_the_filter(
    store: EventStore, db: Path, tables: bool
) -> None:
    """Mutant P17 (queries.py ``HostQueries.runs``, folding: the filters dropped from the index
    read that fills the place of a corrupt run): ``GET /runs?status=waiting`` listed a completed
    run after the damaged one."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        a = start_waiting(runtime, 1, "filter-a")
        bad = start_waiting(runtime, 1, "filter-bad")
        start_waiting(runtime, 0, "filter-done")  # completed: not waiting
        d = start_waiting(runtime, 1, "filter-d")
    damage(db, bad)
    if tables:
        project(store)
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        host = Host(runtime, default_sources())
        page = host.runs(status="waiting", limit=2)
        assert trees(page) == [a, d] and trees(page.corrupt) == [bad]  # type: ignore[attr-defined]
        assert {r["status"] for r in page} == {"waiting"}
        page = host.runs(classification="parked", limit=2)
        assert trees(page) == [a, d] and trees(page.corrupt) == [bad]  # type: ignore[attr-defined]


def test_a_tables_cursor_beyond_64_bits_is_refused_as_a_bad_cursor_by_every_listing(store: EventStore) -> None:
    """Mutant P19 (queries.py ``cursor_number``: 19 digits taken): ``m9999999999999999999``,
    past the 64-bit integers SQL takes, reached the database and raised a bare OverflowError
    (a 500) instead of ``http.cursor_invalid``; 18 digits are a cursor (an empty page)."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        start_waiting(runtime, 1, "cursor-a")
        project(store)
        host = Host(runtime, default_sources())
        for listing in (host.runs, host.pending, host.unknown, host.gates):
            with pytest.raises(queries_module.InvalidInput) as refused:
                listing(limit=1, after="m" + "9" * 19)
            assert refused.value.code == ("host.page_invalid" if listing == host.runs else "http.cursor_invalid")
            assert list(listing(limit=1, after="m" + "9" * 18)) == []


def test_a_run_the_tables_lag_behind_keeps_its_place_in_creation_order_on_every_page(store: EventStore) -> None:
    """Mutant P21 (queries.py ``_table_page``: the rows folded at query time not sorted in with
    the tables' rows): a run created before the tables' last run but changed after their
    position (one of its two waits answered, one still waiting) was listed after the runs
    created later, and on pages of one it was skipped (the cursor was already past it)."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        a = start_waiting(runtime, 2, "order-a")
        b = start_waiting(runtime, 1, "order-b")
        c = start_waiting(runtime, 1, "order-c")
        project(store)
        host = Host(runtime, default_sources())
        first = host.pending(a)[0]
        assert host.answer(first["process_id"], first["wait_id"], {"approved": True}) is True
        runtime.wait_idle(a, timeout=30)
        assert ReadModels(store).position() < store.max_notification_id()  # the tables lag behind run a
        assert [w["tree_id"] for w in host.pending(a)] == [a]  # still waiting on its other call
        assert trees(in_time(host.pending)) == [a, b, c]
        pages = every_page(lambda after: host.pending(limit=1, after=after))
        assert [trees(p) for p in pages] == [[a], [b], [c]]
        assert [e["wait_id"] for p in pages for e in p] == [w["wait_id"] for w in host.pending()]



@pytest.mark.parametrize("tables", [pytest.param(True, id="read-models"), pytest.param(False, id="folding")])
def test_a_finished_run_whose_history_is_damaged_spoils_no_listing_of_live_runs(
    store: EventStore, db: Path, tables: bool
) -> None:
    """Mutant P29 (queries.py ``_relevant_to``: terminal runs kept): with read models, a run that
    had completed long ago and whose stored history was then damaged was named ``corrupt`` by
    every page of the pending inputs, gates and unknown effects (each a ``503 store.corrupt``
    over HTTP) although it can list none; folding reads only the live runs and said nothing.
    ``GET /runs``, which lists finished runs too, still names it."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        waiting = start_waiting(runtime, 1, "done-waiting")
        done = start_waiting(runtime, 0, "done-completed")
        assert runtime.capture(done).classification() == "terminal"
    damage(db, done)
    if tables:
        project(store)  # the follower records the damaged run
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        host = Host(runtime, default_sources())
        for listing in (host.pending, host.unknown, host.gates):
            for page in (listing(), listing(limit=1)):
                assert page.corrupt == []  # type: ignore[attr-defined]
        assert trees(host.pending(limit=1)) == [waiting]
        runs = host.runs()
        assert trees(runs) == [waiting] and trees(runs.corrupt) == [done]  # type: ignore[attr-defined]


def test_a_huge_bad_cursor_is_quoted_cut_at_80_characters(store: EventStore) -> None:
    """Mutant P32 (queries.py ``cursor_invalid``: the cursor quoted whole): a megabyte ``after``
    came back whole in the 422's ``detail`` (docs/http-api.md: "its detail quotes the cursor,
    cut at 80 characters")."""
    huge = "f" + "A" * 1_000_000
    queries = queries_module.HostQueries(store, default_sources())
    for listing in (queries.pending_page, queries.unknown_page, queries.gates_page, queries.runs_page):
        with pytest.raises(queries_module.InvalidInput) as refused:
            listing(limit=1, after=huge)
        assert refused.value.code == "http.cursor_invalid"
        assert repr(huge[:80] + "...") in refused.value.message and len(refused.value.message) < 300


def test_host_runs_quotes_a_huge_bad_argument_cut_short(store: EventStore) -> None:
    """Found by the same audit: ``Host.runs`` quoted a bad ``after`` (or status, classification,
    limit) whole in its ``host.page_invalid`` message, 100 kB for a 100 kB cursor, where the HTTP
    API cuts at 80 characters."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        host = Host(runtime, default_sources())
        huge = "f" + "A" * 100_000
        for arguments in ({"after": huge}, {"status": huge}, {"classification": huge}, {"limit": huge}):
            with pytest.raises(queries_module.InvalidInput) as refused:
                host.runs(**arguments)  # type: ignore[arg-type]
            assert refused.value.code == "host.page_invalid"
            assert "AAAA..." in refused.value.message and len(refused.value.message) < 400, arguments
