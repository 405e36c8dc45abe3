"""Helpers for the audit tests: recorded runs on real stores, plain-SQL tampering, in-process CLI runs."""

from __future__ import annotations

import json
import sqlite3
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.cli import main
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import PROGRAM_NAME, scenario_program
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.program import Program
from tests.kernel_programs import chain_program
from tests.test_cli import Ran, agentfold, ok

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"


def cli(capsys: pytest.CaptureFixture[str], *argv: str, sources: ProgramSources | None = None) -> Ran:
    """Run ``agentfold ARGV`` in this process (so counters in ``sources`` can be read afterwards)."""
    capsys.readouterr()
    code = main(list(argv), sources=sources)
    out, err = capsys.readouterr()
    return Ran(code, out, err)


def chain_sources(*programs: Program) -> ProgramSources:
    return ProgramSources(programs=programs or (chain_program(),))


def record_chain(url: str, n: int = 3, start_id: str = "audit-chain") -> TreeID:
    """A completed chain run (n dispatcher effects), recorded by a real Runtime."""
    program = chain_program()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"n": n}, start_id=StartID(start_id))
            assert handle.result(timeout=60).status == "completed"
            return handle.tree_id
    finally:
        store.close()


def record_demo(directory: Path, store: str, start_id: str | None = None, *, answer: bool = True) -> TreeID:
    """The bundled trip-planner scenario (two tool rounds, a human input wait), run with the CLI.

    Its tools append one line per real execution to ``directory/side-effects.jsonl``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    scenario = directory / "demo.json"
    doc = json.loads(DEMO.read_text())
    doc["side_effect_log"] = "side-effects.jsonl"  # relative to the scenario file
    scenario.write_text(json.dumps(doc))
    args = ["run", str(scenario), "--json"] + (["--start-id", start_id] if start_id else [])
    tree_id = TreeID(ok(agentfold(*args, store=store)).json()["tree_id"])
    if answer:
        (pending,) = ok(agentfold("pending", "--json", store=store)).json()["pending"]
        ok(agentfold("answer", pending["process_id"], pending["wait_id"], '{"approved": true}', store=store))
    return tree_id


class CountingSources:
    """Scenario Programs whose every dispatcher call is counted (model and tools alike)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.programs: list[Program] = []

    def _load(self, document: Any) -> Program:
        program = scenario_program(document)
        for bound in program.walk():
            dispatcher = bound.dispatcher
            if dispatcher is None:
                continue
            original = dispatcher.dispatch
            name = bound.ref.name

            def counted(request: Any, context: Any, _call: Callable[..., Any] = original, _name: str = name) -> Any:
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _call(request, context)

            dispatcher.dispatch = counted
        self.programs.append(program)
        return program

    def sources(self) -> ProgramSources:
        return ProgramSources(loaders={PROGRAM_NAME: self._load})

    def model_requests(self) -> int:
        return sum(len(p.dispatcher.model.requests) for p in self.programs if hasattr(p.dispatcher, "model"))


# ---------------------------------------------------------------------------
# Plain SQL on the agentfold tables


class Sql:
    """Direct SQL on a store's tables, as a tamperer (or an operator with psql) would do it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite = url.startswith("sqlite:///")

    def _run(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.sqlite:
            conn = sqlite3.connect(self.url.removeprefix("sqlite:///"))
            try:
                rows = conn.execute(statement, params).fetchall()
                conn.commit()
                return rows
            finally:
                conn.close()
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            cursor = conn.execute(statement.replace("?", "%s"), params)
            return cursor.fetchall() if cursor.description else []

    def _id(self, tree_id: TreeID) -> Any:
        return tree_id.uuid.hex if self.sqlite else tree_id.uuid

    def raw_rows(self, tree_id: TreeID) -> list[tuple[int, str, bytes]]:
        """The rows as stored: a state is JSON, or 0x01 + raw DEFLATE of it (docs/events.md)."""
        found = self._run(
            "SELECT originator_version, topic, state FROM agentfold_events WHERE originator_id = ? "
            "ORDER BY originator_version",
            (self._id(tree_id),),
        )
        return [(int(v), str(t), bytes(s)) for v, t, s in found]

    def rows(self, tree_id: TreeID) -> list[tuple[int, str, bytes]]:
        """The rows with each state's JSON (inflated with zlib where it is stored compressed, as
        a tamperer would); writing JSON back is a valid stored form."""
        return [(v, t, zlib.decompress(s[1:], -15) if s[:1] == b"\x01" else s) for v, t, s in self.raw_rows(tree_id)]

    def state(self, tree_id: TreeID, position: int) -> bytes:
        return next(s for v, _, s in self.rows(tree_id) if v == position)

    def set_row(self, tree_id: TreeID, position: int, topic: str, state: bytes) -> None:
        self._run(
            "UPDATE agentfold_events SET topic = ?, state = ? WHERE originator_id = ? AND originator_version = ?",
            (topic, state, self._id(tree_id), position),
        )

    def delete(self, tree_id: TreeID, *positions: int) -> None:
        for position in positions:
            self._run(
                "DELETE FROM agentfold_events WHERE originator_id = ? AND originator_version = ?",
                (self._id(tree_id), position),
            )

    def insert(self, tree_id: TreeID, position: int, topic: str, state: bytes) -> None:
        self._run(
            "INSERT INTO agentfold_events (originator_id, originator_version, topic, state) VALUES (?, ?, ?, ?)",
            (self._id(tree_id), position, topic, state),
        )

    def set_head(self, tree_id: TreeID, version: int, digest: str) -> None:
        self._run(
            "UPDATE agentfold_trees SET version = ?, head_digest = ? WHERE tree_id = ?", (version, digest, str(tree_id))
        )

    def head(self, tree_id: TreeID) -> tuple[int, str]:
        ((version, digest),) = self._run(
            "SELECT version, head_digest FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),)
        )
        return int(version), str(digest)

    def count(self, table: str) -> int:
        return int(self._run(f"SELECT count(*) FROM {table}")[0][0])

    def tables(self) -> set[str]:
        if self.sqlite:
            return {r[0] for r in self._run("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return {r[0] for r in self._run("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}

    def update_body(self, table: str, tree_id: TreeID, body: Any) -> None:
        self._run(f"UPDATE {table} SET body = ? WHERE tree_id = ?", (json.dumps(body), str(tree_id)))

    def body(self, table: str, tree_id: TreeID) -> Any:
        ((body,),) = self._run(f"SELECT body FROM {table} WHERE tree_id = ?", (str(tree_id),))
        return json.loads(body)


def digest_of_state(state: bytes) -> str:
    """The recorded digest of a stored state (``{"digest":"sha256:<64 hex>",...``)."""
    return state[len(b'{"digest":"') : len(b'{"digest":"') + 71].decode()


def append_past_index_row(url: str, tree_id: TreeID) -> int:
    """Append by hand, past the end the tree's index row anchors, a copy of the tree's last event
    chained correctly from it (a forger who can compute the chain but left the row alone).
    Returns its position."""
    store = EventStore(url, create=False)
    try:
        last = store.read(tree_id)[-1]
        record, _ = store.mapper.encode(
            tree_id, tree_id.uuid, last.position + 1, last.event, "2026-12-01T00:00:00Z", last.digest
        )
    finally:
        store.close()
    Sql(url).insert(tree_id, last.position + 1, record.topic, record.state)
    return last.position + 1
