"""What a store URL's refusal says: no password given away, and the path an SQLite URL leads to.

* A failed PostgreSQL connection used to mask the password by replacing its text everywhere
  in the server's message: a short password ("e") garbled the message
  (``conn***ction to s***rv***r``) and so gave the password away. Only the places a password
  can stand are masked now: ``password=...`` parameters and a URL's ``:password@``.
* ``sqlite:///tmp/x.db`` is a path relative to the working directory (three slashes); when its
  folder does not exist, opening it to write used to fail as ``store.unavailable`` "unable to
  open database file" (exit 1, "retry"). It is bad input now: ``store.url_invalid`` (exit 2)
  naming the path it resolved to, with a hint about three and four slashes; nothing is created.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from agentfold.adapters.eventstore import EventStore, connect_failure, mask_passwords, parse_store_url
from agentfold.domain.errors import InvalidInput, NotFound
from tests.test_cli import ROOT, agentfold, refused
from tests.test_store_opening import DEMO, failed, pg_server

SERVER_SAYS = ('connection to server at "127.0.0.1", port 5432 failed: FATAL:  password authentication failed '
               'for user "alice"')


@pytest.mark.parametrize("password", ["e", "r", "s", "5432", "alice", "hunter2secret"])
def test_a_connection_failure_keeps_the_servers_words_whatever_the_password(password: str) -> None:
    url = f"postgresql://alice:{password}@127.0.0.1:5432/ops"
    _, settings = parse_store_url(url)
    error = connect_failure(url, settings, Exception(f"connection failed: {SERVER_SAYS}"))
    assert error.code == "store.unavailable"
    said = " ".join(SERVER_SAYS.split())  # one line, single spaces
    assert error.message == f"PostgreSQL refused the login to postgresql://alice:***@127.0.0.1:5432/ops: {said}"


@pytest.mark.parametrize("password", ["e", "hunter2secret", "p@ss/w:rd"])
def test_a_password_the_driver_quotes_is_masked_where_it_stands(password: str) -> None:
    url = f"postgresql://alice:{password}@db.example:5432/ops"
    _, settings = parse_store_url("postgresql://alice:pw@db.example:5432/ops")
    settings["POSTGRES_PASSWORD"] = password
    said = (f"invalid dsn: host=db.example password={password} dbname=ops; also password='{password} x' "
            f"and {url} failed")
    error = connect_failure(url, settings, Exception(said))
    assert error.message == (
        "cannot connect to the PostgreSQL server of postgresql://alice:***@db.example:5432/ops: invalid dsn: "
        "host=db.example password=*** dbname=ops; also password=*** and postgresql://alice:***@db.example:5432/ops failed"
    )


def test_masking_leaves_text_without_passwords_alone() -> None:
    for text in (SERVER_SAYS, "could not translate host name \"no-such-host.invalid\" to address",
                 "connection to server on socket \"/tmp/.s.PGSQL.5432\" failed: No such file or directory"):
        assert mask_passwords(text) == text
    assert mask_passwords("PASSWORD = secret&x") == "PASSWORD = ***&x"


def test_a_short_password_the_server_refuses_is_not_spelled_out(pg_database: str) -> None:
    host, port = pg_server(pg_database)
    role = "no_such_role_" + uuid.uuid4().hex[:8]
    for password in ("e", "o", "hunter2secret"):
        url = f"postgresql://{role}:{password}@{host}:{port}/{pg_database.rsplit('/', 1)[1]}"
        error = failed(agentfold("trees", "--json", store=url)).error()
        assert error["code"] == "store.unavailable"
        assert f'role "{role}" does not exist' in error["message"], error
        assert "connection to server at" in error["message"], error
        assert error["message"].count("***") == 1 and f"{role}:***@" in error["message"], error


# ---------------------------------------------------------------------------
# SQLite: a folder that does not exist


def test_a_relative_sqlite_path_in_a_missing_folder_is_bad_input_naming_where_it_leads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput) as refused_open:
        EventStore("sqlite:///tmp/x.db")
    error = refused_open.value
    assert error.code == "store.url_invalid"
    assert f"at {tmp_path / 'tmp' / 'x.db'}" in error.message and "does not exist" in error.message
    assert "relative to the working directory" in error.hint and "sqlite:////tmp/x.db" in error.hint
    assert list(tmp_path.iterdir()) == []


def test_an_absolute_sqlite_path_in_a_missing_folder_is_bad_input(tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "folder" / "x.db"
    with pytest.raises(InvalidInput) as refused_open:
        EventStore(f"sqlite:///{target}")
    error = refused_open.value
    assert error.code == "store.url_invalid"
    assert f"its folder {target.parent} does not exist" in error.message
    assert f"create the folder {target.parent} first" in error.hint and "sqlite:////absolute/path.db" in error.hint
    assert list(tmp_path.iterdir()) == []


def test_an_sqlite_path_under_a_file_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a folder")
    with pytest.raises(InvalidInput) as refused_open:
        EventStore(f"sqlite:///{tmp_path / 'plain' / 'x.db'}")
    assert refused_open.value.code == "store.url_invalid"
    assert f"its folder {tmp_path / 'plain'} is not a folder" in refused_open.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_reading_a_relative_sqlite_path_names_where_it_leads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFound) as missing:
        EventStore("sqlite:///tmp/x.db", create=False)
    assert missing.value.code == "store.not_found"
    assert f"(a relative path: {tmp_path / 'tmp' / 'x.db'})" in missing.value.message
    assert list(tmp_path.iterdir()) == []


def test_the_cli_refuses_a_store_in_a_missing_folder_with_exit_2_and_creates_nothing(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    ran = refused(agentfold("run", str(DEMO), "--start-id", "trip", "--json", store="sqlite:///tmp/x.db", cwd=work))
    error = ran.error()
    assert error["code"] == "store.url_invalid", error
    assert str(work / "tmp" / "x.db") in error["message"] and "nothing was created" in error["message"]
    assert "sqlite:////tmp/x.db" in error["hint"]
    assert list(work.iterdir()) == []
    assert ROOT.exists()


def test_a_tilde_in_an_sqlite_path_is_named_as_not_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput) as refused:
        EventStore("sqlite:///~/agentfold.db")
    assert refused.value.code == "store.url_invalid"
    assert "does not expand ~" in refused.value.hint
    assert list(tmp_path.iterdir()) == []
