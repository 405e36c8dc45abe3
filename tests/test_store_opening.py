"""Opening a store from the command line: bad URLs, unreachable servers, empty databases,
read-only roles, and a standalone follower whose sessions are terminated (docs/cli.md,
"Options every command accepts" and "project"; docs/read-models.md).

Every test runs the ``agentfold`` CLI as a real subprocess against real stores: SQLite
files and PostgreSQL databases of the server named by AGENTFOLD_TEST_PG (fresh per test).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import psycopg
import pytest

from agentfold.adapters.cli import CREATING_COMMANDS
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.sources import default_sources
from agentfold.domain.errors import NotFound
from agentfold.domain.ids import TreeID
from agentfold.projections.read_models import project_tree
from tests.conftest import require_postgres
from tests.streams import expect_line, read_both
from tests.test_cli import ROOT, Ran, agentfold, ok, refused

DEMO = ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"
FAST = 15.0  # seconds: the pool's wait was 30 s; a direct connection fails at once or within 10 s


def canon(value: object) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def failed(ran: Ran) -> Ran:
    """Exit status 1 with exactly one line on stderr and nothing on stdout."""
    assert ran.code == 1, f"exit {ran.code}\nstdout: {ran.stdout}\nstderr: {ran.stderr}"
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert ran.stdout == ""
    return ran


def timed(*args: str, store: str, env: dict[str, str] | None = None) -> tuple[Ran, float]:
    started = time.monotonic()
    ran = agentfold(*args, "--json", store=store, env=env)
    return ran, time.monotonic() - started


def pg_server(url: str) -> tuple[str, str]:
    """(host, port) of a PostgreSQL URL."""
    host_port = url.split("@", 1)[1].split("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    return host, port


def agentfold_objects(url: str) -> list[str]:
    """agentfold's tables and functions in a database's public schema."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'agentfold%' ORDER BY 1"
        )]
        functions = [r[0] for r in conn.execute(
            "SELECT proname FROM pg_proc WHERE proname LIKE 'agentfold%' ORDER BY 1"
        )]
    return tables + functions


# ---------------------------------------------------------------------------
# 1. Malformed PostgreSQL URLs


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://postgres@127.0.0.1:notaport/ops", "has no valid port"),
        ("postgresql://postgres:hunter2secret@127.0.0.1:99999/ops", "has no valid port"),
        ("postgresql://[::1:5432/x", "IPv6 address in [brackets]"),
        ("postgresql://u:hunter2/secret@db.example/ops", "has no valid port"),  # an unencoded '/'
        ("postgresql://postgres@127.0.0.1:0/ops", "has no valid port"),
    ],
)
def test_a_malformed_postgresql_url_is_refused_as_url_invalid_without_showing_its_password(
    url: str, reason: str
) -> None:
    ran = refused(agentfold("trees", "--json", store=url))
    error = ran.error()
    assert error["code"] == "store.url_invalid"
    assert reason in error["message"]
    assert "postgresql://user:password@host:port/dbname" in error["hint"]
    assert "hunter2" not in ran.stderr
    text = refused(agentfold("trees", store=url))
    assert text.stderr.startswith("agentfold: error: store.url_invalid: ")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        # Found by a security review: the catch-all refusal quoted the URL as given.
        ("postgresql+psycopg://alice:hunter2secret@127.0.0.1:5432/ops", "unsupported store URL"),
        (" postgresql://alice:hunter2secret@127.0.0.1:5432/ops", "unsupported store URL"),
        ("postgresql:/alice:hunter2secret@127.0.0.1:5432/ops", "unsupported store URL"),
        ("postgres:alice:hunter2secret@127.0.0.1/ops", "unsupported store URL"),
        ("alice:hunter2secret@127.0.0.1/ops", "unsupported store URL"),
        # libpq ends a value at a NUL: "hs%00ec" connected to the default socket's "hs".
        ("postgresql://alice:hunter2secret@127.0.0.1:5432/hs%00ec", "has a NUL character"),
        ("postgresql://al%00ice:hunter2secret@127.0.0.1:5432/ops", "has a NUL character"),
    ],
)
def test_any_refused_store_url_hides_its_password(url: str, reason: str) -> None:
    ran = refused(agentfold("trees", "--json", store=url))
    error = ran.error()
    assert error["code"] == "store.url_invalid" and reason in error["message"], error
    assert "hunter2" not in ran.stderr and ":***@" in error["message"], error


