"""CLI commands: `serve`: the HTTP API (docs/http-api.md)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from agentfold.adapters.cli import MAX_TIMEOUT
from agentfold.adapters.runtime import DEFAULT_DISPATCH_WORKERS, MAX_DISPATCH_WORKERS
from agentfold.domain.errors import AgentfoldError, InvalidInput

DEFAULT_PORT = 8080
#: Seconds uvicorn lets HTTP requests in progress finish after SIGTERM/SIGINT.
REQUEST_GRACE = 10
#: Seconds after SIGTERM/SIGINT by which ``serve`` has exited in any case (StopGuard): the
#: request grace, the calls' 2 s (``agentfold.adapters.cli.CALLS_GRACE``, as for a command past its
#: ``--timeout``), closing the runtime and the store, ``ABANDON_GRACE``.
SERVE_STOP_LIMIT = 15.0
#: Seconds after the runtime closed that a call still running may take before it is counted abandoned.
ABANDON_GRACE = 0.5
#: Seconds between a server's scans for live runs nobody owns (``--adopt-every``).
DEFAULT_ADOPT_EVERY = 5.0



def recovered_text(entries: list[dict[str, Any]]) -> str:
    """How the start line counts ``--recover``'s live runs, by outcome (parked runs are left
    as they are, not adopted)."""
    counts = collections.Counter(str(e.get("outcome")) for e in entries)
    parts = [f"{counts[o]} live run(s) {label}" for o, label in
             (("adopted", "adopted"), ("parked", "parked and left as they are"), ("skipped", "skipped"))
             if counts[o]]
    return "".join(", " + part for part in parts)

def register(command: Any) -> None:
    """Add this module's commands with ``command(name, handler, help, timeout=False)`` (agentfold.adapters.cli)."""
    serve = command("serve", cmd_serve, "serve the authenticated HTTP API over the store (docs/http-api.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--side-effect-dir", metavar="DIR", default=None,
                       help="the folder scenarios started over HTTP may name side-effect logs in (relative "
                       "paths resolve against it), and the only one this server appends side-effect logs to, "
                       "whoever started the run (checked at each write); without it a scenario with "
                       "side_effect_log is refused and no run's tool appends to one")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT,
                       help=f"port to listen on (default {DEFAULT_PORT}; 0 picks a free one and prints it)")
    serve.add_argument("--no-follow", action="store_true",
                       help="do not keep the read models current in this process (reads fold unless another "
                       "follower keeps them current)")
    serve.add_argument("--recover", action="store_true",
                       help="at startup, before serving, adopt every live run nobody owns and count them in the "
                       "start line")
    serve.add_argument("--dispatch-workers", type=int, default=DEFAULT_DISPATCH_WORKERS, metavar="N",
                       help="the most tool and model calls this server has in flight at once (default "
                       f"{DEFAULT_DISPATCH_WORKERS}, at most {MAX_DISPATCH_WORKERS}); a run whose next call finds them "
                       "all taken waits in line, its call declared but not yet permitted")
    serve.add_argument("--adopt-every", type=float, default=DEFAULT_ADOPT_EVERY, metavar="SECONDS",
                       help="while serving, adopt the live runs nobody owns (those of a server or command that "
                       f"died) this often (default {DEFAULT_ADOPT_EVERY:g}; 0 = never)")


def _listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket first, so the address printed is the one served (also for port 0)."""
    if not 0 <= port <= 65535:
        raise InvalidInput("cli.argument_invalid", f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        raise AgentfoldError("http.listen_failed", f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                             hint="pick another --port or --host") from exc
    return sock


def _server(config: Any, stop: threading.Event, stopping: list[int], on_stop: Callable[[], None]) -> Any:
    """A uvicorn server that also notes the signal, sets ``stop`` and calls ``on_stop`` when
    SIGTERM or SIGINT asks it to shut down (uvicorn handles them itself while it serves), so
    the stop bound counts from the signal."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                if stop.is_set():  # a signal after cmd_serve last looked, before uvicorn's handlers
                    self.should_exit = True
                yield

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            stopping.append(sig)
            if len(stopping) == 1:  # not again for a second signal (see ``noted`` in cmd_serve)
                stop.set()
                on_stop()

    return Server(config)


