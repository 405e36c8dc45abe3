#!/usr/bin/env python3
"""Durable-execution overhead benchmark: peer systems on one agent-like workload.

Copied from the team's shared bench (shared/bench/peers_bench.py) with one more system,
agentfold (run_agentfold); run it from an environment where agentfold is installed
(e.g. pip install -e . into the peers' venv).

Workload ("R-round tool loop"): a scripted zero-latency "model" and a
zero-latency "tool".  Each round the model returns an assistant message with
one tool call, the tool returns a result of B bytes of text, and both are
appended to the conversation, which therefore grows every round.  After R
rounds the model returns a final answer (2R+2 messages in all).

Systems are plain functions ``run_<name>(R, B, backend, pg_url) -> dict`` that
do ONE run on a fresh database / thread / workflow id and return at least
``{"seconds": <timed part>, "n_messages": <2R+2>}`` (``Timer`` gives
"seconds" and "cpu_seconds").  Optional keys, totals over the timed part of
the run (the harness divides them by R):

    cpu_seconds    CPU time of this process, all threads (the DB server's
                   CPU is not included)
    write_commits  durable write transactions.  PG: WAL fsyncs
                   (pg_stat_wal.wal_sync delta; with synchronous_commit=on and
                   one client every write commit flushes WAL once; cluster-
                   wide, so exact only on the throwaway server).  SQLite:
                   COMMITs that followed a write, counted client-side.
    xacts          PG only: xact_commit delta of the run's own database
                   (includes read-only and background transactions)
    rows_written   rows inserted+updated+deleted (PG: pg_stat_database tup_*;
                   SQLite: sqlite3 total_changes, counted client-side)
    wal_bytes      PG WAL bytes generated (pg_stat_wal.wal_bytes; cluster-wide)
and, at the end of the run:
    stored_bytes   bytes on disk (PG: pg_total_relation_size of the run's
                   tables incl. indexes/TOAST; SQLite: file size incl. -wal)
    stored_bytes_before  the same just before the timed part (after setup)
    payload_bytes  sum of row payload sizes (PG pg_column_size(row), SQLite
                   sum(length(col)))
    rows_stored    rows in the run's tables at the end
    tables         per-table {rows, payload_bytes[, total_bytes]}

A function may raise ``Skip("reason")`` for a backend it does not support.
To add a system: write ``run_<name>`` and append a ``System`` to ``SYSTEMS``.

Run ``python peers_bench.py --help`` for options; see README.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import json
import os
import platform
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit


class Skip(Exception):
    """Raised by a run_<name> function for a backend it cannot run."""


# --------------------------------------------------------------------------
# Workload: scripted model and tool, shared by every system.
# --------------------------------------------------------------------------

@functools.cache
def tool_payload(round_idx: int, B: int) -> str:
    """B bytes of deterministic, poorly compressible ASCII text, unique per round.

    Cached, so that the "tool" costs the same (nothing) in every system."""
    rng = random.Random(1_000_003 * round_idx + B)
    raw = rng.getrandbits(8 * (B + 3)).to_bytes(B + 3, "little")
    return base64.b64encode(raw).decode("ascii")[:B]


def model_call(messages, R: int) -> dict:
    """Zero-latency scripted model.  `messages` is the conversation so far
    (user message first, then assistant/tool pairs); only its length is used."""
    done = (len(messages) - 1) // 2
    if done < R:
        return {"role": "assistant", "content": "",
                "tool_calls": [{"id": f"call_{done}", "name": "fetch",
                                "args": {"round": done}}]}
    return {"role": "assistant", "content": f"final answer after {R} rounds",
            "tool_calls": []}


def tool_call(call: dict, B: int) -> dict:
    """Zero-latency tool: returns B bytes of text."""
    return {"role": "tool", "tool_call_id": call["id"],
            "content": tool_payload(call["args"]["round"], B)}


USER_MSG = {"role": "user", "content": "Please investigate the thing, using the tool."}


# --------------------------------------------------------------------------
# Helpers: fresh databases, counters, storage.
# --------------------------------------------------------------------------

WORKDIR = os.path.join(tempfile.gettempdir(), "peers_bench_work")  # set by --workdir
KEEP = False  # set by --keep: keep run databases / files
_seq = iter(range(1, 1 << 30))


def url_with_db(url: str, db: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, "/" + db, p.query, p.fragment))


def _pg_admin(pg_url: str):
    import psycopg
    return psycopg.connect(pg_url, autocommit=True)


@contextlib.contextmanager
def fresh_pg_db(pg_url: str, tag: str):
    """Create an empty database on the server at pg_url; yield its URL; drop it."""
    name = f"pb_{tag}_{os.getpid()}_{next(_seq)}"
    with _pg_admin(pg_url) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url_with_db(pg_url, name), name
    finally:
        if not KEEP:
            with _pg_admin(pg_url) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class PgCounters:
    """Server-side counters for one database (+ cluster-wide WAL stats).

    PostgreSQL backends publish their statistics when they go idle (at most
    ~1 s late) and when they exit; snapshot() waits for that."""

    def __init__(self, pg_url: str, dbname: str):
        self.pg_url, self.dbname = pg_url, dbname
        self.before: dict | None = None

    def _read(self) -> dict:
        with _pg_admin(self.pg_url) as c:
            c.execute("SELECT pg_stat_clear_snapshot()")
            x = c.execute(
                "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, numbackends "
                "FROM pg_stat_database WHERE datname = %s", (self.dbname,)).fetchone()
            w = c.execute("SELECT wal_sync, wal_bytes FROM pg_stat_wal").fetchone()
        return {"xacts": x[0], "rows_written": x[1] + x[2] + x[3], "backends": x[4],
                "write_commits": int(w[0]), "wal_bytes": int(w[1])}

    def settle(self, timeout: float = 2.5) -> dict:
        """Wait until the database has no backends, or its counters have
        been still for 1.2 s (idle backends flush within ~1 s), or timeout
        (a system with background polling never goes still)."""
        t0 = time.monotonic()
        last, still_since = self._read(), time.monotonic()
        while time.monotonic() - t0 < timeout:
            if last["backends"] == 0:
                time.sleep(0.05)
                return self._read()
            time.sleep(0.2)
            cur = self._read()
            keys = ("xacts", "rows_written")
            if any(cur[k] != last[k] for k in keys):
                still_since = time.monotonic()
            elif time.monotonic() - still_since >= 1.2:
                return cur
            last = cur
        return last

    def start(self):
        self.before = self.settle()

    def stop(self) -> dict:
        after = self.settle()
        return {k: after[k] - self.before[k]
                for k in ("xacts", "rows_written", "write_commits", "wal_bytes")}


def pg_storage(db_url: str, schemas=None) -> dict:
    """Sizes and row counts of the user tables in the database at db_url."""
    import psycopg
    tables, total, payload, rows = {}, 0, 0, 0
    with psycopg.connect(db_url, autocommit=True) as c:
        rels = c.execute(
            "SELECT schemaname, relname, pg_total_relation_size(relid) "
            "FROM pg_stat_user_tables ORDER BY 1, 2").fetchall()
        for sch, rel, size in rels:
            if schemas and sch not in schemas:
                continue
            n, pl = c.execute(
                f'SELECT count(*), coalesce(sum(pg_column_size(t.*)), 0) '
                f'FROM "{sch}"."{rel}" t').fetchone()
            tables[f"{sch}.{rel}"] = {"rows": n, "payload_bytes": int(pl),
                                      "total_bytes": int(size)}
            total += size
            payload += int(pl)
            rows += n
    return {"stored_bytes": total, "payload_bytes": payload,
            "rows_stored": rows, "tables": tables}


def fresh_sqlite_path(tag: str) -> str:
    os.makedirs(WORKDIR, exist_ok=True)
    return os.path.join(WORKDIR, f"{tag}_{os.getpid()}_{next(_seq)}.sqlite")


def sqlite_storage(path: str) -> dict:
    """File size (db + -wal + -journal if present) and per-table payload."""
    stored = sum(os.path.getsize(p) for p in (path, path + "-wal", path + "-journal")
                 if os.path.exists(p))
    tables, payload, rows = {}, 0, 0
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = [r[0] for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type='table' "
            "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        for t in names:
            cols = [r[1] for r in con.execute(f'PRAGMA table_info("{t}")')]
            expr = " + ".join(f'coalesce(length("{c}"), 0)' for c in cols) or "0"
            n, pl = con.execute(f'SELECT count(*), coalesce(sum({expr}), 0) FROM "{t}"').fetchone()
            tables[t] = {"rows": n, "payload_bytes": int(pl)}
            payload += int(pl)
            rows += n
    finally:
        con.close()
    return {"stored_bytes": stored, "payload_bytes": payload, "rows_stored": rows,
            "tables": tables}


def cleanup_sqlite(path: str):
    if KEEP:
        return
    for p in (path, path + "-wal", path + "-shm", path + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


class SqliteTraceCounter:
    """Counts write commits and changed rows on one sqlite3.Connection."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn, self.commits, self._dirty = conn, 0, False
        self._changes0 = conn.total_changes
        conn.set_trace_callback(self._cb)

    def _cb(self, sql: str):
        head = sql.lstrip()[:7].upper()
        if head.startswith(("INSERT", "UPDATE", "DELETE", "REPLACE")):
            self._dirty = True
        elif head.startswith("COMMIT"):
            if self._dirty:
                self.commits += 1
            self._dirty = False

    def result(self) -> dict:
        self.conn.set_trace_callback(None)
        return {"write_commits": self.commits,
                "rows_written": self.conn.total_changes - self._changes0}