def test_a_store_url_scheme_in_capitals_names_the_same_store(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "calls.jsonl"), "--json",
                 store=f"sqlite:///{path}"))
    listed = ok(agentfold("trees", "--json", store=f"SQLite:///{path}")).json()
    assert len(listed["trees"]) == 1


# ---------------------------------------------------------------------------
# 2. URL parameters are refused, and libpq's environment variables do apply


@pytest.mark.parametrize("suffix", ["?mode=ro", "?", "#main"])
@pytest.mark.parametrize("command", [("trees",), ("kernel-demo-run", "--side-effect-log", "/dev/null")])
def test_sqlite_url_parameters_are_refused_and_create_no_file(tmp_path: Path, suffix: str, command: tuple[str, ...]) -> None:
    # They used to become part of the file name: "runs.db?mode=ro" was created, writable.
    ran = refused(agentfold(*command, "--json", store=f"sqlite:///{tmp_path / 'runs.db'}{suffix}"))
    error = ran.error()
    assert error["code"] == "store.url_invalid"
    assert "takes none" in error["message"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", ["?sslmode=require", "?", "#main", "?sslmode=verify-full&password=hunter2"])
def test_url_parameters_are_refused_instead_of_silently_dropped(pg_database: str, suffix: str) -> None:
    ran = refused(agentfold("trees", "--json", store=pg_database + suffix))
    error = ran.error()
    assert error["code"] == "store.url_invalid"
    assert "does not pass on" in error["message"]
    assert "PGSSLMODE" in error["hint"] and "PGCONNECT_TIMEOUT" in error["hint"]
    assert "hunter2" not in ran.stderr


def test_libpq_environment_variables_apply_to_the_store_connections(pg_database: str) -> None:
    # verify-full with a root certificate that does not exist can never connect: against a
    # server without TLS ("SSL was required"), and against one with TLS (no root to verify
    # with). Without the variables the same command succeeds: libpq read them.
    ok(agentfold("run", str(DEMO), "--start-id", "trip", store=pg_database))
    env = {"PGSSLMODE": "verify-full", "PGSSLROOTCERT": "/nonexistent/agentfold-root.crt"}
    ran, seconds = timed("trees", store=pg_database, env=env)
    error = failed(ran).error()
    assert error["code"] == "store.unavailable"
    assert "SSL" in error["message"] or "certificate" in error["message"], error
    assert "PGSSLMODE" in error["hint"]
    assert seconds < FAST
    assert ok(agentfold("trees", "--json", store=pg_database, env={"PGSSLMODE": "disable"})).json()["trees"]


# ---------------------------------------------------------------------------
# 3. Connection failures: at once, classified, with the server's reason


def test_a_database_that_does_not_exist_is_store_not_found_at_once(pg_database: str) -> None:
    missing = pg_database.rsplit("/", 1)[0] + "/no_such_db_" + uuid.uuid4().hex[:8]
    ran, seconds = timed("trees", store=missing)
    error = refused(ran).error()
    assert error["code"] == "store.not_found"
    assert re.search(r'database "no_such_db_[0-9a-f]{8}" does not exist', error["message"]), error
    assert "CREATE DATABASE" in error["hint"]
    assert seconds < FAST


def test_a_login_the_server_refuses_is_store_unavailable_with_its_reason_and_no_password(pg_database: str) -> None:
    host, port = pg_server(pg_database)
    role = "no_such_role_" + uuid.uuid4().hex[:8]
    url = f"postgresql://{role}:hunter2secret@{host}:{port}/{pg_database.rsplit('/', 1)[1]}"
    ran, seconds = timed("trees", store=url)
    error = failed(ran).error()
    assert error["code"] == "store.unavailable"
    assert f'role "{role}" does not exist' in error["message"]
    assert "user and password" in error["hint"]
    assert "hunter2secret" not in ran.stderr and ":***@" in error["message"]
    assert seconds < FAST


def test_a_refused_connection_is_store_unavailable_with_the_reason_at_once() -> None:
    # A port nobody listens on: bound (not listening) for the whole call, so that no other
    # process, e.g. a server of a test in another worker, can take it meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        ran, seconds = timed("trees", store=f"postgresql://postgres@127.0.0.1:{port}/ops")
    error = failed(ran).error()
    assert error["code"] == "store.unavailable"
    assert "Connection refused" in error["message"]
    assert seconds < FAST


def test_an_unresolvable_host_is_store_unavailable_with_the_reason() -> None:
    ran, seconds = timed("trees", store="postgresql://postgres@no-such-host.invalid:5432/ops")
    error = failed(ran).error()
    assert error["code"] == "store.unavailable"
    assert "no-such-host.invalid" in error["message"] and "resolve" in error["message"]
    assert seconds < FAST


def test_a_server_that_never_answers_is_given_up_after_pgconnect_timeout() -> None:
    # The socket listens but nobody accepts or answers: libpq waits for the server's reply
    # to its startup packet until the connect timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        ran, seconds = timed("trees", store=f"postgresql://postgres@127.0.0.1:{port}/ops",
                             env={"PGCONNECT_TIMEOUT": "2"})
    error = failed(ran).error()
    assert error["code"] == "store.unavailable"
    assert "timeout" in error["message"]
    assert "at most 2 s" in error["hint"]
    assert 1.5 < seconds < 10