#: Below this many characters ``serve`` warns that its token is easy to guess.
MIN_TOKEN_CHARS = 16


def _loopback(host: str) -> bool:
    """Whether ``host`` (a ``--host`` value) only accepts connections from this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _say(line: str) -> None:
    sys.stderr.write(f"agentfold: {line}\n")
    sys.stderr.flush()


T = TypeVar("T")


def _off_main_thread(call: Callable[[], T]) -> T:
    """``call()`` run on a worker thread while this (the main) thread waits in short slices.

    A Python signal handler only runs on the main thread, between bytecodes: while the main
    thread is inside a long C call (SQLite waiting up to ``SQLITE_LOCK_TIMEOUT`` s for a lock
    another process holds, a PostgreSQL connection attempt) SIGTERM would not even be noticed,
    so the stop bound (``StopGuard``, which counts from the handler) would not start. Waiting
    here, the handler runs at once; ``call`` ends when its store call returns, fails or is
    interrupted by the guard (or the guard exits the process)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            outcome.append((False, exc))

    # Not a daemon: the threads it starts (the runtime's pools) inherit that, and are as they
    # were when started from the main thread. Nothing waits for it at exit: it is joined here,
    # or the StopGuard's overrun ends the process.
    worker = threading.Thread(target=run, name="agentfold-serve-startup", daemon=False)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
    ok, value = outcome[0]
    if not ok:
        raise value
    return cast(T, value)


class _StoppedWhileStarting(Exception):
    """A store call of the startup failed after SIGTERM/SIGINT (the store did not answer, or the
    StopGuard interrupted it): the server stops as the signal asked, with its final report and
    exit status 0, not with the store's error."""


@contextlib.contextmanager
def _stopped_while_starting() -> Iterator[None]:
    """Ends ``serve``'s startup quietly on ``_StoppedWhileStarting``: one stderr line, then the
    final report of a server that stopped before it listened."""
    try:
        yield
    except _StoppedWhileStarting as exc:
        _say(f"stopped before listening; meanwhile the store failed: {exc}")


def _undurable(store: Any) -> str | None:
    """The store's warning that the server does not make commits durable, if it has one."""
    try:
        return cast("str | None", store.undurable_server())
    except Exception:  # noqa: BLE001 - a warning's probe never stops the server
        return None


