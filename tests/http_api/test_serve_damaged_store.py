"""A running server whose SQLite file is damaged under it answers 503 ``store.damaged`` with what to do.

The damage is real: b-tree pages of the store's file overwritten while ``agentfold serve`` runs.
A server keeps answering from SQLite's page cache until the file changes through SQLite, so the
test then makes a harmless change through SQLite (``PRAGMA user_version``, from another
connection: it writes the file's header only): the server's next read transaction discards its
cache and reads the damaged pages, as after any write by another process.

``GET /health`` said ``store.read_failed`` (no hint) while every other request said
``store.damaged`` with what to do: a monitor would have had an operator retry a file that
retrying cannot mend.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.http_api.support import ok, problem, start_server
from tests.test_cli import ROOT, agentfold

PAGE = 4096


def damage_every_page_but_the_schema(db: Path) -> None:
    """Every b-tree page after the first gets an impossible cell count (a disk fault, a bad copy)."""
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the main file, none in the -wal
    data = bytearray(db.read_bytes())
    for page in range(1, len(data) // PAGE):
        data[page * PAGE + 3 : page * PAGE + 5] = b"\xff\xff"
    with db.open("r+b") as f:  # in place: the same file (a replaced file is another fault)
        f.write(bytes(data))
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version = 7")  # the file changes through SQLite (its header only)


def test_a_store_damaged_under_a_running_server_is_503_store_damaged(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    store = f"sqlite:///{db}"
    demo = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")
    assert agentfold("run", demo, "--start-id", "before-damage", store=store).code == 0
    server = start_server(store, tmp_path)
    try:
        c = server.client()
        runs = ok(c.get("/runs"))["runs"]
        assert [r["start_id"] for r in runs] == ["before-damage"]
        tree_id = runs[0]["tree_id"]
        damage_every_page_but_the_schema(db)

        for path in ("/runs", f"/runs/{tree_id}", "/unknown-effects", "/pending-inputs"):
            body = problem(c.get(path), 503, "store.damaged")
            assert "malformed" in body["detail"], body
            assert ".recover" in body["hint"] and "audit verify" in body["hint"], body
        health = c.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["code"] == "store.damaged", health.text
    finally:
        server.stop()


def test_once_a_request_found_the_file_damaged_health_says_so_though_its_own_reads_pass(tmp_path: Path) -> None:
    # Found by a docs walk: with pages damaged that /health's own reads do not touch (its
    # positions), every listing answered 503 store.damaged while /health kept answering 200,
    # and a load balancer kept sending requests to a server whose reads all failed.
    db = tmp_path / "store.db"
    store = f"sqlite:///{db}"
    demo = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")
    assert agentfold("run", demo, "--start-id", "before-damage", store=store).code == 0
    server = start_server(store, tmp_path, "--no-follow")
    try:
        c = server.client()
        assert [r["start_id"] for r in ok(c.get("/runs"))["runs"]] == ["before-damage"]
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            [(root,)] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'agentfold_trees'").fetchall()
        data = bytearray(db.read_bytes())
        start = (root - 1) * PAGE
        data[start + 3 : start + 5] = b"\xff\xff"  # the tree index's page only: an impossible cell count
        with db.open("r+b") as f:
            f.write(bytes(data))
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA user_version = 7")  # the file changes through SQLite: caches are dropped

        assert ok(c.get("/health"))["status"] == "ok"  # its own reads do not touch that page
        body = problem(c.get("/runs"), 503, "store.damaged")
        assert "malformed" in body["detail"], body
        health = problem(c.get("/health"), 503, "store.damaged")
        assert "a request found the store's file damaged" in health["detail"] and "malformed" in health["detail"]
        assert health["hint"] == body["hint"]
        assert problem(c.get("/health"), 503, "store.damaged") == health  # until the server is restarted
    finally:
        server.stop()