# ---------------------------------------------------------------------------
# 4. Only the commands that create a store create one


NOT_CREATING = [
    ("trees",), ("show", "trip"), ("unknown",), ("pending",), ("results", "trip"),
    ("delegates", "process:" + "0" * 32), ("recover",), ("cancel", "process:" + "0" * 32),
    ("audit", "verify", "--all"), ("export", "trip", "--out", os.devnull), ("project",),
    ("publish", "--bootstrap", "127.0.0.1:1", "--topic", "t", "--once"),
]


def test_commands_that_do_not_create_refuse_an_empty_postgresql_database_and_create_nothing(
    pg_database: str,
) -> None:
    for argv in NOT_CREATING:
        error = refused(agentfold(*argv, "--json", store=pg_database)).error()
        assert error["code"] == "store.not_found", (argv, error)
        assert "none of its tables" in error["message"]
        assert "`run`, `kernel-demo-run`, `import` and `serve` create a new store" in error["hint"]
    assert agentfold_objects(pg_database) == []


def test_commands_that_do_not_create_refuse_a_sqlite_file_without_a_store_and_change_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    for argv in NOT_CREATING[:4]:
        error = refused(agentfold(*argv, "--json", store=f"sqlite:///{empty}")).error()
        assert error["code"] == "store.not_found", (argv, error)
    assert empty.stat().st_size == 0
    missing = tmp_path / "user:name@missing.db"  # shown as it is: a file name has no password
    error = refused(agentfold("trees", "--json", store=f"sqlite:///{missing}")).error()
    assert error["code"] == "store.not_found" and "does not exist" in error["message"]
    assert f"sqlite:///{missing}" in error["message"]
    assert not missing.exists()


def test_the_commands_that_create_a_store_create_it_in_an_empty_database(pg_database: str, tmp_path: Path) -> None:
    source = f"sqlite:///{tmp_path / 'source.db'}"
    ok(agentfold("run", str(DEMO), "--start-id", "trip", store=source))
    exported = tmp_path / "trip.jsonl"
    exported.write_text(ok(agentfold("export", "trip", store=source)).stdout)
    admin = require_postgres()
    base = admin.rsplit("/", 1)[0]
    created: list[str] = []
    try:
        for argv in (("run", str(DEMO), "--start-id", "trip"), ("import", str(exported)),
                     ("kernel-demo-run", "--side-effect-log", str(tmp_path / "log.jsonl"))):
            name = "t_" + uuid.uuid4().hex[:16]
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            created.append(name)
            ok(agentfold(*argv, store=f"{base}/{name}"))
            assert "agentfold_events" in agentfold_objects(f"{base}/{name}"), argv
            assert len(ok(agentfold("trees", "--json", store=f"{base}/{name}")).json()["trees"]) == 1
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            for name in created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_python_api_creates_by_default_and_not_with_create_false(pg_database: str) -> None:
    with pytest.raises(NotFound) as refused_open:
        EventStore(pg_database, create=False)
    assert refused_open.value.code == "store.not_found"
    assert agentfold_objects(pg_database) == []
    EventStore(pg_database).close()
    assert "agentfold_events" in agentfold_objects(pg_database)
    store = EventStore(pg_database, create=False)
    assert store.heads() == []
    store.close()


def test_a_store_missing_some_of_its_tables_is_refused_naming_them(pg_database: str) -> None:
    ok(agentfold("run", str(DEMO), "--start-id", "trip", store=pg_database))
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("DROP TABLE agentfold_snapshots")
    error = refused(agentfold("trees", "--json", store=pg_database)).error()
    assert error["code"] == "store.not_found"
    assert "agentfold_snapshots" in error["message"] and "missing" in error["message"]
    assert "agentfold_snapshots" not in agentfold_objects(pg_database)


