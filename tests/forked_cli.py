"""Run ``agentfold`` commands in processes forked from a launcher that has imported agentfold once.

The suite runs over a thousand short commands. A fresh interpreter spends ~0.5 s of CPU
importing agentfold (pydantic models, dataclasses, eventsourcing) before the command does
anything: measured in 2026-12, more than half of the whole suite's CPU. Here one launcher per
test process imports it once; each command is then a process forked from it.

A forked command is still a real process, with what a user's shell gives the console script:
its own pid, the request's arguments, environment, working directory, umask and standard
streams (stdin the test process's own, stdout and stderr pipes read as ``communicate`` does),
``entry()`` (the console script's function) run to its end, the interpreter's normal exit
(atexit handlers, non-daemon threads joined), and the exit status the parent sees, the
``os._exit`` of a crash point included. What it skips is the interpreter start and the imports
every command makes (the CLI and its command modules; what a command imports beyond them, it
imports itself, as in a fresh interpreter). The long-running commands the tests signal
(``serve``, ``project --follow``, ``publish``, ...) still start as ``python -m
agentfold.adapters.cli``, and tests/test_packaging.py, tests/test_cli_abandon.py run the
installed console script. Commands forked from one launcher share its hash seed (a fresh
interpreter draws its own): each test process has its own launcher, each run new seeds.

``AGENTFOLD_TEST_FORK=0`` runs every command as a fresh interpreter instead, as does any
request whose environment changes how an interpreter or its imports start (``PYTHON*``,
``LANG``, ``LC_*``, ``TZ``, ``PSYCOPG_*``).

The launcher: ``python -m tests.forked_cli SOCKET``. Per command it forks a handler, which
forks the command, reports its pid, then its exit status, on the connection; the handler kills
the command when the caller asks (its timeout) or goes away.
"""

from __future__ import annotations

import atexit
import errno
import importlib
import json
import locale
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_HEADER = struct.Struct("!I")
#: What a fresh interpreter would start differently with: such a request is not forked
#: (``PYTHONPATH`` is applied to the forked command's ``sys.path``).
_START_KEYS = ("PYTHON", "LANG", "LC_", "TZ", "PSYCOPG_")
_APPLIED_KEYS = {"PYTHONPATH"}


def enabled() -> bool:
    return os.environ.get("AGENTFOLD_TEST_FORK", "1") != "0"


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, agentfold.adapters.cli, *argv], capture_output=True, text=True, ...)``,
    forked from the launcher; the same result and the same ``TimeoutExpired`` (the command killed).
    ``env`` and ``cwd`` default to this process's, as for ``subprocess.run``."""
    env = dict(os.environ) if env is None else env
    cwd = os.getcwd() if cwd is None else cwd
    launcher = _launcher() if enabled() else None
    if launcher is None or launcher.starts_differently(env):
        return subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", *argv], capture_output=True,
                              text=True, cwd=cwd, env=env, timeout=timeout, check=False)
    if not os.path.isdir(cwd):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(cwd))  # as Popen's
    try:
        return launcher.run(argv, env=env, cwd=str(cwd), timeout=timeout)
    except (ConnectionRefusedError, FileNotFoundError):  # the launcher died: one new launcher
        return _launcher(replace=launcher).run(argv, env=env, cwd=str(cwd), timeout=timeout)


