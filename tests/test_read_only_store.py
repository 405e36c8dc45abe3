"""An SQLite store on a read-only file system (a backup or an evidence copy mounted read-only).

SQLite cannot open a WAL-mode file there the usual way (it needs to create the ``-shm``
file beside it): every command used to fail with ``unable to open database file``, the
read commands too, although they never write. Now the read commands answer exactly as on
the writable original, and every write is refused with ``store.read_only`` before anything.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_cli import ROOT, Ran, agentfold, ok
from tests.test_cli_interaction import two_call_round, write

READ_COMMANDS = (
    ("trees",),
    ("show", "round-1"),
    ("unknown",),
    ("pending",),
    ("audit", "verify", "--all"),
    ("replay", "round-1", "--at", "3"),
)


def _mount(where: Path, options: str) -> bool:
    command = ["mount", "-o", options, str(where)] if "remount" in options else [
        "mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs of its own (root only), to fill and then remount read-only."""
    where = tmp_path / "ro"
    where.mkdir()
    if not (shutil.which("mount") and os.geteuid() == 0 and _mount(where, "size=16m")):
        if os.environ.get("CI") == "true":
            pytest.fail("a read-only mount needs root and mount(8), and CI=true: this test must run")
        pytest.skip("a read-only mount needs root and mount(8)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def parked_store(tmp_path: Path) -> tuple[str, Path]:
    """A store whose run crashed inside its first tool call and was recovered: parked, with
    one unknown Effect to settle."""
    db = tmp_path / "agentfold.db"
    store = f"sqlite:///{db}"
    scenario = write(tmp_path, two_call_round(tmp_path / "side-effects.jsonl"))
    crashed = agentfold("run", str(scenario), "--start-id", "round-1", "--crash-after", "in-dispatch:2", store=store)
    assert crashed.code == 75, crashed.stderr
    ok(agentfold("recover", store=store))
    return store, db


def side_by_side(store: str, *commands: tuple[str, ...]) -> list[Ran]:
    """``agentfold COMMAND --store STORE`` for each command, in order: independent commands,
    each its own process, run side by side (four at a time)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda command: agentfold(*command, store=store), commands))


def answers(store: str, *more: tuple[str, ...]) -> tuple[dict[str, str], list[Ran]]:
    """The read commands' ``--json`` answers (each must succeed), and what ``more`` commands,
    run beside them, gave."""
    ran = side_by_side(store, *((*c, "--json") for c in READ_COMMANDS), *more)
    return {" ".join(c): ok(r).stdout for c, r in zip(READ_COMMANDS, ran, strict=False)}, ran[len(READ_COMMANDS):]


def read_only_refusal(ran: Ran) -> None:
    assert ran.code == 1, (ran.code, ran.stdout, ran.stderr)
    assert json.loads(ran.stderr)["error"]["code"] == "store.read_only", ran.stderr


def test_read_commands_answer_on_a_read_only_copy_as_on_the_original_and_writes_are_refused(
    tmp_path: Path, mount_point: Path,
) -> None:
    store, db = parked_store(tmp_path)
    expected, [original_export] = answers(store, ("export", "round-1"))
    [unknown] = json.loads(expected["unknown"])["unknown_effects"]

    shutil.copy(db, mount_point / "agentfold.db")  # a cleanly closed store: everything is in the file
    assert _mount(mount_point, "remount,ro")
    copy = f"sqlite:///{mount_point / 'agentfold.db'}"
    got, (exported, *refusals) = answers(
        copy,
        ("export", "round-1"),
        # Every write is refused as such, before anything (exit 1, one classified line).
        ("resolve", unknown["effect_id"], "--output", '"done"', "--json"),
        ("cancel", unknown["process_id"], "--json"),
        # A command that creates runs says so too (it said "unable to open database file").
        ("run", str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"), "--json"),
        # A snapshot is a write too: refused before any tree is folded.
        ("snapshot", "--all", "--min-events", "1", "--json"),
        # The followers keep their tables and position in the store (`project` blamed the
        # file's permissions: "give this user write access", the wrong fix on a read-only mount).
        ("project", "--json"),
        ("publish", "--bootstrap", "127.0.0.1:1", "--topic", "t", "--once", "--json"),
    )
    for command, text in expected.items():
        if command.startswith("audit"):  # its timing differs; the verdict must not
            mine, theirs = json.loads(got[command]), json.loads(text)
            assert mine["ok"] is theirs["ok"] is True
            assert [(r["tree"], r["events"], r["ok"]) for r in mine["results"]] == [
                (r["tree"], r["events"], r["ok"]) for r in theirs["results"]]
            continue
        assert json.loads(got[command]) == json.loads(text), command
    assert ok(exported).stdout == ok(original_export).stdout
    assert len(refusals) == 6
    for refusal in refusals:
        read_only_refusal(refusal)
        assert "read-only file system" in json.loads(refusal.stderr)["error"]["message"], refusal.stderr
    assert sorted(p.name for p in mount_point.iterdir()) == ["agentfold.db"]
    assert json.loads(ok(agentfold("trees", "--json", store=store)).stdout) == json.loads(expected["trees"])


def test_a_read_only_copy_taken_with_its_write_ahead_log_is_read_whole(tmp_path: Path, mount_point: Path) -> None:
    store, db = parked_store(tmp_path)
    # A reader holding the store open keeps the log from being folded into the file: the
    # resolution below is then only in the -wal file, which the copy must read.
    holder = sqlite3.connect(db)
    holder.execute("SELECT count(*) FROM agentfold_events").fetchone()
    try:
        [unknown] = json.loads(ok(agentfold("unknown", "--json", store=store)).stdout)["unknown_effects"]
        ok(agentfold("resolve", unknown["effect_id"], "--output", '"done by hand"', store=store))
        assert os.path.getsize(f"{db}-wal") > 0
        expected = json.loads(ok(agentfold("trees", "--json", store=store)).stdout)
        still = json.loads(ok(agentfold("unknown", "--json", store=store)).stdout)["unknown_effects"]
        assert unknown["effect_id"] not in [u["effect_id"] for u in still]
        taken = tmp_path / "taken"  # the files as they are now, while the log holds the resolution
        taken.mkdir()
        for suffix in ("", "-wal", "-shm"):
            shutil.copy(f"{db}{suffix}", taken / f"agentfold.db{suffix}")
    finally:
        holder.close()
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(taken / f"agentfold.db{suffix}", mount_point / f"agentfold.db{suffix}")
    assert _mount(mount_point, "remount,ro")
    copy = f"sqlite:///{mount_point / 'agentfold.db'}"
    got = json.loads(ok(agentfold("trees", "--json", store=copy)).stdout)
    assert got == expected  # the resolution that lives only in the log is there
    assert json.loads(ok(agentfold("unknown", "--json", store=copy)).stdout)["unknown_effects"] == still
    # Through a symbolic link from elsewhere: SQLite looks for the log beside the file the link
    # names, and so must the choice of how to open it (it once took the link's folder, found no
    # log there and read the file without it: the resolved effect was unknown again).
    link = tmp_path / "link.db"
    link.symlink_to(mount_point / "agentfold.db")
    linked = json.loads(ok(agentfold("unknown", "--json", store=f"sqlite:///{link}")).stdout)["unknown_effects"]
    assert linked == still

    # Without the -shm file SQLite cannot read such a log there: a clear refusal, not old data.
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)
    assert _mount(mount_point, "size=16m")
    for suffix in ("", "-wal"):
        shutil.copy(taken / f"agentfold.db{suffix}", mount_point / f"agentfold.db{suffix}")
    assert _mount(mount_point, "remount,ro")
    ran = agentfold("trees", "--json", store=copy)
    assert ran.code == 1 and json.loads(ran.stderr)["error"]["code"] == "store.unavailable", ran.stderr
    assert "-shm" in json.loads(ran.stderr)["error"]["hint"]


def test_a_file_that_is_no_database_on_a_read_only_file_system_is_store_damaged(mount_point: Path) -> None:
    (mount_point / "agentfold.db").write_bytes(b"not an SQLite database " * 200)
    assert _mount(mount_point, "remount,ro")
    ran = agentfold("trees", "--json", store=f"sqlite:///{mount_point / 'agentfold.db'}")
    assert ran.code == 1, ran.stderr
    error = json.loads(ran.stderr)["error"]
    assert error["code"] == "store.damaged" and "-shm" not in error["hint"], error


def test_a_store_whose_files_this_user_may_not_write_is_refused_as_read_only(tmp_path: Path) -> None:
    # Found by an operations review: with the database file read-only for the user (mode
    # 0444), `run` failed `store.append_failed` with a hint to free disk space and recover a
    # run that was never started, and `serve` with `store.unavailable: the store failed:
    # OperationalError`. Both are `store.read_only` now, naming the files. Root writes any
    # file: the commands run without the capability that lets it (setpriv).
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        if os.environ.get("CI") == "true":
            pytest.fail("dropping root's file capabilities needs root and setpriv(1), and CI=true: this test must run")
        pytest.skip("dropping root's file capabilities needs root and setpriv(1)")
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "log"), "--start-id", "first", store=url))
    (tmp_path / "agentfold.db").chmod(0o444)
    before = (tmp_path / "agentfold.db").read_bytes()
    caps = "-dac_override,-dac_read_search"
    without_override = [setpriv, f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set={caps}",
                        str(ROOT / ".venv" / "bin" / "agentfold"), "--store", url]
    env = {**os.environ, "AGENTFOLD_API_TOKEN": "t" * 64}
    for command in (["kernel-demo-run", "--side-effect-log", str(tmp_path / "log2"), "--start-id", "second", "--json"],
                    ["serve", "--port", "0", "--json"]):
        ran = subprocess.run([*without_override, *command], capture_output=True, text=True, timeout=60, env=env)
        assert ran.returncode == 1, (command, ran.stdout, ran.stderr)
        error = json.loads(ran.stderr.strip().splitlines()[-1])["error"]
        assert error["code"] == "store.read_only", (command, error)
        assert "may not write the store's files" in error["message"] and "write access" in error["hint"], error
        assert "free disk space" not in error["hint"]
    assert (tmp_path / "agentfold.db").read_bytes() == before  # nothing was written
    assert not (tmp_path / "log2").exists()  # no call was made
    # A folder this user may not write (SQLite cannot create -wal/-shm even to read): the same
    # refusal when the store is opened (it was store.unavailable).
    (tmp_path / "agentfold.db").chmod(0o644)
    for name in ("agentfold.db-wal", "agentfold.db-shm"):  # as a store nobody holds open leaves it
        companion = tmp_path / name
        if companion.exists():
            assert name.endswith("-shm") or companion.stat().st_size == 0
            companion.unlink()
    tmp_path.chmod(0o555)
    try:
        ran = subprocess.run([*without_override, "trees", "--json"], capture_output=True, text=True, timeout=60, env=env)
    finally:
        tmp_path.chmod(0o755)
    assert ran.returncode == 1, ran
    error = json.loads(ran.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "store.read_only" and "cannot open store" in error["message"], error