@pytest.fixture
def reader_role(pg_database: str) -> Iterator[str]:
    """A login role that may only read the store's tables; yields its URL."""
    role = "reader_" + uuid.uuid4().hex[:8]
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        conn.execute('REVOKE CREATE ON SCHEMA public FROM PUBLIC')  # as PostgreSQL 15+ does by default
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"')
    host, port = pg_server(pg_database)
    yield f"postgresql://{role}@{host}:{port}/{pg_database.rsplit('/', 1)[1]}"
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


@pytest.fixture
def readable_store(pg_database: str) -> str:
    """A store with a parked run and current read models."""
    ok(agentfold("run", str(DEMO), "--start-id", "trip", store=pg_database))
    ok(agentfold("project", store=pg_database))
    return pg_database


def test_a_read_only_role_runs_the_read_commands_on_an_existing_store(readable_store: str, reader_role: str) -> None:
    before = agentfold_objects(readable_store)
    owner = ok(agentfold("pending", "--json", store=readable_store)).json()
    [pending] = owner["pending"]
    assert ok(agentfold("pending", "--json", store=reader_role)).json() == owner
    assert [t["start_id"] for t in ok(agentfold("trees", "--json", store=reader_role)).json()["trees"]] == ["trip"]
    shown = ok(agentfold("show", "trip", "--json", store=reader_role)).json()
    assert shown == ok(agentfold("show", "trip", "--json", store=readable_store)).json()
    ok(agentfold("unknown", store=reader_role))
    ok(agentfold("results", "trip", store=reader_role))
    ok(agentfold("delegates", pending["process_id"], store=reader_role))
    ok(agentfold("audit", "verify", "--all", store=reader_role))
    ok(agentfold("audit", "drift", "trip", store=reader_role))
    ok(agentfold("replay", "trip", "--at", "10", store=reader_role))
    assert ok(agentfold("export", "trip", store=reader_role)).stdout == ok(
        agentfold("export", "trip", store=readable_store)).stdout
    assert agentfold_objects(readable_store) == before


def test_a_writer_role_that_may_not_install_the_append_function_is_told_what_to_do(
    readable_store: str, reader_role: str,
) -> None:
    # A database an earlier release created lacks this release's append function; a writing role
    # without CREATE on the schema got only "permission denied for schema public" (upgrade review).
    with psycopg.connect(readable_store, autocommit=True) as conn:
        conn.execute("DROP FUNCTION agentfold_append_checked")  # as a database of an earlier release
        role = reader_role.split("://", 1)[1].split("@", 1)[0]
        conn.execute(f'GRANT INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO "{role}"')
    [pending] = ok(agentfold("pending", "--json", store=readable_store)).json()["pending"]
    before = ok(agentfold("export", "trip", store=readable_store)).stdout
    ran = agentfold("--json", "answer", pending["process_id"], pending["wait_id"], '{"approved": true}',
                    store=reader_role)
    assert ran.code == 1, ran.stderr
    error = ran.error()
    assert error["code"] == "store.append_failed", error
    assert "agentfold_append_checked" in error["message"] and "CREATE" in error["message"], error
    assert ok(agentfold("export", "trip", store=readable_store)).stdout == before  # nothing written


# ---------------------------------------------------------------------------
# 5. `project --follow` keeps going when its sessions are terminated


def assert_rows_equal_folding(store: EventStore, models: ReadModels, tree_ids: list[str]) -> None:
    """Each tree's read-model rows are exactly what folding its history gives."""
    from agentfold.adapters.queries import HostQueries

    folding = HostQueries(store, default_sources(), use_read_models=False)
    for tree_id in tree_ids:
        tree, programs = folding.fold(TreeID(tree_id))
        assert canon(models.tree_rows(tree_id)) == canon(project_tree(tree, programs).to_json()), tree_id