class _Launcher:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="agentfold-fork-")
        self.path = os.path.join(self.dir, "launcher.sock")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.forked_cli", self.path], cwd=ROOT,
                                        env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the command launcher did not start (exit {self.process.poll()})")

    def starts_differently(self, env: dict[str, str]) -> bool:
        keys = {k for k in (*env, *self.env) if k.startswith(_START_KEYS) and k not in _APPLIED_KEYS}
        return any(env.get(k) != self.env.get(k) for k in keys)

    def run(self, argv: list[str], *, env: dict[str, str], cwd: str,
            timeout: float) -> subprocess.CompletedProcess[str]:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "umask": _umask()}).encode()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                try:
                    conn.connect(self.path)
                    socket.send_fds(conn, [_HEADER.pack(len(request))], [0, out_w, err_w])
                    conn.sendall(request)
                finally:
                    os.close(out_w)
                    os.close(err_w)
                return self._collect(argv, conn, out_r, err_r, timeout)
        finally:
            os.close(out_r)
            os.close(err_r)

    @staticmethod
    def _collect(argv: list[str], conn: socket.socket, out_r: int, err_r: int,
                 timeout: float) -> subprocess.CompletedProcess[str]:
        """Read both pipes to their end and the command's pid and exit status (``communicate``);
        past ``timeout``, the handler kills the command and reports its end: ``TimeoutExpired``."""
        chunks: dict[int, list[bytes]] = {conn.fileno(): [], out_r: [], err_r: []}
        selector = selectors.DefaultSelector()
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        deadline, killed = time.monotonic() + timeout, False
        try:
            while selector.get_map():
                ready = selector.select(max(deadline - time.monotonic(), 0))
                if not ready:
                    if killed:
                        break
                    try:
                        conn.sendall(b"kill\n")
                    except OSError:  # the handler already reported the end (its pipes are held)
                        pass
                    deadline, killed = time.monotonic() + 30, True
                    continue
                for key, _ in ready:
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                if killed and len(b"".join(chunks[conn.fileno()]).split(b"\n")) > 2:
                    break  # killed and reaped (a process it started may still hold the pipes)
        finally:
            selector.close()
        if killed:
            raise subprocess.TimeoutExpired(["agentfold", *argv], timeout, _text(chunks[out_r]), _text(chunks[err_r]))
        report = b"".join(chunks[conn.fileno()]).split(b"\n")
        if len(report) < 3:
            raise RuntimeError(f"the command launcher lost the command (it reported {report!r})")
        return subprocess.CompletedProcess(["agentfold", *argv], int(report[1]), _text(chunks[out_r]),
                                           _text(chunks[err_r]))

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


def _umask() -> int:
    """This process's umask, read without changing it (another thread may be creating files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise RuntimeError("no Umask in /proc/self/status")


def _text(chunks: list[bytes]) -> str:
    """A captured stream as ``subprocess.run(text=True)`` gives it (locale encoding, universal newlines)."""
    data = b"".join(chunks)
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_lock = threading.Lock()
_instance: _Launcher | None = None
_owner = 0


def _launcher(replace: _Launcher | None = None) -> _Launcher:
    """This process's launcher, started at first use (again if it died or is ``replace``)."""
    global _instance, _owner
    with _lock:
        if _instance is None or _owner != os.getpid() or _instance.process.poll() is not None \
                or _instance is replace:
            _instance = _Launcher()
            _owner = os.getpid()
            atexit.register(_instance.close)
        return _instance


# --- the launcher process -------------------------------------------------------------------


def _serve(path: str) -> tuple[dict[str, Any], list[int]]:
    """Accept requests until the test process is gone; returns only in a forked command."""
    cli = importlib.import_module("agentfold.adapters.cli")
    for module in cli.COMMAND_MODULES:  # what every command imports to build its parser
        importlib.import_module(module)

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped without a wait
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        readable, _, _ = select.select([listener], [], [], 1.0)
        if os.getppid() != parent:
            os._exit(0)
        if not readable:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            return _handle(conn)
        conn.close()


def _handle(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """In the handler: fork the command, report its pid, then its exit status; returns only in the command."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        (size,) = _HEADER.unpack(head)
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the request ended early")
            data += chunk
        request = json.loads(data)
        pid = os.fork()
    except BaseException:  # noqa: BLE001  (a handler never returns into the launcher's loop)
        os._exit(1)
    if pid == 0:
        conn.close()
        return request, fds
    try:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        ended = os.pidfd_open(pid)
        readable, _, _ = select.select([conn.fileno(), ended], [], [])
        if conn.fileno() in readable:  # the caller's timeout ("kill"), or the caller gone (end of stream)
            os.kill(pid, signal.SIGKILL)  # still this handler's unreaped child: no other process
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def _command(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked command: take the request's streams, directory and environment, run the entry point."""
    import random

    from agentfold.adapters.cli import entry

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as subprocess's close_fds: only the three streams
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    importlib.invalidate_caches()  # modules written since the launcher started
    random.seed()  # a fresh interpreter's own seed, not the launcher's
    sys.argv = ["agentfold", *request["argv"]]
    # sys.path as ``python -m`` in that directory with that PYTHONPATH starts with.
    launcher_entries = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base = [p for p in sys.path[1:] if os.path.abspath(p) not in launcher_entries]
    wanted = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *wanted, *base]
    os.environ.clear()
    os.environ.update(request["env"])
    entry()


if __name__ == "__main__":
    _command(*_serve(sys.argv[1]))