class SAWriteCounter:
    """Counts write commits and changed rows on every SQLAlchemy engine
    (class-level events), for systems that use SQLAlchemy internally."""

    _installed = False
    commits = 0
    rows_written = 0
    active = False

    @classmethod
    def install(cls):
        if cls._installed:
            return
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        def _changes(conn):
            dbapi = getattr(conn.connection, "dbapi_connection", None)
            return getattr(dbapi, "total_changes", None)  # sqlite3 only

        # sqlite3: rows changed = total_changes delta from begin to commit
        # (per statement would miss INSERT/UPDATE ... RETURNING, whose changes
        # are only counted once the statement has been stepped to its end).
        @event.listens_for(Engine, "begin")
        def _begin(conn):
            conn.info["pb_tc0"] = _changes(conn)
            conn.info["pb_rc"] = 0

        # other drivers: sum cursor.rowcount of DML statements
        @event.listens_for(Engine, "after_cursor_execute")
        def _after(conn, cursor, statement, params, context, executemany):
            if statement.lstrip()[:7].upper().startswith(
                    ("INSERT", "UPDATE", "DELETE", "REPLACE")):
                conn.info["pb_rc"] = conn.info.get("pb_rc", 0) + max(
                    getattr(cursor, "rowcount", 0) or 0, 0)

        @event.listens_for(Engine, "commit")
        def _commit(conn):
            tc0, tc1 = conn.info.pop("pb_tc0", None), _changes(conn)
            n = tc1 - tc0 if tc0 is not None and tc1 is not None else conn.info.get("pb_rc", 0)
            conn.info["pb_rc"] = 0
            if cls.active and n > 0:
                cls.commits += 1
                cls.rows_written += n

        cls._installed = True

    @classmethod
    def reset(cls):
        cls.commits = cls.rows_written = 0
        cls.active = True

    @classmethod
    def result(cls) -> dict:
        cls.active = False
        return {"write_commits": cls.commits, "rows_written": cls.rows_written}