def test_project_follow_survives_terminated_postgresql_sessions_without_gaps_or_duplicates(
    pg_database: str,
) -> None:
    url = pg_database
    ok(agentfold("run", str(DEMO), "--start-id", "before", store=url))
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    env["PYTHONPATH"] = str(ROOT)
    follower = subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "--store", url, "project", "--follow", "--poll-interval", "0.05"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    out, err = read_both(follower)
    stdout: list[str] = []
    stderr: list[str] = []
    try:
        expect_line(out, "following", 30, stdout)
        # Its LISTEN session is opened just after that line: ending the sessions before would
        # leave it only pooled ones, whose failures eventsourcing retries without a word.
        deadline = time.monotonic() + 30
        while True:
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'"
                ).fetchone()
            if row is not None and row[0] >= 1:
                break
            assert time.monotonic() < deadline, "the follower never started listening"
            time.sleep(0.05)
        with psycopg.connect(url, autocommit=True) as conn:
            killed = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        assert killed is not None and killed[0] >= 1
        failure = expect_line(err, "following failed", 15, stderr)
        assert failure.startswith("agentfold: project: following failed: ") and "retrying in" in failure
        expect_line(err, "following again from position", 30, stderr)
        assert follower.poll() is None, "the follower exited"

        ok(agentfold("run", str(DEMO), "--start-id", "after", store=url))
        store = EventStore(url, create=False)
        try:
            models = ReadModels(store, create=False)
            total = store.max_notification_id()
            assert models.wait_for(total, timeout=30), f"read models stuck at {models.position()} of {total}"
            counters = models.counters()
            assert set(counters) == {str(TreeID.for_start(s)) for s in ("before", "after")}  # type: ignore[arg-type]
            for tree_id, (version, applied) in counters.items():
                assert version == applied, f"{tree_id}: {applied} events applied for version {version}"
            assert_rows_equal_folding(store, models, list(counters))
        finally:
            store.close()
        assert follower.poll() is None, "the follower exited"
    finally:
        follower.send_signal(signal.SIGTERM)
        follower.wait(timeout=60)
    time.sleep(0.2)  # let the reader threads drain the pipes
    while not out.empty():
        stdout.append(out.get())
    assert follower.returncode == 0, (stdout, stderr)
    assert re.search(r"stopped at position \d+ after \d+ event\(s\) \(\d+ store failure\(s\) retried\)", stdout[-1])


# ---------------------------------------------------------------------------
# 6. The documentation names exactly the commands that create a store


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (("run", str(DEMO), "--start-id", "bad id"), "identity.invalid"),
        (("run", str(DEMO), "--start-id", "tree:abc"), "identity.invalid"),  # would read as a tree id
        (("kernel-demo-run", "--side-effect-log", "/dev/null", "--start-id", "bad id"), "identity.invalid"),
        (("kernel-demo-run", "--side-effect-log", "/dev/null", "--start-id", "process:x"), "identity.invalid"),
    ],
)
def test_a_run_refused_for_its_start_creates_no_store(tmp_path: Path, argv: tuple[str, ...], code: str) -> None:
    # Found by an error-code audit: the start id was checked only once the store was created
    # (exit 2 says "nothing was appended, and nothing was created").
    ran = refused(agentfold(*argv, "--json", store=f"sqlite:///{tmp_path / 'runs.db'}"))
    assert ran.error()["code"] == code
    assert list(tmp_path.iterdir()) == []


def test_exactly_the_documented_commands_create_a_missing_sqlite_file(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    sentence = re.search(r"created only by ((?:`[a-z-]+`(?:, | and )?)+)", doc)
    assert sentence is not None, "docs/cli.md no longer says which commands create a store"
    assert tuple(re.findall(r"`([a-z-]+)`", sentence.group(1))) == CREATING_COMMANDS

    source = f"sqlite:///{tmp_path / 'source.db'}"
    ok(agentfold("run", str(DEMO), "--start-id", "trip", store=source))
    exported = tmp_path / "trip.jsonl"
    exported.write_text(ok(agentfold("export", "trip", store=source)).stdout)
    creating = {
        "run": ("run", str(DEMO), "--start-id", "trip"),
        "kernel-demo-run": ("kernel-demo-run", "--side-effect-log", str(tmp_path / "log.jsonl")),
        "import": ("import", str(exported)),
    }
    for name, argv in creating.items():
        path = tmp_path / f"{name}.db"
        ok(agentfold(*argv, store=f"sqlite:///{path}"))
        assert path.exists(), name

    # serve: listens, prints its address, stops on SIGTERM; the file exists by then.
    path = tmp_path / "serve.db"
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    env.update({"PYTHONPATH": str(ROOT), "AGENTFOLD_API_TOKEN": "t" * 32})
    server = subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "--store", f"sqlite:///{path}", "serve", "--port", "0", "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert server.stdout is not None
        assert "listening" in json.loads(server.stdout.readline())
        assert path.exists()
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)

    for argv in NOT_CREATING:
        path = tmp_path / "never.db"
        refused(agentfold(*argv, store=f"sqlite:///{path}"))
        assert not path.exists(), argv


