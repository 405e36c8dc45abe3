"""A real full disk under the embedded SQLite store (a size-limited tmpfs, ENOSPC from the kernel).

The PostgreSQL twin (tests/http_api/test_serve_store_faults.py) refuses appends with a trigger;
this one fills the file system the store lives on, so SQLite itself meets ``database or disk
is full`` wherever it happens to be writing (the WAL, a checkpoint, the database file).

What a user must see: the append that did not fit fails as a whole (``store.append_failed``),
nothing half-written, every stored event still verifies, no call is made for a permission that
was not stored; once there is room again the runtime adopts the run by itself, the call whose
outcome the failed append lost is unknown (it ran once, and is never called again), and the
run finishes once the host resolves it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program

#: Bytes of every call's result: ~300 calls fill the file system below.
RESULT_BYTES = 3000
SMALL = "2m"
ROOMY = "64m"


def _mount(where: Path, size: str, *, remount: bool = False) -> subprocess.CompletedProcess[str]:
    options = f"remount,size={size}" if remount else f"size={size}"
    command = ["mount", "-o", options, str(where)] if remount else ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of its own (root only); unmounted afterwards."""
    where = tmp_path / "fs"
    where.mkdir()
    mounted = shutil.which("mount") is not None and os.geteuid() == 0 and _mount(where, SMALL).returncode == 0
    if not mounted:
        reason = "a size-limited tmpfs needs root and mount(8)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}, and CI=true: the full-disk test must run")
        pytest.skip(reason)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_a_full_disk_stops_the_run_cleanly_and_it_resumes_by_itself_once_there_is_room(small_fs: Path) -> None:
    calls: list[int] = []

    def call(request: Any, context: Any) -> Settlement:
        calls.append(request.payload["index"])
        return Settlement.succeeded({"value": 1, "blob": os.urandom(RESULT_BYTES // 2).hex()})

    program = chain_program(call, name="test.full_disk")
    url = f"sqlite:///{small_fs / 'agentfold.db'}"
    store = EventStore(url)
    runtime = Runtime(store, Catalog([program]), poll_interval=0.05)
    try:
        handle = runtime.start(program, {"n": 2000}, start_id="full-disk")
        with pytest.raises(AgentfoldError) as stopped:
            handle.result(timeout=60)
        assert stopped.value.code == "store.append_failed"
        assert "disk is full" in stopped.value.message
        assert "agentfold recover" in stopped.value.hint  # what to do about it
        made = len(calls)
        assert 50 < made < 2000, made

        # While the disk is full: what is stored is whole and verifies, the index agrees with
        # it, and nothing else is called.
        reader = EventStore(url)
        try:
            loaded = reader.load(handle.tree_id)
            head = reader.head(handle.tree_id)
        finally:
            reader.close()
        assert head is not None and head.version == loaded.state.version
        in_flight = [e for p in loaded.state.processes.values() for e in p.in_flight()]
        assert len(in_flight) == 1  # the call whose settlement did not fit
        verify = subprocess.run(
            [str(Path(sys.executable).parent / "agentfold"), "--store", url, "audit", "verify", "--all"],
            capture_output=True, text=True, timeout=60,
        )
        assert verify.returncode == 0 and "OK" in verify.stdout, verify
        # A new run does not fit either: refused as a whole, no tree half-started.
        with pytest.raises(AgentfoldError) as refused:
            runtime.start(program, {"n": 1}, start_id="full-disk-2")
        assert refused.value.code == "store.append_failed"
        # No run exists to continue or recover (an operations review saw a new run's refusal
        # send the user to `agentfold recover`).
        assert "the run was not started" in refused.value.hint and "recover" not in refused.value.hint
        time.sleep(0.5)
        assert len(calls) == made

        # Room again: nobody runs `recover`; the runtime adopts the run by itself.
        assert _mount(small_fs, ROOMY, remount=True).returncode == 0
        deadline = time.monotonic() + 30
        unknown: list[Any] = []
        while not unknown and time.monotonic() < deadline:
            time.sleep(0.1)
            unknown = [e for p in runtime.capture(handle.tree_id).processes.values() for e in p.unknown_effects()]
        assert [(u.diagnostic.code if u.diagnostic else None) for u in unknown] == ["engine.dispatch.interrupted"]
        assert unknown[0].payload == {"index": calls[-1]}  # the last call made, not called again
        assert len(calls) == made

        runtime.resolve_unknown_effect(unknown[0].effect_id, Settlement.succeeded({"value": 1}))
        result = runtime.result(handle.tree_id, timeout=120)
        assert result.status == "completed" and result.output == {"total": 2000, "effects": 2000}
        assert sorted(calls) == list(range(2000))  # every call once: the resolved one was not made again
    finally:
        runtime.close()
        store.close()


@contextmanager
def tmpfs(tmp_path: Path, options: str) -> Iterator[Path]:
    """A tmpfs of its own mounted with ``options`` (root only); unmounted afterwards."""
    where = tmp_path / "fs"
    where.mkdir()
    if not (shutil.which("mount") and os.geteuid() == 0 and _mount_options(where, options)):
        if os.environ.get("CI") == "true":
            pytest.fail(f"a tmpfs ({options}) needs root and mount(8), and CI=true: this test must run")
        pytest.skip(f"a tmpfs ({options}) needs root and mount(8)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _mount_options(where: Path, options: str) -> bool:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          timeout=30).returncode == 0


def store_with_a_run(folder: Path) -> str:
    """A store in ``folder`` holding one completed run, closed (its -wal and -shm removed): its URL."""
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="test.full_open")
    url = f"sqlite:///{folder / 'agentfold.db'}"
    store = EventStore(url)
    with Runtime(store, Catalog([program])) as runtime:
        assert runtime.start(program, {"n": 2}, start_id="before").result(timeout=30).status == "completed"
    store.close()
    return url


def test_a_store_on_a_full_disk_that_cannot_be_opened_says_the_disk_is_full_and_creates_nothing(small_fs: Path) -> None:
    # Found by an operations review: with the disk full and no process holding the store
    # open, every command failed "disk I/O error" with a hint about permissions (SQLite must
    # create the -shm file to open a WAL database); a new store left an empty file that later
    # read as "has none of its tables".
    url = store_with_a_run(small_fs)
    with open(small_fs / "ballast", "wb") as ballast:  # fill the file system
        try:
            while True:
                ballast.write(b"\0" * 65536)
        except OSError:
            pass
    agentfold = str(Path(sys.executable).parent / "agentfold")
    for command in (["trees"], ["audit", "verify", "--all"]):
        ran = subprocess.run([agentfold, "--store", url, *command], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 1, ran
        assert "store.unavailable" in ran.stderr and "bytes free" in ran.stderr, ran.stderr
        assert "free space on that file system" in ran.stderr and "permission" not in ran.stderr, ran.stderr
    new = small_fs / "new.db"
    with pytest.raises(AgentfoldError) as refused:
        EventStore(f"sqlite:///{new}")
    assert refused.value.code == "store.unavailable" and "bytes free" in refused.value.message
    assert not new.exists()  # no empty file left to read later as a store without tables
    (small_fs / "ballast").unlink()
    ran = subprocess.run([agentfold, "--store", url, "trees", "--json"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran  # room again: the store reads as before


def test_a_store_on_a_file_system_without_free_inodes_says_so(tmp_path: Path) -> None:
    # Found by a review: with bytes free but no inode left, the open failed "unable to open
    # database file" with the permissions hint (SQLite could not create the -shm file).
    with tmpfs(tmp_path, "size=8m,nr_inodes=32") as where:
        url = store_with_a_run(where)
        filled = 0
        try:
            while True:
                (where / f"f{filled}").touch()
                filled += 1
        except OSError:
            pass
        agentfold = str(Path(sys.executable).parent / "agentfold")
        ran = subprocess.run([agentfold, "--store", url, "trees"], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 1 and "store.unavailable" in ran.stderr, ran
        assert "no free inode" in ran.stderr and "permission" not in ran.stderr, ran.stderr


def test_a_file_system_that_counts_no_inodes_is_not_taken_for_full(tmp_path: Path) -> None:
    # Found by a review: on a file system that reports 0 of 0 inodes (btrfs, vfat, many network
    # ones; a tmpfs with nr_inodes=0 here) a store this user may not read was reported as on a
    # full file system ("no free inode") instead of a permissions problem.
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        if os.environ.get("CI") == "true":
            pytest.fail("setpriv(1) is missing, and CI=true: this test must run")
        pytest.skip("needs setpriv(1)")
    with tmpfs(tmp_path, "size=8m,nr_inodes=0") as where:
        assert os.statvfs(where).f_files == 0
        url = store_with_a_run(where)
        (where / "agentfold.db").chmod(0o000)
        caps = "-dac_override,-dac_read_search"
        ran = subprocess.run([str(setpriv), f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set={caps}",
                              str(Path(sys.executable).parent / "agentfold"), "--store", url, "trees"],
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 1 and "store.unavailable" in ran.stderr, ran
        assert "inode" not in ran.stderr and "may read and write" in ran.stderr, ran.stderr