class Timer:
    """Wall time and this process's CPU time (all its threads) of a block."""

    def __enter__(self):
        self._w0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._w0
        self.cpu_seconds = time.process_time() - self._c0

    def result(self) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds}


# --------------------------------------------------------------------------
# System 1: baseline -- the loop in plain Python, no persistence.
# --------------------------------------------------------------------------

def run_baseline(R: int, B: int, backend: str, pg_url: str | None) -> dict:
    with Timer() as t:
        messages = [dict(USER_MSG)]
        while True:
            msg = model_call(messages, R)
            messages.append(msg)
            if not msg["tool_calls"]:
                break
            messages.append(tool_call(msg["tool_calls"][0], B))
    return {**t.result(), "n_messages": len(messages)}


# --------------------------------------------------------------------------
# System 2: LangGraph StateGraph (add_messages), durability="sync".
# --------------------------------------------------------------------------

@functools.cache
def _langgraph_builder(R: int, B: int):
    from typing import Annotated, TypedDict

    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    # functional form: class-body annotations would be strings here
    # (from __future__ import annotations) and could not see the local imports
    State = TypedDict("State", {"messages": Annotated[list, add_messages]})

    def model_node(state):
        d = model_call(state["messages"], R)
        return {"messages": [AIMessage(content=d["content"], tool_calls=d["tool_calls"])]}

    def tool_node(state):
        call = state["messages"][-1].tool_calls[0]
        d = tool_call({"id": call["id"], "args": call["args"]}, B)
        return {"messages": [ToolMessage(content=d["content"], tool_call_id=d["tool_call_id"])]}

    def route(state):
        return "tool" if state["messages"][-1].tool_calls else END

    g = StateGraph(State)
    g.add_node("model", model_node)
    g.add_node("tool", tool_node)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", route, ["tool", END])
    g.add_edge("tool", "model")
    return g