def test_appends_index_and_read_model_reads_go_on_after_the_pooled_sessions_are_terminated(pg_database: str) -> None:
    # A server restart, a failover or pg_terminate_backend ends every pooled session. The
    # next use of each dead connection failed once, and an append that met one stopped its
    # tree (store.append_failed). Our own queries now retry like eventsourcing's do.
    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.runtime import Runtime
    from tests.kernel_programs import chain_program

    program = chain_program(name="test.reconnect")
    store = EventStore(pg_database)
    runtime = Runtime(store, Catalog([program]))
    try:
        before = runtime.start(program, {"n": 3}, start_id="before").result(timeout=30)
        assert before.status == "completed"
        models = ReadModels(store)
        datastore = store.factory.datastore
        with datastore.get_connection() as a, datastore.get_connection() as b, datastore.get_connection() as c:
            pooled = {a.info.backend_pid, b.info.backend_pid, c.info.backend_pid}
        with psycopg.connect(pg_database, autocommit=True) as conn:
            ended = {row[0] for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )}
            for pid in ended:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert pooled <= ended
        assert models.runs() == [] and ReadModels.exist(store)  # read-model queries (tables not projected)
        assert {h.start_id for h in store.heads()} == {"before"}  # an index read
        after = runtime.start(program, {"n": 3}, start_id="after").result(timeout=30)  # appends
        assert after.status == "completed" and after.output == {"total": 3, "effects": 3}
        assert {h.start_id: h.status for h in store.heads()} == {"before": "completed", "after": "completed"}
    finally:
        runtime.close()
        store.close()


def test_a_store_failure_while_naming_a_run_is_reported_as_one_not_as_not_found(tmp_path: Path) -> None:
    """``find_process_tree`` looks a tree id up as a run when it names no process; a store that
    fails during that look (PostgreSQL's pool handing out no connection) must answer 503 /
    exit 1, not "process ... is not in this store" (404 / exit 2) as it did."""
    from agentfold.domain.errors import StoreFailure

    store = EventStore(f"sqlite:///{tmp_path / 's.db'}")
    try:
        def failing_head(tree_id: object) -> None:
            raise StoreFailure("store.unavailable", "no PostgreSQL connection within 30 s (test)")

        store.head = failing_head  # type: ignore[method-assign]
        with pytest.raises(StoreFailure) as raised:
            store.find_process_tree("tree:" + "0" * 32)
        assert raised.value.code == "store.unavailable"
    finally:
        store.close()


def test_a_new_sqlite_store_and_its_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    # Found by a security review: the store (every conversation) was created 0644 under the
    # usual umask, readable by every user of the machine.
    path = tmp_path / "runs.db"
    old = os.umask(0o022)
    try:
        ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "calls.jsonl"), store=f"sqlite:///{path}"))
        store = EventStore(f"sqlite:///{path}")
        try:
            store.heads()  # open: SQLite has its -wal and -shm files now
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir() if p.name.startswith("runs.db")}
        finally:
            store.close()
        assert modes == {"runs.db": 0o600, "runs.db-wal": 0o600, "runs.db-shm": 0o600, "runs.db.leases": 0o600}
        shared = tmp_path / "shared.db"
        shared.touch(mode=0o660)
        shared.chmod(0o660)
        ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "calls.jsonl"), store=f"sqlite:///{shared}"))
        assert stat.S_IMODE(shared.stat().st_mode) == 0o660  # an existing file keeps its mode
    finally:
        os.umask(old)


def test_a_libpq_connection_string_given_as_a_store_url_is_refused_without_its_password() -> None:
    # Found by a review: "host=... password=..." (not a URL) was quoted whole.
    ran = refused(agentfold("trees", "--json", store="host=127.0.0.1 password=hunter2secret dbname=ops"))
    error = ran.error()
    assert error["code"] == "store.url_invalid" and "password=***" in error["message"], error
    assert "hunter2" not in ran.stderr


def test_sqlite_memory_url_leaves_no_file_behind(tmp_path: Path) -> None:
    ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "calls.jsonl"), store="sqlite:///:memory:",
                 cwd=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls.jsonl"]
