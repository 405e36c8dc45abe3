"""Every run's InputGates that wait for a human, store-wide: ``Host.gates()``, ``agentfold
gates`` without a run, ``GET /gates`` and the read-model table ``agentfold_rm_input_gates``
(docs/team.md, cli.md#gates, http-api.md, read-models.md).

Before, a host learnt of a gate only by asking each run (``gates TREE``): an operator with many
team runs had no way to list what waits for them. Real stores, a real follower, the console
script and a real server.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.host import Host
from agentfold.adapters.queries import HostQueries
from agentfold.adapters.read_models import GATES, ReadModels
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.program import Program
from tests.audit.support import Sql
from tests.http_api.support import ok, start_server
from tests.interaction.support import open_runtime
from tests.interaction.tools import WAIT
from tests.team import programs as P
from tests.team.test_input_gate import waiting_gate

ROOT = Path(__file__).resolve().parents[2]


def cli(store_url: str, *argv: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", *argv, "--store", store_url],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == expect, (done.returncode, done.stdout, done.stderr)
    return done


def park_gates(store: EventStore, gate: Program, requests: list[str], prefix: str) -> list[str]:
    """Start one gate per request and return their tree ids once each waits for its answer."""
    with open_runtime(store, gate) as runtime:
        runs = [runtime.start(gate, request, start_id=f"{prefix}-{i}") for i, request in enumerate(requests)]
        for run in runs:
            waiting_gate(runtime, run)
            runtime.wait_idle(run.tree_id)
    return [str(run.tree_id) for run in runs]


def table_rows(store: EventStore) -> list[dict[str, Any]]:
    return [entry for _, _, _, entry in ReadModels(store, create=False).ordered(GATES)]


def test_every_runs_waiting_gates_are_listed_in_creation_order_and_an_answered_one_leaves_the_list(
    store_url: str,
) -> None:
    gate = P.gate()
    store = EventStore(store_url)
    try:
        trees = park_gates(store, gate, ["first?", "second?", "third?"], "wide")
        with open_runtime(store, gate) as runtime:
            host = Host(runtime)
            listed = host.gates()
            assert [(g["tree_id"], g["request"]) for g in listed] == list(zip(trees, ["first?", "second?", "third?"], strict=True))
            # the same entries as each run's own listing
            assert listed == [g for tree in trees for g in host.gates(tree)]
            first = host.gates(limit=2)
            assert list(first) == listed[:2] and first.next_after is not None  # type: ignore[attr-defined]
            rest = host.gates(limit=2, after=first.next_after)  # type: ignore[attr-defined]
            assert list(rest) == listed[2:] and rest.next_after is None  # type: ignore[attr-defined]
            if store.backend != "memory":
                Follower(store, Catalog([gate])).catch_up()
                assert table_rows(store) == listed  # one row per waiting gate
            answered = listed[0]
            assert host.answer_gate(answered["process_id"], answered["wait_id"], "yes", signal_id="answer-wide-0")
            assert runtime.result(trees[0], timeout=WAIT).status == "completed"
            assert host.gates() == listed[1:]
        if store.backend == "memory":
            return
        # The read model: the follower drops the answered gate's row, and the listing reads them.
        Follower(store, Catalog([gate])).catch_up()
        assert table_rows(store) == listed[1:]
        assert HostQueries(store, ProgramSources()).gates() == listed[1:]
        # The console script binds no gate Program: a gate is told by its wait.
        assert json.loads(cli(store.url, "gates", "--json").stdout) == {"gates": listed[1:]}
        text = cli(store.url, "gates").stdout.splitlines()
        assert [line.split()[:3] for line in text] == [[g["tree_id"], g["process_id"], g["wait_id"]] for g in listed[1:]]
        assert "task None: \"second?\"" in text[0]
    finally:
        store.close()


def test_tables_an_older_follower_wrote_get_their_gates_filled_by_the_next_follower(durable_store_url: str) -> None:
    """The table came with this release: stores whose read models an older follower wrote have
    none, and their parked gates had no row to be listed from. A reader of such tables folds;
    the next follower to open them creates the table and fills it for every live run before
    it applies anything, so a gate waiting since before the upgrade is listed."""
    gate = P.gate()
    store = EventStore(durable_store_url)
    try:
        trees = park_gates(store, gate, ["before the upgrade?", "also before?"], "older")
        with open_runtime(store, gate) as runtime:
            host = Host(runtime)
            ended = host.gates(trees[1])[0]
            assert host.answer_gate(ended["process_id"], ended["wait_id"], "done", signal_id="answer-older-1")
            assert runtime.result(trees[1], timeout=WAIT).status == "completed"
            expected = host.gates()
        assert [g["tree_id"] for g in expected] == trees[:1]
        Follower(store, Catalog([gate])).catch_up()
        Sql(store.url)._run(f"DROP TABLE {GATES}")  # as a release before the table left the tables
        reader = HostQueries(store, ProgramSources())
        assert reader.read_models() is not None and not reader.read_models().has_gates()  # type: ignore[union-attr]
        assert reader.gates() == expected and reader.gates(reader.tree_of(trees[0])) == expected  # by folding
        assert cli(store.url, "audit", "verify", "--all").returncode == 0  # nothing to compare: not a mismatch
        ReadModels(store)  # the next follower's first open
        assert table_rows(store) == expected
        assert HostQueries(store, ProgramSources()).gates() == expected
        assert cli(store.url, "audit", "verify", "--all").returncode == 0
        # A row that says otherwise than the fold is a mismatch audit reports.
        Sql(store.url)._run(f"UPDATE {GATES} SET body = ? WHERE tree_id = ?",
                            (json.dumps({**expected[0], "request": "edited"}), trees[0]))
        report = json.loads(cli(store.url, "audit", "verify", "--all", "--json", expect=1).stdout)
        assert "read_model.mismatch" in json.dumps(report)
    finally:
        store.close()


def _open_at_once(url: str, barrier: Any, answers: Any) -> None:
    """A follower process's first open of the read models, at the instant its peer opens them."""
    store = EventStore(url)
    try:
        barrier.wait(timeout=60)
        ReadModels(store)
        answers.put("opened")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        answers.put(f"{type(exc).__name__}: {exc}")
    finally:
        store.close()