def _langgraph_invoke(graph, R: int) -> dict:
    cfg = {"configurable": {"thread_id": str(uuid.uuid4())},
           "recursion_limit": 2 * R + 10}
    with Timer() as t:
        out = graph.invoke({"messages": [dict(USER_MSG)]}, cfg, durability="sync")
    return {**t.result(), "n_messages": len(out["messages"])}


def run_langgraph(R: int, B: int, backend: str, pg_url: str | None) -> dict:
    builder = _langgraph_builder(R, B)
    if backend == "none":  # no checkpointer: framework cost without persistence
        graph = builder.compile()
        with Timer() as t:
            out = graph.invoke({"messages": [dict(USER_MSG)]},
                               {"recursion_limit": 2 * R + 10})
        return {**t.result(), "n_messages": len(out["messages"])}

    if backend == "postgres":
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row
        with fresh_pg_db(pg_url, "lg") as (db_url, dbname):
            kw = dict(autocommit=True, prepare_threshold=0, row_factory=dict_row)
            with psycopg.connect(db_url, **kw) as conn:  # migrations, not timed
                PostgresSaver(conn).setup()
            before = pg_storage(db_url)["stored_bytes"]
            ctr = PgCounters(pg_url, dbname)
            ctr.start()
            with psycopg.connect(db_url, **kw) as conn:
                graph = builder.compile(checkpointer=PostgresSaver(conn))
                run = _langgraph_invoke(graph, R)
            res = {**run, **ctr.stop(),
                   "stored_bytes_before": before}
            res.update(pg_storage(db_url))
            return res

    if backend == "sqlite":
        from langgraph.checkpoint.sqlite import SqliteSaver
        path = fresh_sqlite_path("lg")
        try:
            conn = sqlite3.connect(path, check_same_thread=False)
            saver = SqliteSaver(conn)
            saver.setup()  # creates tables, sets journal_mode=WAL; not timed
            graph = builder.compile(checkpointer=saver)
            before = sqlite_storage(path)["stored_bytes"]
            ctr = SqliteTraceCounter(conn)
            run = _langgraph_invoke(graph, R)
            res = {**run, **ctr.result(),
                   "stored_bytes_before": before}
            conn.close()  # checkpoints the WAL into the main file
            res.update(sqlite_storage(path))
            return res
        finally:
            cleanup_sqlite(path)

    raise Skip(f"unknown backend {backend}")


# --------------------------------------------------------------------------
# System 3: DBOS workflow whose model and tool calls are @DBOS.step()s.
# --------------------------------------------------------------------------

@functools.cache
def _dbos_app():
    """Register the DBOS workflow and steps once (before the first DBOS())."""
    from dbos import DBOS

    @DBOS.step()
    def pb_model_step(messages: list, R: int) -> dict:
        return model_call(messages, R)

    @DBOS.step()
    def pb_tool_step(call: dict, B: int) -> dict:
        return tool_call(call, B)

    @DBOS.workflow()
    def pb_agent_workflow(R: int, B: int) -> dict:
        messages = [dict(USER_MSG)]
        while True:
            msg = pb_model_step(messages, R)
            messages.append(msg)
            if not msg["tool_calls"]:
                break
            messages.append(pb_tool_step(msg["tool_calls"][0], B))
        return {"final": msg["content"], "n_messages": len(messages)}

    return pb_agent_workflow


def _dbos_run_once(sysdb_url: str, R: int, B: int, before_timed: Callable[[], None]):
    from dbos import DBOS, SetWorkflowID
    wf = _dbos_app()
    SAWriteCounter.install()
    DBOS.destroy()
    DBOS(config={"name": "peers-bench", "system_database_url": sysdb_url,
                 "log_level": "WARNING"})
    DBOS.launch()  # migrations, recovery, background threads: not timed
    try:
        before_timed()
        SAWriteCounter.reset()
        with Timer() as t, SetWorkflowID(f"pb-{uuid.uuid4()}"):
            out = wf(R, B)
        client = SAWriteCounter.result()
    finally:
        DBOS.destroy()
    return {**t.result(), "n_messages": out["n_messages"]}, client


