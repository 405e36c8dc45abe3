"""`agentfold serve` from SIGTERM on (found by a review of serve, leases and failover).

Real servers, real stores, real signals. docs/http-api.md: from the signal on the server
starts no new tool or model call, requests in progress finish (up to 10 s), and every error
is a problem document with a code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agentfold.adapters.eventstore import EventStore
from agentfold.domain.events import EffectDispatched, WriterActivated
from agentfold.domain.ids import StartID, TreeID
from tests.http_api.support import TOKEN, server_env, start_server, wait_until
from tests.http_api.test_serve_failures import blocked_in_the_tool
from tests.test_cli import ROOT
from tests.test_cli_interaction import FINAL, two_call_round


def test_a_write_waiting_for_its_run_answers_with_the_stored_run_when_the_server_stops(tmp_path: Path) -> None:
    # It waited past uvicorn's 10 s grace and got a bare "500 Internal Server Error" (text/plain,
    # no code), although its run had been created.
    server = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path)
    fifo = tmp_path / "tool.fifo"
    os.mkfifo(fifo)  # nobody reads it: the tool blocks in its call
    answer: dict[str, Any] = {}

    def write() -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            response = client.post("/runs", json={"scenario": two_call_round(fifo, final=FINAL), "start_id": "w1",
                                                  "wait": 60})
            answer.update(status=response.status_code, type=response.headers["content-type"], body=response.json())
            answer["at"] = time.monotonic()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        wait_until(lambda: blocked_in_the_tool(server.proc.pid), timeout=30)
        signalled = time.monotonic()
        code, last = server.stop()
    finally:
        writer.join(60)
    assert answer["at"] - signalled < 5, answer  # at once, not after the grace
    assert (answer["status"], answer["type"]) == (201, "application/json"), answer
    body = answer["body"]
    assert body["created"] is True and body["idle"] is False
    assert body["tree"]["start_id"] == "w1" and body["tree"]["classification"] == "progress"
    assert code == 0 and json.loads(last)["stopped"] is True, server.logs()


def test_a_request_during_the_drain_takes_no_run_over_and_makes_no_call(tmp_path: Path) -> None:
    # A POST /runs in progress at SIGTERM with the start id of a run nobody owned took it over:
    # the activation dispatched its same_identity receipt again after the signal.
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    log = tmp_path / "side-effects.jsonl"
    crashed = subprocess.run(
        [sys.executable, "-m", "agentfold.adapters.cli", "--json", "kernel-demo-run", "--store", store,
         "--side-effect-log", str(log), "--start-id", "order-1", "--crash-after", "in-dispatch:2"],
        cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=60,
    )
    assert crashed.returncode != 0, crashed.stdout
    tree_id = TreeID.for_start(StartID("order-1"))
    reader = EventStore(store)
    try:
        before = reader.read(tree_id)
    finally:
        reader.close()
    receipts = [json.loads(line) for line in log.read_text().splitlines() if '"send_receipt"' in line]
    assert len(receipts) == 1  # sent by the process that died, its outcome not recorded

    server = start_server(store, tmp_path, "--adopt-every", "0", "--side-effect-dir", str(tmp_path))
    body = json.dumps({"program": "demo.payment", "input": before[0].event.input, "start_id": "order-1",
                       "wait": 5}).encode()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall((f"POST /runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode())
        time.sleep(0.5)  # the request is in progress ...
        server.proc.send_signal(signal.SIGTERM)  # ... when the server starts stopping
        time.sleep(0.5)
        sock.sendall(body)
        sock.settimeout(20)
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    code, _ = server.stop()
    assert code == 0, server.logs()
    assert response.startswith(b"HTTP/1.1 200"), response[:300]
    answered = json.loads(response.partition(b"\r\n\r\n")[2])
    assert answered["created"] is False and answered["idle"] is False
    reader = EventStore(store)
    try:
        after = reader.read(tree_id)
    finally:
        reader.close()
    added = [r.event for r in after[len(before):]]
    assert not any(isinstance(e, (WriterActivated, EffectDispatched)) for e in added), added
    assert len([line for line in log.read_text().splitlines() if '"send_receipt"' in line]) == 1


def crashed_payment(store: str, log: Path, start_id: str) -> TreeID:
    """A demo.payment run whose process died inside its receipt call (same_identity): nobody owns it."""
    done = subprocess.run(
        [sys.executable, "-m", "agentfold.adapters.cli", "--json", "kernel-demo-run", "--store", store,
         "--side-effect-log", str(log), "--start-id", start_id, "--crash-after", "in-dispatch:2"],
        cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 75, done.stderr
    return TreeID.for_start(StartID(start_id))


def test_a_signal_during_the_startup_adoption_stops_the_server_cleanly(tmp_path: Path) -> None:
    # The signal handlers were installed only once the startup adoption (--recover) was done:
    # a SIGTERM during it killed the process (exit -15, nothing printed), leaving runs it had
    # just taken over with dispatch permissions for calls never made.
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    log = tmp_path / "side-effects.jsonl"
    trees = [crashed_payment(store, log, f"order-{i}") for i in range(3)]

    def receipts() -> int:
        return sum('"send_receipt"' in line for line in log.read_text().splitlines())

    assert receipts() == 3
    reader = EventStore(store)
    try:
        before = {t: len(reader.read(t)) for t in trees}
    finally:
        reader.close()
    env = {**server_env(), "AGENTFOLD_SERVE_RECOVER_PAUSE": "20"}  # after each run it takes over
    server = subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "serve", "--store", store, "--port", "0", "--json",
         "--recover", "--adopt-every", "0", "--side-effect-dir", str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    def taken_over() -> bool:
        reader = EventStore(store)
        try:
            return any(isinstance(r.event, WriterActivated) for r in reader.read(trees[0]))
        finally:
            reader.close()

    try:
        wait_until(taken_over, timeout=30)  # the first run is taken over (its receipt dispatched again) ...
        time.sleep(0.5)  # ... and the server pauses before the next (the hook)
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = server.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert server.returncode == 0, err
    # Stopped by the signal, not at the last resort 15 s later (SERVE_STOP_LIMIT: a mutation
    # audit found an adoption the signal did not stop, ended only by that bound, undetected).
    assert "still not stopped" not in err and took < 12, (took, err)
    (last,) = out.splitlines()  # never listened: no start line, only the final report
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 0}
    reader = EventStore(store)
    try:
        first, *rest = [reader.read(t) for t in trees]
    finally:
        reader.close()
    # The one taken over: its call recorded (drained), none permitted without a call.
    dispatched = {r.event.effect_id for r in first if isinstance(r.event, EffectDispatched)}
    settled = {r.event.effect_id for r in first if type(r.event).__name__ == "EffectSettled"}
    assert dispatched <= settled, first[before[trees[0]]:]
    # The others were left to the next owner, untouched.
    assert [len(r) for r in rest] == [before[t] for t in trees[1:]]
    assert receipts() == 3  # the demo's mailer sends a receipt once per message id


def test_a_refused_address_is_the_only_stderr_line_even_with_a_short_token(tmp_path: Path) -> None:
    # Found by a review of the CLI against docs/cli.md ("On failure, exactly one line goes to
    # stderr"): the short-token warning came first, then the refusal of the port.
    from tests.test_cli import agentfold, refused

    ran = refused(agentfold("serve", "--port", "99999", "--json", store=f"sqlite:///{tmp_path / 'a.db'}",
                            env={"AGENTFOLD_API_TOKEN": "tok"}))
    assert ran.error()["code"] == "cli.argument_invalid" and "--port" in ran.error()["message"]


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (Linux: /proc/PID/fd)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def signalled_while_opening(store: str, opening: Callable[[int], bool]) -> tuple[int, str, str, float]:
    """``serve --json`` on ``store``, SIGTERM while it opens a store that does not answer (0.5 s
    after ``opening(pid)`` says it reached the store): its exit status, stdout, stderr and the
    seconds from the signal to its exit."""
    server = subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "serve", "--store", store, "--port", "0", "--json"],
        cwd=ROOT, env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # Not a fixed delay: on a loaded machine the interpreter took longer than 2 s to reach the
        # store, and a signal before serve handles signals ends it as any process (CI: exit -15).
        deadline = time.monotonic() + 30
        while not opening(server.pid) and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.05)
        assert opening(server.pid), "serve never reached the store"
        time.sleep(0.5)
        assert server.poll() is None, server.communicate()
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=60)
        return server.returncode, out, err, time.monotonic() - signalled
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def test_a_signal_while_the_store_does_not_answer_at_startup_ends_serve_within_the_bound(tmp_path: Path) -> None:
    # The stop bound (StopGuard) started only once the store was open, and the opening ran on the
    # main thread, where a Python signal handler waits for the C call to return: with another
    # process holding SQLite's write lock, SIGTERM was not even noticed until the 30 s lock wait
    # failed (exit 1 after 27 s, store.unavailable). docs/http-api.md: exit 0 within 15 s of the
    # signal, also during a store outage.
    import sqlite3

    db = tmp_path / "agentfold.db"
    EventStore(f"sqlite:///{db}", create=True).close()
    lock = sqlite3.connect(str(db), timeout=30, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # held for the whole test
    try:
        code, out, err, took = signalled_while_opening(  # it waits for the lock
            f"sqlite:///{db}", opening=lambda pid: holds_open(pid, db))
    finally:
        lock.close()
    assert code == 0, err
    assert took < 22, (took, err)  # the 15 s bound, with room for a slow machine; before: 27 s
    (last,) = out.splitlines()  # it never listened: only the final report
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 0}
    assert "still not stopped 15 s after the signal" in err, err


def test_a_store_failure_at_startup_after_the_signal_is_the_stop_not_an_error(tmp_path: Path) -> None:
    # A PostgreSQL server that accepts connections and never answers: the opening waits for its
    # connection timeout. Signalled meanwhile, the server stopped with exit 1 and the store's
    # error (store.unavailable) once the opening failed, instead of its final report and 0.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        # connecting to a server that does not answer
        code, out, err, took = signalled_while_opening(f"postgresql://postgres@127.0.0.1:{port}/x",
                                                       opening=lambda pid: bool(accepted))
    finally:
        listener.close()
        for connection in accepted:
            connection.close()
    assert code == 0, err
    assert took < 22, (took, err)
    (last,) = out.splitlines()
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 0}
    assert "stopped before listening; meanwhile the store failed: store.unavailable" in err, err
