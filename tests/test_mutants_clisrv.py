"""The options of ``agentfold serve``, ``publish`` and ``transcripts`` as docs/http-api.md and
docs/kafka.md describe them: refusals the mutation audit of the serve and feed commands
(2026-12-05, "clisrv") found undefended. Each test failed with its planted bug (named in its
docstring) and passes without it.

All run the CLI's own entry point, ``main(argv)``, in this process (exit status, stdout and stderr
as the console script prints them): every refusal here comes before ``serve`` listens or installs
its signal handlers, and before ``publish``/``transcripts`` open a store or reach a broker (the
broker address, 127.0.0.1:9, has nothing listening). ``serve`` is given a port another socket of
this test holds, so that an option the bug lets through ends in ``http.listen_failed`` (exit 1)
instead of serving for ever.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentfold.adapters.cli import main
from agentfold.adapters.eventstore import EventStore

GOOD_TOKEN = "clisrv-" + "t" * 32
NO_BROKER = "127.0.0.1:9"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, dict[str, str]]:
    """``agentfold ARGV --json``: the exit status, stdout and the one error of stderr."""
    capsys.readouterr()
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # on failure, exactly one line goes to stderr (docs/cli.md)
    error: dict[str, str] = json.loads(lines[0])["error"]
    return code, out, error


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port this test listens on: a ``serve`` that got past its refusals fails to bind it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# serve


@pytest.mark.parametrize("token", ["ctrl\x01" + "c" * 20, "tab\t" + "c" * 20, "del\x7f" + "c" * 20])
def test_serve_refuses_a_token_with_a_control_character_before_opening_anything(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, taken_port: int, token: str,
) -> None:
    """docs/http-api.md: "a token that is not printable ASCII without spaces is http.token_invalid
    (exit 2)". Mutant: ``token.isprintable()`` dropped from the check (only non-ASCII, spaces and
    surrounding blanks were tested): the server started with a token no HTTP client can send."""
    monkeypatch.setenv("AGENTFOLD_API_TOKEN", token)
    store = tmp_path / "agentfold.db"
    code, out, error = run(capsys, "serve", "--store", f"sqlite:///{store}", "--port", str(taken_port))
    assert (code, out, error["code"]) == (2, "", "http.token_invalid"), error
    assert not store.exists()


def test_serve_refuses_a_side_effect_dir_that_is_not_a_folder_before_listening(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, taken_port: int,
) -> None:
    """docs/http-api.md (--side-effect-dir): "DIR must exist". Mutant: the ``is_dir()`` check
    dropped: the server went on to listen (here: to the taken port, exit 1) with a folder no
    scenario could log into."""
    monkeypatch.setenv("AGENTFOLD_API_TOKEN", GOOD_TOKEN)
    store = tmp_path / "agentfold.db"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for missing in (tmp_path / "missing", a_file):
        code, out, error = run(capsys, "serve", "--store", f"sqlite:///{store}", "--port", str(taken_port),
                               "--side-effect-dir", str(missing))
        assert (code, out, error["code"]) == (2, "", "cli.argument_invalid"), error
        assert "--side-effect-dir" in error["message"] and "is not a folder" in error["message"], error
    assert not store.exists()


# ---------------------------------------------------------------------------------------------
# publish, transcripts


@pytest.mark.parametrize("option", ["--partitions", "--replication-factor", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-3", "1000001", "two"])
def test_publish_refuses_counts_outside_1_to_a_million_before_touching_the_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, value: str,
) -> None:
    """docs/kafka.md's N options (partitions, replication factor, events per batch) are counts.
    Mutants: ``_positive`` taking 0 (a topic of 0 partitions, a batch of no event: the command
    opened the store and reached for the broker) or any size above a million."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    EventStore(url).close()  # an existing store: the refusal is the option's
    before = (tmp_path / "store.db").read_bytes()
    code, out, error = run(capsys, "publish", "--store", url, "--bootstrap", NO_BROKER, "--topic", "t", "--once",
                           option, value)
    assert (code, out, error["code"]) == (2, "", "cli.usage"), error
    assert option in error["message"] and "from 1 to 1000000" in error["message"], error
    assert (tmp_path / "store.db").read_bytes() == before  # no tracking table, no position


@pytest.mark.parametrize("value", ["0", "1000001"])
def test_transcripts_refuses_a_max_records_outside_1_to_a_million_and_creates_no_database(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str,
) -> None:
    """Mutant: ``_positive`` taking 0 or above a million for ``--max-records``."""
    db = tmp_path / "transcripts.db"
    code, out, error = run(capsys, "transcripts", "--bootstrap", NO_BROKER, "--topic", "t", "--group", "g",
                           "--db", f"sqlite:///{db}", "--once", "--max-records", value)
    assert (code, out, error["code"]) == (2, "", "cli.usage"), error
    assert "--max-records" in error["message"], error
    assert not db.exists()


def test_transcripts_refuses_once_with_idle_exit_and_creates_no_database(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    """docs/kafka.md: ``[--once | --idle-exit SECONDS]``, one or the other. Mutant: the check
    dropped: ``--once --idle-exit 600`` silently ran as ``--once`` (an idle exit after 1 s, not
    600), after creating the database and joining the group."""
    db = tmp_path / "transcripts.db"
    code, out, error = run(capsys, "transcripts", "--bootstrap", NO_BROKER, "--topic", "t", "--group", "g",
                           "--db", f"sqlite:///{db}", "--once", "--idle-exit", "600")
    assert (code, out, error["code"]) == (2, "", "cli.usage"), error
    assert "--once and --idle-exit are exclusive" in error["message"], error
    assert not db.exists()


@pytest.fixture
def own_signal_handlers() -> Iterator[None]:
    """``serve`` installs its SIGTERM/SIGINT handlers once it listens (for the rest of its
    process): put pytest's back after a ``serve`` that got that far in this process."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.usefixtures("own_signal_handlers")
def test_serve_whose_store_fails_to_open_exits_with_the_stores_error_not_as_stopped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """docs/cli.md exit statuses: a store that fails is exit 1 (``store.damaged``: the file is not
    an SQLite database), an invalid one exit 2 (``store.url_invalid``: its folder does not exist),
    one line on stderr and nothing on stdout. Only a failure after SIGTERM/SIGINT is the stop the
    signal asked for (exit 0, tests/http_api/test_serve_stopping.py). Mutant: ``starting()`` took
    every failure of the startup for one after a signal: ``serve`` printed "server stopped" and
    exited 0 on a store it could not open, and a supervisor saw a clean stop, not a failure."""
    monkeypatch.setenv("AGENTFOLD_API_TOKEN", GOOD_TOKEN)
    damaged = tmp_path / "text.db"
    damaged.write_text("not a database\n")
    code, out, error = run(capsys, "serve", "--store", f"sqlite:///{damaged}", "--port", "0")
    assert (code, out, error["code"]) == (1, "", "store.damaged"), (code, out, error)
    assert damaged.read_text() == "not a database\n"
    code, out, error = run(capsys, "serve", "--store", f"sqlite:///{tmp_path / 'no-folder' / 'a.db'}", "--port", "0")
    assert (code, out, error["code"]) == (2, "", "store.url_invalid"), (code, out, error)
    assert not (tmp_path / "no-folder").exists()