def run_dbos(R: int, B: int, backend: str, pg_url: str | None) -> dict:
    if backend == "postgres":
        with fresh_pg_db(pg_url, "dbos") as (db_url, dbname):
            ctr, before = PgCounters(pg_url, dbname), {}

            def before_timed():
                before["stored_bytes_before"] = pg_storage(db_url)["stored_bytes"]
                ctr.start()
            run, client = _dbos_run_once(db_url, R, B, before_timed)
            res = {**run, **ctr.stop(), **before,
                   "client_write_commits": client["write_commits"]}
            res.update(pg_storage(db_url))
            return res
    if backend == "sqlite":
        try:
            from dbos import _sys_db_sqlite  # noqa: F401  (SQLite system DB support)
        except ImportError as e:
            raise Skip(f"installed DBOS has no SQLite system database ({e})")
        path = fresh_sqlite_path("dbos")
        try:
            before = {}

            def before_timed():
                before["stored_bytes_before"] = sqlite_storage(path)["stored_bytes"]
            run, client = _dbos_run_once(f"sqlite:///{path}", R, B, before_timed)
            res = {**run, **client, **before}
            res.update(sqlite_storage(path))
            return res
        finally:
            cleanup_sqlite(path)
    raise Skip(f"unknown backend {backend}")


# --------------------------------------------------------------------------
# System 4: agentfold -- an event-sourced Interaction (model + Tool child per call).
# --------------------------------------------------------------------------

def _agentfold_program(R: int, B: int):
    """The same workload as an agentfold Interaction: the scripted model and tool above."""
    import json as _json

    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.tools import ToolOutput

    class LoopModel:
        def call(self, request):
            # model_call() only looks at the conversation length; ours has the same shape.
            d = model_call(list(request.messages), R)
            message = {"role": "assistant"}
            if d["content"]:
                message["content"] = d["content"]
            if d["tool_calls"]:
                message["tool_calls"] = [
                    {"id": c["id"], "name": c["name"], "arguments": _json.dumps(c["args"])} for c in d["tool_calls"]
                ]
                return {"message": message, "finish_reason": "tool_calls"}
            return {"message": message, "finish_reason": "stop"}

    class Fetch:
        name = "fetch"
        description = "Fetch the thing for one round."
        parameters = {"type": "object", "properties": {"round": {"type": "integer"}}}

        def call(self, invocation, arguments):
            d = tool_call({"id": invocation.call.id, "args": arguments}, B)
            return ToolOutput.text(d["content"])

    model = LoopModel()
    program = compile_interaction(InteractionConfig(name="peers.bench", model=model, tools=[Fetch()]))
    return program


def _agentfold_timed(url: str, R: int, B: int, before_timed: Callable[[], None]) -> dict:
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.runtime import Runtime

    store = EventStore(url)  # creates tables: not timed
    program = _agentfold_program(R, B)
    runtime = Runtime(store, poll_interval=0)
    try:
        before_timed()
        with Timer() as t:
            result = runtime.start(program, {"messages": [{"role": "user", "content": USER_MSG["content"]}]}).result(600)
        if result.status != "completed":
            raise RuntimeError(f"agentfold run ended {result.status}: {result.termination}")
        calls = result.output["model_calls"]
        # user + (assistant, tool) per round + the final assistant message
        n_messages = 1 + 2 * (calls - 1) + 1
        return {**t.result(), "n_messages": n_messages, "client_write_commits": runtime.appends,
                "events": runtime.events_appended}
    finally:
        runtime.close()
        store.close()


def run_agentfold(R: int, B: int, backend: str, pg_url: str | None) -> dict:
    try:
        import agentfold.adapters.runtime  # noqa: F401
    except ImportError as e:
        raise Skip(f"agentfold is not installed in this environment ({e}); pip install -e <agentfold checkout>")
    if backend == "postgres":
        with fresh_pg_db(pg_url, "af") as (db_url, dbname):
            ctr, before = PgCounters(pg_url, dbname), {}

            def before_timed():
                before["stored_bytes_before"] = pg_storage(db_url)["stored_bytes"]
                ctr.start()
            run = _agentfold_timed(db_url, R, B, before_timed)
            res = {**run, **ctr.stop(), **before}
            res.update(pg_storage(db_url))
            return res
    if backend == "sqlite":
        path = fresh_sqlite_path("af")
        try:
            before = {}

            def before_timed():
                before["stored_bytes_before"] = sqlite_storage(path)["stored_bytes"]
            run = _agentfold_timed(f"sqlite:///{path}", R, B, before_timed)
            res = {**run, **before, "write_commits": run["client_write_commits"]}
            res.update(sqlite_storage(path))
            return res
        finally:
            cleanup_sqlite(path)
    raise Skip(f"unknown backend {backend}")


