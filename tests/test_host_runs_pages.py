"""``Host.runs`` pages through every run once, also when the read-model tables appear (or
fall behind) between two pages: its cursors name the path that produced them, as
``GET /runs``'s do. Before, a cursor counted runs when folding and was a creation position
with the tables, so the second page after ``agentfold project`` repeated runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import InvalidInput
from tests import forked_cli
from tests.kernel_programs import chain_program

RUNS = 6


def _project(url: str) -> None:
    done = forked_cli.run(["--store", url, "project"], timeout=120)
    assert done.returncode == 0, done.stderr


def test_pages_of_runs_neither_repeat_nor_skip_when_the_tables_appear_between_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pages.db'}"
    store = EventStore(url)
    program = chain_program(name="test.host.pages")
    expected = [f"run-{i}" for i in range(1, RUNS + 1)]
    try:
        with Runtime(store, Catalog([program])) as runtime:
            for start_id in expected:
                runtime.start(program, {"n": 1}, start_id=start_id).result(timeout=30)
            host = Host(runtime)
            first = host.runs(limit=3)  # no tables yet: folded
            assert [r["start_id"] for r in first] == expected[:3]
            assert all(str(r["cursor"]).startswith("f") for r in first)
            _project(url)  # a follower (`serve`, `agentfold project`) creates the tables
            second = host.runs(limit=3, after=first[-1]["cursor"])
            assert [r["start_id"] for r in first + second] == expected
            assert host.runs(limit=3, after=second[-1]["cursor"]) == []
            # From the tables, from the start: `m` cursors, the same runs in the same order.
            table_first = host.runs(limit=4)
            assert all(str(r["cursor"]).startswith("m") for r in table_first)
            table_second = host.runs(limit=4, after=table_first[-1]["cursor"])
            assert [r["start_id"] for r in table_first + table_second] == expected
            assert host.runs(after=0) == host.runs()  # 0: the first page, as earlier releases took it
            for bad in ("3", "x1", 3, -1):
                with pytest.raises(InvalidInput) as refused:
                    host.runs(after=bad)  # type: ignore[arg-type]
                assert refused.value.code == "host.page_invalid"
            assert [r["start_id"] for r in host.runs(classification="terminal")] == expected
            assert host.runs(classification="parked") == []
            with pytest.raises(InvalidInput):
                host.runs(classification="done")
    finally:
        store.close()


def test_a_run_whose_history_cannot_be_read_is_named_not_dropped(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "corrupt.db"
    store = EventStore(f"sqlite:///{path}")
    program = chain_program(name="test.host.pages.corrupt")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            trees = [runtime.start(program, {"n": 1}, start_id=f"r{i}").tree_id for i in range(3)]
            for tree in trees:
                runtime.result(tree, timeout=30)
        damaged = trees[1]
        with sqlite3.connect(path) as conn:  # one byte of its last event, as tests/test_corrupt_tree_listings.py does
            version, state = conn.execute(
                "SELECT originator_version, state FROM agentfold_events WHERE originator_id=? "
                "ORDER BY originator_version DESC LIMIT 1", (damaged.uuid.hex,)).fetchone()
            assert state[:1] != b"\x01"
            conn.execute("UPDATE agentfold_events SET state=? WHERE originator_id=? AND originator_version=?",
                         (state.replace(b'"timestamp":"2', b'"timestamp":"1', 1), damaged.uuid.hex, version))
        with Runtime(store, Catalog([program])) as runtime:
            page = Host(runtime).runs()
            assert [e["start_id"] for e in page] == ["r0", "r2"]
            assert [e["start_id"] for e in page.corrupt] == ["r1"]  # type: ignore[attr-defined]
    finally:
        store.close()


def test_a_page_limit_beyond_what_sql_takes_is_every_entry_not_an_overflow(tmp_path: Path) -> None:
    # Found by a review of the Host API: a positive limit past SQLite's 64-bit integers raised a
    # bare OverflowError (runs from 2**63; unknown and pending from 2**63-1, and only once the
    # store had read-model tables, since the tables are asked for limit + 1 rows).
    url = f"sqlite:///{tmp_path / 'pages.db'}"
    store = EventStore(url)
    program = chain_program(name="test.host.pages")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            for i in range(1, 4):
                runtime.start(program, {"n": 1}, start_id=f"run-{i}").result(timeout=30)
            host = Host(runtime)
            for projected in (False, True):
                if projected:
                    _project(url)
                for limit in (2**63 - 1, 2**63, 10**30):
                    assert [r["start_id"] for r in host.runs(limit=limit)] == ["run-1", "run-2", "run-3"], limit
                    assert host.unknown(limit=limit) == [] and host.pending(limit=limit) == [], limit
    finally:
        store.close()
