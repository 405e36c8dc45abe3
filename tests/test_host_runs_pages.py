"""``Host.runs`` pages through every run once, also when the read-model tables appear (or
fall behind) between two pages: its cursors name the path that produced them, as
``GET /runs``'s do. Before, a cursor counted runs when folding and was a creation position
with the tables, so the second page after ``agentfold project`` repeated runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import InvalidInput
from tests.kernel_programs import chain_program

RUNS = 6


def _project(url: str) -> None:
    done = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", "--store", url, "project"],
                          capture_output=True, text=True, timeout=120)
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