# --------------------------------------------------------------------------
# Registry.  Add a system here: System("name", run_name, ["postgres", ...]).
# --------------------------------------------------------------------------

@dataclass
class System:
    name: str
    fn: Callable[[int, int, str, str | None], dict]
    backends: list = field(default_factory=lambda: ["none"])


SYSTEMS: list[System] = [
    System("baseline", run_baseline, ["none"]),
    System("langgraph", run_langgraph, ["none", "postgres", "sqlite"]),
    System("dbos", run_dbos, ["postgres", "sqlite"]),
    System("agentfold", run_agentfold, ["postgres", "sqlite"]),
]


# --------------------------------------------------------------------------
# Throwaway PostgreSQL server.
# --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bindir(explicit: str | None) -> str:
    if explicit:
        return explicit
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    with contextlib.suppress(Exception):
        return subprocess.run(["pg_config", "--bindir"], capture_output=True,
                              text=True, check=True).stdout.strip()
    sys.exit("cannot find initdb: pass --pg-bindir or --pg-url")


class ThrowawayPostgres:
    """initdb + pg_ctl start on 127.0.0.1:<free port>, fsync on (default)."""

    def __init__(self, bindir: str, parent: str, user: str = "postgres",
                 extra_conf: list[str] = ()):
        self.bindir, self.extra = bindir, list(extra_conf)
        self.as_root = os.geteuid() == 0
        self.dir = tempfile.mkdtemp(prefix="peers_bench_pg_", dir=parent)
        if self.as_root:
            shutil.chown(self.dir, user, user)
            self.prefix = ["runuser", "-u", user, "--"]
        else:
            self.prefix = []
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args):
        subprocess.run(self.prefix + [os.path.join(self.bindir, args[0]), *args[1:]],
                       check=True, stdout=subprocess.DEVNULL)

    def start(self):
        data = os.path.join(self.dir, "data")
        self._run("initdb", "-D", data, "-U", "postgres", "-A", "trust",
                  "-E", "UTF8", "--locale=C.UTF-8")
        opts = " ".join([f"-c listen_addresses=127.0.0.1 -p {self.port}",
                         f"-c unix_socket_directories={self.dir}", *self.extra])
        self._run("pg_ctl", "-D", data, "-l", os.path.join(self.dir, "server.log"),
                  "-w", "-o", opts, "start")
        self.data = data
        return self.url

    def stop(self):
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


def pg_server_info(pg_url: str) -> dict:
    with _pg_admin(pg_url) as c:
        info = {"version": c.execute("SHOW server_version").fetchone()[0]}
        for s in ("fsync", "synchronous_commit", "wal_sync_method",
                  "full_page_writes", "autovacuum", "shared_buffers"):
            info[s] = c.execute(f"SHOW {s}").fetchone()[0]
    return info


# --------------------------------------------------------------------------
# Harness.
# --------------------------------------------------------------------------

PER_ROUND_KEYS = ("write_commits", "xacts", "rows_written", "wal_bytes",
                  "client_write_commits")
END_KEYS = ("stored_bytes", "stored_bytes_before", "payload_bytes", "rows_stored")


def p90(xs):
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[8]


def measure(sysm: System, backend: str, R: int, B: int, pg_url, warmup: int,
            runs: int) -> dict:
    for _ in range(warmup):
        sysm.fn(R, B, backend, pg_url)
    per_run = []
    for _ in range(runs):
        r = sysm.fn(R, B, backend, pg_url)
        if r.get("n_messages") != 2 * R + 2:
            raise RuntimeError(f"{sysm.name}/{backend}: {r.get('n_messages')} "
                               f"messages, expected {2 * R + 2}")
        per_run.append(r)
    ms = [1000 * r["seconds"] / R for r in per_run]
    cpu = [1000 * r["cpu_seconds"] / R for r in per_run if "cpu_seconds" in r]
    out = {"system": sysm.name, "backend": backend, "R": R, "B": B, "runs": len(ms),
           "ms_per_round_median": statistics.median(ms), "ms_per_round_p90": p90(ms),
           "ms_per_round_all": ms}
    if cpu:
        out["cpu_ms_per_round_median"] = statistics.median(cpu)
    for k in PER_ROUND_KEYS:
        vals = [r[k] for r in per_run if k in r]
        if vals:
            out[f"{k}_per_round"] = statistics.median(vals) / R
    for k in END_KEYS:
        vals = [r[k] for r in per_run if k in r]
        if vals:
            out[k] = statistics.median(vals)
    if "stored_bytes" in out and "stored_bytes_before" in out:
        out["stored_bytes_growth"] = out["stored_bytes"] - out["stored_bytes_before"]
    if "tables" in per_run[-1]:
        out["tables_last_run"] = per_run[-1]["tables"]
    return out


