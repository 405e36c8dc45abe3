"""The store-wide InputGates listing and its read-model table, as a user sees them: behaviour
no test defended (a mutation audit of the release that added ``agentfold_rm_input_gates``).

Each test was seen failing with a planted bug: a corrupt run's gate rows left in the table, a
corrupt run missing from ``agentfold gates`` and ``GET /gates`` (exit 0, 200), the table's
columns (``parent_id``, ``created_position``) and rows of a tree the store does not have that
``audit verify`` did not look at, the upgrade fill stopped by one unreadable run or done at the
store's head instead of the version each run row reflects. Real SQLite files, a real follower,
the console script and a real server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.host import Host
from agentfold.adapters.read_models import GATES, ReadModels
from agentfold.domain.ids import TreeID
from agentfold.domain.program import Program
from tests.audit.support import Sql
from tests.http_api.support import problem, start_server
from tests.interaction.support import open_runtime
from tests.interaction.tools import WAIT
from tests.team import programs as P
from tests.team.test_gates_store_wide import cli
from tests.team.test_input_gate import waiting_gate
from tests.test_corrupt_tree_listings import corrupt

ROOT = Path(__file__).resolve().parents[1]


def park(store: EventStore, program: Program, inputs: list[Any], prefix: str) -> list[str]:
    """Start one run per input and return their tree ids once each is idle (its gate waits)."""
    with open_runtime(store, program) as runtime:
        runs = [runtime.start(program, given, start_id=f"{prefix}-{i}") for i, given in enumerate(inputs)]
        for run in runs:
            runtime.wait_idle(run.tree_id, timeout=WAIT)
    return [str(run.tree_id) for run in runs]


def gate_rows(url: str) -> list[tuple[Any, ...]]:
    """What a SQL user reads (docs/read-models.md's query): every gate row, oldest run first."""
    return [tuple(r) for r in Sql(url)._run(
        f"SELECT tree_id, process_id, wait_id, parent_id, body FROM {GATES} ORDER BY created_position, ord")]


def verify_all(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", "--json", "audit", "verify", "--all",
                           "--store", url], capture_output=True, text=True, cwd=ROOT, timeout=120)


def ask_then_finish(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 waits for one InputGate task; turn 2 (its answer) finishes."""
    if turn["number"] == 1:
        return {"mode": "wait", "state": turn["state"],
                "tasks": [{"key": "ask", "worker": "test.gate", "input": "approve?"}]}
    return {"mode": "", "state": turn["state"], "output": "done"}


def test_a_run_that_turns_corrupt_leaves_no_gate_row_and_every_listing_names_it(tmp_path: Path) -> None:
    """docs/read-models.md: a tree the follower cannot read has no row in any other read-model
    table; docs/cli.md#gates and http-api.md: the store-wide listing names it (stderr and
    ``corrupt_trees``, exit 1; ``503 store.corrupt``) and lists every other run's gates."""
    gate = P.gate()
    url = f"sqlite:///{tmp_path / 'gates.db'}"
    store = EventStore(url)
    try:
        trees = park(store, gate, ["a?", "b?", "c?"], "corrupt")
        Follower(store, Catalog([gate])).catch_up()
        with open_runtime(store, gate) as runtime:
            everyone = Host(runtime).gates()
            bad = trees[1]
            # A paused gate still waits (it stays live and listed); its new events are the ones damaged.
            assert runtime.pause(str(waiting_gate(runtime, runtime.capture(TreeID(bad))).process_id))
            runtime.wait_idle(TreeID(bad), timeout=WAIT)
        assert [row[0] for row in gate_rows(url)] == trees  # the follower had a row of each
        corrupt(url, bad)
        Follower(store, Catalog([gate])).catch_up()
        assert [c.tree_id for c in ReadModels(store, create=False).corrupt_trees()] == [bad]
    finally:
        store.close()
    healthy = [g for g in everyone if g["tree_id"] != bad]
    assert [row[0] for row in gate_rows(url)] == [trees[0], trees[2]]  # the corrupt run's row went with it
    listed = cli(url, "gates", "--json", expect=1)
    data = json.loads(listed.stdout)
    assert data["gates"] == healthy and [c["tree_id"] for c in data["corrupt_trees"]] == [bad]
    assert bad in listed.stderr and "store.corrupt" in listed.stderr
    server = start_server(url, tmp_path)
    try:
        body = problem(server.client().get("/gates"), 503, "store.corrupt")
        assert body["gates"] == healthy and [c["tree_id"] for c in body["corrupt_trees"]] == [bad]
    finally:
        server.stop()