def test_two_followers_opening_an_older_stores_tables_at_once_both_start_and_fill_the_table_once(
    durable_store_url: str,
) -> None:
    """Two followers of this release (``project --follow``, a ``serve``) started together on a
    store an older follower wrote: both create-and-fill the table in the same instant. On SQLite
    one of them failed to start with ``database is locked`` (7 of 8 trials): it read, then wanted
    the write lock another opener had just used. Both start now, and the rows are one set."""
    gate = P.gate()
    store = EventStore(durable_store_url)
    try:
        trees = park_gates(store, gate, ["upgrade 1?", "upgrade 2?", "upgrade 3?"], "both")
        Follower(store, Catalog([gate])).catch_up()
        expected = table_rows(store)
        assert [g["tree_id"] for g in expected] == trees
        fork = multiprocessing.get_context("fork")
        for _ in range(4):  # a race: each trial failed with the fault in 7 of 8
            Sql(store.url)._run(f"DROP TABLE {GATES}")
            barrier, answers = fork.Barrier(2), fork.Queue()
            openers = [fork.Process(target=_open_at_once, args=(store.url, barrier, answers)) for _ in range(2)]
            for opener in openers:
                opener.start()
            for opener in openers:
                opener.join(timeout=120)
            assert sorted(answers.get(timeout=5) for _ in openers) == ["opened", "opened"]
            assert table_rows(store) == expected
    finally:
        store.close()


def test_get_gates_pages_every_runs_waiting_gates(tmp_path: Path) -> None:
    gate = P.gate()
    url = f"sqlite:///{tmp_path / 'gates.db'}"
    store = EventStore(url)
    try:
        trees = park_gates(store, gate, ["one?", "two?", "three?"], "http")
        with open_runtime(store, gate) as runtime:
            expected = Host(runtime).gates()
    finally:
        store.close()
    server = start_server(url, tmp_path)
    try:
        c = server.client()
        entries: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": 1}
        for _ in range(10):
            page = ok(c.get("/gates", params=params))
            assert set(page) == {"gates", "next_after"} and len(page["gates"]) <= 1
            entries += page["gates"]
            if page["next_after"] is None:
                break
            params["after"] = page["next_after"]
        assert entries == expected and [g["tree_id"] for g in entries] == trees
        assert ok(c.get("/gates")) == {"gates": expected, "next_after": None}
        assert httpx.get(server.url + "/gates", timeout=30).status_code == 401  # a token is needed, as for /pending-inputs
    finally:
        code, _ = server.stop()
    assert code == 0