COLUMNS = [  # header, key, scale, format
    ("system", "system", None, ""), ("backend", "backend", None, ""), ("R", "R", None, ""),
    ("ms/rnd", "ms_per_round_median", 1, ".3f"), ("p90", "ms_per_round_p90", 1, ".3f"),
    ("ovh ms/rnd", "overhead_ms_per_round", 1, ".3f"),
    ("cpu ms/rnd", "cpu_ms_per_round_median", 1, ".3f"),
    ("wcommit/rnd", "write_commits_per_round", 1, ".2f"),
    ("xact/rnd", "xacts_per_round", 1, ".2f"),
    ("rows wr/rnd", "rows_written_per_round", 1, ".2f"),
    ("WAL KB/rnd", "wal_bytes_per_round", 1 / 1024, ".1f"),
    ("stored KB", "stored_bytes", 1 / 1024, ".0f"),
    ("grew KB", "stored_bytes_growth", 1 / 1024, ".0f"),
    ("payload KB", "payload_bytes", 1 / 1024, ".0f"),
    ("rows", "rows_stored", 1, ".0f"),
]


def fmt_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append([str(r[k]) for _, k, _, _ in COLUMNS[:3]] + ["skipped: " + r["skipped"]])
            continue
        cells = []
        for _, k, scale, spec in COLUMNS:
            v = r.get(k)
            cells.append("-" if v is None else
                         str(v) if scale is None else format(v * scale, spec))
        lines.append(cells)
    hdr = [h for h, _, _, _ in COLUMNS]
    widths = [max([len(hdr[i])] + [len(l[i]) for l in lines if len(l) == len(hdr)])
              for i in range(len(hdr))]
    out = ["  ".join(h.rjust(w) for h, w in zip(hdr, widths))]
    for l in lines:
        if len(l) != len(hdr):  # skipped row
            out.append("  ".join(x.rjust(w) for x, w in zip(l[:3], widths)) + "  " + l[3])
        else:
            out.append("  ".join(x.rjust(w) for x, w in zip(l, widths)))
    return "\n".join(out)


def reference_loop_seconds(repeat=3):
    """Best of ``repeat`` runs of 10,000,000 additions at a module's top level, as ``python3 -c``
    runs them (scripts/bench's "reference loop"): this VM's speed varies by day, and absolute
    ms per round compare across days through it."""
    code = compile("total = 0\nfor i in range(10_000_000):\n    total += i\n", "<reference loop>", "exec")
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        exec(code, {})
        best = min(best, time.perf_counter() - t0)
    return best