def test_a_team_gates_row_columns_say_which_team_started_it_and_audit_checks_them(tmp_path: Path) -> None:
    """docs/read-models.md: ``process_id, wait_id, parent_id`` are the gate, its wait and the
    team that started it; every column the listing orders by (``created_position``) is checked
    by ``audit verify``, and a gate row of a tree the store does not have is reported."""
    program = P.team(ask_then_finish, P.gate())
    url = f"sqlite:///{tmp_path / 'team.db'}"
    store = EventStore(url)
    try:
        (tree,) = park(store, program, ["begin"], "team")
        with open_runtime(store, program) as runtime:
            (entry,) = Host(runtime).gates()
            root = str(runtime.capture(TreeID(tree)).root.process_id)
        assert entry["parent_id"] == root and entry["task"] == "ask"
        Follower(store, Catalog([program])).catch_up()
    finally:
        store.close()
    [(tree_id, process_id, wait_id, parent_id, body)] = gate_rows(url)
    assert (tree_id, process_id, wait_id, parent_id) == (tree, entry["process_id"], entry["wait_id"], root)
    assert json.loads(body) == entry
    assert verify_all(url).returncode == 0
    sql = Sql(url)
    # A row under a tree id the store does not have: `agentfold gates` would list it.
    orphan = str(TreeID.for_start("never-started"))  # type: ignore[arg-type]
    sql._run(f"INSERT INTO {GATES} (tree_id, ord, created_position, process_id, wait_id, parent_id, body) "
             f"SELECT ?, ord, created_position, process_id, wait_id, parent_id, body FROM {GATES} WHERE tree_id = ?",
             (orphan, tree))
    report = verify_all(url)
    assert report.returncode == 1, report.stdout
    results = {r["tree"]: r for r in json.loads(report.stdout)["results"]}
    assert results[tree]["ok"] is True and not results[orphan]["ok"]
    sql._run(f"DELETE FROM {GATES} WHERE tree_id = ?", (orphan,))
    # A created_position the listing pages by, edited with the entry left alone.
    sql._run(f"UPDATE {GATES} SET created_position = created_position + 1000 WHERE tree_id = ?", (tree,))
    report = verify_all(url)
    assert report.returncode == 1, report.stdout
    (result,) = json.loads(report.stdout)["results"]
    assert any(p["rule"] == "read_model.mismatch" and GATES in p["detail"] for p in result["problems"]), result


def test_the_upgrade_fill_skips_a_run_it_cannot_read_and_fills_the_others(tmp_path: Path) -> None:
    """docs/read-models.md: the first follower of the release to open an older store's tables
    creates and fills the InputGates table; a live run whose history cannot be read is left
    without rows (``audit verify`` reports it), and does not stop the follower."""
    gate = P.gate()
    url = f"sqlite:///{tmp_path / 'older.db'}"
    store = EventStore(url)
    try:
        trees = park(store, gate, ["fine?", "damaged?"], "older")
        with open_runtime(store, gate) as runtime:
            fine = Host(runtime).gates(trees[0])
        Follower(store, Catalog([gate])).catch_up()
    finally:
        store.close()
    corrupt(url, trees[1])  # an event the follower had applied
    Sql(url)._run(f"DROP TABLE {GATES}")  # as a release before the table left the tables
    cli(url, "project")  # the next follower: opens, creates, fills
    assert [json.loads(row[4]) for row in gate_rows(url)] == fine
    assert json.loads(cli(url, "gates", "--json").stdout) == {"gates": fine}


def test_the_upgrade_fill_holds_each_runs_gates_as_of_the_version_its_run_row_reflects(tmp_path: Path) -> None:
    """docs/read-models.md: each run is folded at the version its row reflects, so the tables
    a follower has not caught up with still agree with each other (``audit verify``) and the
    run is brought up to date by the follower's next batch."""
    gate = P.gate()
    url = f"sqlite:///{tmp_path / 'behind.db'}"
    store = EventStore(url)
    try:
        (tree,) = park(store, gate, ["answer me?"], "behind")
        Follower(store, Catalog([gate])).catch_up()
        Sql(url)._run(f"DROP TABLE {GATES}")
        with open_runtime(store, gate) as runtime:
            host = Host(runtime)
            (waiting,) = host.gates(tree)
            assert host.answer_gate(waiting["process_id"], waiting["wait_id"], "yes", signal_id="behind-answer")
            assert runtime.result(TreeID(tree), timeout=WAIT).status == "completed"
        ReadModels(store)  # the next follower's first open, before it applies the answer
        assert [json.loads(row[4]) for row in gate_rows(url)] == [waiting]
        report = verify_all(url)
        assert report.returncode == 0, report.stdout
        assert json.loads(cli(url, "gates", "--json").stdout) == {"gates": []}  # the tables' lag is folded
        Follower(store, Catalog([gate])).catch_up()
        assert gate_rows(url) == []
    finally:
        store.close()


def test_gates_with_no_readable_gate_says_so_and_still_fails_for_the_corrupt_run(tmp_path: Path) -> None:
    """docs/cli.md#gates: a live run whose history cannot be read is named (stderr,
    ``corrupt_trees``) and the command exits 1, also when no other run has a gate: "none
    waits" would be a wrong answer about the run that could not be read."""
    gate = P.gate()
    url = f"sqlite:///{tmp_path / 'only.db'}"
    store = EventStore(url)
    try:
        (tree,) = park(store, gate, ["unreadable?"], "only")
    finally:
        store.close()
    corrupt(url, tree)
    listed = cli(url, "gates", expect=1)
    assert "no InputGate waits for an answer in the trees that could be read" in listed.stdout
    assert tree in listed.stderr and "store.corrupt" in listed.stderr
    data = json.loads(cli(url, "gates", "--json", expect=1).stdout)
    assert data["gates"] == [] and [c["tree_id"] for c in data["corrupt_trees"]] == [tree]