def _exit_at_once(as_json: bool, stopping: list[int], opened: list[Any]) -> Callable[[float], None]:
    """The StopGuard overrun of ``serve``: the last lines it would print, then exit status 0 at
    once (another thread is still inside a call to a store that does not answer, or inside the
    store's opening; what it did is decided by recovery, as after a crash). ``opened``: the
    ``ApiService`` once there is one."""

    def overrun(seconds: float) -> None:
        try:
            abandoned = sum(int(service.runtime.dispatches_running()) for service in opened)
        except Exception:  # noqa: BLE001 - exiting anyway
            abandoned = 0
        sys.stderr.write(f"agentfold: still not stopped {seconds:.0f} s after the signal: exiting now; "
                         "recovery decides the outcome of what was in progress\n")
        if abandoned:
            sys.stderr.write(f"agentfold: abandoning {abandoned} dispatcher call(s) still running; "
                             "recovery decides their outcomes\n")
        data = {"stopped": True, "signal": stopping[0] if stopping else None, "abandoned_dispatches": abandoned}
        sys.stdout.write((json.dumps(data, sort_keys=True) if as_json else "agentfold: server stopped") + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return overrun


def cmd_serve(ctx: Any, args: argparse.Namespace) -> Any:
    # Imported here: the web stack is only loaded by the command that serves.
    import uvicorn

    from agentfold.adapters.cli import CALLS_GRACE, Outcome
    from agentfold.adapters.eventstore import redact
    from agentfold.adapters.follower import STOP_GRACE, StopGuard, one_line
    from agentfold.adapters.http_api import TOKEN_ENV, ApiService, create_app, request_read_deadlines
    from agentfold.adapters.scenario import side_effect_confinement

    token = os.environ.get(TOKEN_ENV, "")
    if not token.strip():
        raise InvalidInput("http.token_missing", f"set {TOKEN_ENV} to the bearer token clients must send",
                           hint=f"e.g. export {TOKEN_ENV}=$(openssl rand -hex 32)")
    if not (token.isascii() and token.isprintable()) or token != token.strip() or " " in token:
        # HTTP headers carry bytes: a client could not send such a token as the server compares it.
        raise InvalidInput("http.token_invalid", f"{TOKEN_ENV} must be printable ASCII without spaces",
                           hint=f"e.g. export {TOKEN_ENV}=$(openssl rand -hex 32)")
    adopt_every = args.adopt_every
    if not 0 <= adopt_every <= MAX_TIMEOUT:  # NaN compares false; beyond, the scan's timer overflows
        raise InvalidInput("cli.argument_invalid",
                           f"--adopt-every must be a number of seconds from 0 to {MAX_TIMEOUT:.0f} (30 days), "
                           f"got {adopt_every:.15g}", hint="0 turns the scan off")
    workers = args.dispatch_workers
    if not 1 <= workers <= MAX_DISPATCH_WORKERS:
        raise InvalidInput("cli.argument_invalid",
                           f"--dispatch-workers must be from 1 to {MAX_DISPATCH_WORKERS}, got {workers}",
                           hint=f"the default is {DEFAULT_DISPATCH_WORKERS}")
    protocol = request_read_deadlines()  # AGENTFOLD_HTTP_HEAD_WAIT / _BODY_WAIT: refused before listening
    side_effect_dir = Path(args.side_effect_dir) if args.side_effect_dir is not None else None
    if side_effect_dir is not None and not side_effect_dir.is_dir():
        raise InvalidInput("cli.argument_invalid", f"--side-effect-dir {args.side_effect_dir!r} is not a folder",
                           hint="create it first, or leave the option out to refuse side-effect logs")
    # The address first: a refusal of it (a bad port, one in use) is then the only stderr line.
    sock = _listen(args.host, args.port)
    if len(token) < MIN_TOKEN_CHARS:  # no surrounding whitespace by now
        _say(f"warning: {TOKEN_ENV} is {len(token)} characters long; a token anyone can guess opens every "
             f"run (use {MIN_TOKEN_CHARS} or more, e.g. $(openssl rand -hex 32))")
    if not _loopback(args.host):
        _say(f"warning: serving plain HTTP on {args.host}: the token and every run travel unencrypted; put a "
             "TLS-terminating reverse proxy in front (docs/http-api.md)")
    stopping: list[int] = []
    abandoned = 0
    stop = threading.Event()
    opened: list[ApiService] = []

    def noted(number: int, frame: Any) -> None:
        # Before the server listens (opening the store, --recover driving the runs it adopts),
        # a signal stops it as one does later: no call is started from then on, the startup
        # adoption stops, the server never listens, and the calls under way are drained. (The
        # default action killed the process there: runs it had just adopted were left with
        # dispatch permissions for calls never made, unknown after the next recovery.) While
        # uvicorn serves it handles the signals itself, then restores these and raises the
        # signal again: noted here too, and the cleanup below runs.
        stopping.append(number)
        if len(stopping) > 1:
            # Stopping already. (A second signal in the same instant runs this handler inside
            # the first one, which may hold the Event's lock: setting it again would wait for ever.)
            return
        stop.set()
        for service in opened:
            service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, noted)
    stores: list[Any] = []

    def interrupt() -> None:
        for opened_store in stores:
            opened_store.interrupt()

    # From the signal to the store closed: during an outage, store calls (opening the store,
    # --recover's adoptions, requests, owner lines, the follower) would wait minutes; once the
    # store has not answered for STOP_GRACE s they are interrupted (a store still being opened is not),
    # and SERVE_STOP_LIMIT s after the signal the process exits in any case. A store that
    # answers is left alone, so requests keep their REQUEST_GRACE s and owner lines finish
    # their appends.
    guard = StopGuard(
        stop, interrupt, grace=STOP_GRACE, limit=SERVE_STOP_LIMIT, say=_say,
        overrun=_exit_at_once(bool(getattr(args, "json", False)), stopping, opened),
        # Only once there is a store to interrupt: an opening that hangs is bounded by the limit.
        needed=lambda: bool(stores) and not stores[0].answers(),
    )

    def starting(call: Callable[[], T]) -> T:
        """A store call before the server listens: off the main thread (``_off_main_thread``),
        so a signal is noted at once even while the store does not answer; its failure after
        the signal is the stop the signal asked for."""
        try:
            return _off_main_thread(call)
        except Exception as exc:
            if stop.is_set():
                raise _StoppedWhileStarting(one_line(exc)) from exc
            raise

    # Every side-effect log this process appends to (any run it drives: started over HTTP,
    # by a CLI command and adopted, imported) is confined to --side-effect-dir, checked at
    # each write (none at all without it): docs/scenarios.md.
    with guard, side_effect_confinement(side_effect_dir), _stopped_while_starting():
        try:
            store = starting(lambda: ctx.open_store(create=True))
            stores.append(store)
            try:
                undurable = starting(lambda: _undurable(store))
                if undurable is not None:
                    _say(f"warning: {undurable}")
                service = starting(lambda: ApiService.open(
                    store, ctx.sources, token, follow=not args.no_follow, adopt_every=adopt_every,
                    side_effect_dir=side_effect_dir, dispatch_workers=workers))
                opened.append(service)
                if stop.is_set():
                    service.stop()  # a signal while the store was opened
                try:
                    recovered = starting(service.recover) if args.recover and not stop.is_set() else []
                    host, port = sock.getsockname()[:2]
                    shown = f"[{host}]" if ":" in host else host
                    url = f"http://{shown}:{port}"
                    # where side-effect logs may be appended (None: to no log at all)
                    logs_dir = str(side_effect_dir.resolve()) if side_effect_dir is not None else None
                    started = {
                        "listening": url, "port": port, "store": redact(ctx.store_url),
                        "follower": service.follower is not None, "recovered": recovered,
                        "adopt_every": adopt_every,
                        "dispatch_workers": workers,
                        "side_effect_dir": logs_dir,
                    }
                    if stop.is_set():  # stopped before it listened: it never served (the last line says so)
                        pass
                    elif getattr(args, "json", False):
                        sys.stdout.write(json.dumps(started, sort_keys=True, default=str) + "\n")
                    else:
                        sys.stdout.write(f"agentfold: serving {url} (store {redact(ctx.store_url)}"
                                         f"{', read models followed' if service.follower else ''}"
                                         f"{recovered_text(recovered)}"
                                         f"{f', adopting runs nobody owns every {adopt_every:g} s' if adopt_every else ''}"
                                         f", {logs_text(logs_dir)})\n")
                    sys.stdout.flush()
                    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False,
                                            lifespan="on", timeout_graceful_shutdown=REQUEST_GRACE, server_header=False,
                                            http=protocol)
                    # From the signal on, no call is started (Runtime.drain): the calls under way
                    # finish and are recorded while requests finish; Effects declared meanwhile
                    # are started by the run's next owner (another server's scan, recover).
                    server = _server(config, stop, stopping, on_stop=service.stop)
                    if not stop.is_set():  # else stopped before it listened: drained and closed below
                        server.run(sockets=[sock])
                finally:
                    try:
                        service.runtime.drain(CALLS_GRACE)  # the calls under way: recorded if they return now
                    finally:
                        service.close()
                    abandoned = _abandoned_calls(service.runtime, grace=ABANDON_GRACE)
            finally:
                store.close()
        finally:
            sock.close()
    if abandoned:
        # Their threads cannot be stopped from outside, and the interpreter would wait for
        # them at exit; what they did is decided by recovery (replay or unknown), as after a crash.
        sys.stderr.write(
            f"agentfold: abandoning {abandoned} dispatcher call(s) still running; "
            "recovery decides their outcomes\n"
        )
    return Outcome({"stopped": True, "signal": stopping[0] if stopping else None,
                    "abandoned_dispatches": abandoned},
                   "agentfold: server stopped", exit_now=abandoned > 0)


def logs_text(side_effect_dir: str | None) -> str:
    """What the start line says of side-effect logs: scenario tools append to none unless
    ``--side-effect-dir`` names the folder they are confined to."""
    if side_effect_dir is None:
        return "side-effect logs off: no --side-effect-dir"
    return f"side-effect logs confined to {side_effect_dir}"


def _abandoned_calls(runtime: Any, grace: float = 2.0) -> int:
    """Dispatcher calls still running after the runtime closed (each was told to cancel),
    once they had ``grace`` seconds to return."""
    deadline = time.monotonic() + grace
    while runtime.dispatches_running() and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(runtime.dispatches_running())