def versions() -> dict:
    from importlib import metadata
    v = {"python": platform.python_version(), "platform": platform.platform(),
         "cpus": os.cpu_count()}
    for p in ("langgraph", "langgraph-checkpoint", "langgraph-checkpoint-postgres",
              "langgraph-checkpoint-sqlite", "langchain-core", "dbos", "psycopg",
              "SQLAlchemy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            v[p] = metadata.version(p)
    v["sqlite"] = sqlite3.sqlite_version
    return v


def main(argv=None):
    global WORKDIR, KEEP
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", "-R", type=int, default=50, help="rounds R (default 50)")
    ap.add_argument("--bytes", "-B", type=int, default=1024,
                    help="tool result size B in bytes (default 1024)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs (default 1)")
    ap.add_argument("--long-rounds", type=int, default=200,
                    help="R of the extra growth run, 0 to skip (default 200)")
    ap.add_argument("--long-runs", type=int, default=1,
                    help="measured runs at --long-rounds (default 1, no warm-up)")
    ap.add_argument("--systems", default="",
                    help="comma list of system or system/backend to run (default all)")
    ap.add_argument("--pg-url", default=None,
                    help="use this existing server (needs CREATEDB; WAL counters are "
                         "then cluster-wide and may include other traffic)")
    ap.add_argument("--pg-bindir", default=None,
                    help="PostgreSQL bin dir for the throwaway server "
                         "(default: where initdb is on PATH, else pg_config --bindir)")
    ap.add_argument("--pg-conf", action="append", default=[],
                    help="extra '-c name=value' for the throwaway server (repeatable)")
    ap.add_argument("--workdir", default=WORKDIR,
                    help=f"folder for SQLite files and the throwaway server (default {WORKDIR})")
    ap.add_argument("--keep", action="store_true", help="keep run databases and files")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "peers_bench.json"),
                    help="JSON results file (default /tmp/peers_bench.json)")
    a = ap.parse_args(argv)
    WORKDIR, KEEP = a.workdir, a.keep
    os.makedirs(WORKDIR, exist_ok=True)

    wanted = [s for s in a.systems.split(",") if s]

    def selected(sysm, be):
        return not wanted or sysm.name in wanted or f"{sysm.name}/{be}" in wanted

    plan = [(s, be) for s in SYSTEMS for be in s.backends if selected(s, be)]
    needs_pg = any(be == "postgres" for _, be in plan)

    server, pg_url = None, a.pg_url
    if needs_pg and not pg_url:
        server = ThrowawayPostgres(_pg_bindir(a.pg_bindir), tempfile.gettempdir(),
                                   extra_conf=[f"-c {c}" for c in a.pg_conf])
        pg_url = server.start()
        print(f"started throwaway PostgreSQL on {pg_url}", flush=True)
    results, skipped = [], []
    try:
        meta = {"versions": versions(), "args": vars(a), "reference_loop_s": [reference_loop_seconds()],
                "postgres": pg_server_info(pg_url) if needs_pg else None,
                "pg_server": "throwaway" if server else ("--pg-url" if needs_pg else None)}
        baseline_ms = {}
        configs = [(a.rounds, a.warmup, a.runs)]
        if a.long_rounds:
            configs.append((a.long_rounds, 0, a.long_runs))
        for R, warm, runs in configs:
            for sysm, be in plan:
                label = f"{sysm.name}/{be} R={R}"
                print(f"running {label} ...", end=" ", flush=True)
                try:
                    t0 = time.monotonic()
                    row = measure(sysm, be, R, a.bytes, pg_url, warm, runs)
                    print(f"{row['ms_per_round_median']:.4f} ms/round "
                          f"({time.monotonic() - t0:.1f}s)", flush=True)
                except (Skip, ImportError) as e:  # a peer not installed here is skipped, not fatal
                    if isinstance(e, ImportError):
                        e = Skip(f"{e.name or e} is not installed in this environment")
                    row = {"system": sysm.name, "backend": be, "R": R, "skipped": str(e)}
                    skipped.append(f"{label}: {e}")
                    print(f"SKIPPED: {e}", flush=True)
                if sysm.name == "baseline" and "skipped" not in row:
                    baseline_ms[R] = row["ms_per_round_median"]
                results.append(row)
        for row in results:
            if "skipped" not in row and row["R"] in baseline_ms:
                row["overhead_ms_per_round"] = row["ms_per_round_median"] - baseline_ms[row["R"]]
        meta["reference_loop_s"].append(reference_loop_seconds())
    finally:
        if server:
            server.stop()
            print("stopped throwaway PostgreSQL", flush=True)

    print()
    print(f"B={a.bytes} bytes per tool result; {a.warmup} warm-up + {a.runs} runs at "
          f"R={a.rounds}" + (f", {a.long_runs} run(s) at R={a.long_rounds}" if a.long_rounds else ""))
    if meta["postgres"]:
        p = meta["postgres"]
        print(f"PostgreSQL {p['version']} ({meta['pg_server']}): fsync={p['fsync']} "
              f"synchronous_commit={p['synchronous_commit']} wal_sync_method={p['wal_sync_method']}")
    if len(meta["reference_loop_s"]) == 2:
        before, after = meta["reference_loop_s"]
        print(f"reference loop (10^7 Python additions at top level, best of 3): {before:.2f} s before the "
              f"systems ran, {after:.2f} s after (compare other days' ms per round through it)")
    print(fmt_table(results))
    for s in skipped:
        print("skipped:", s)
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
