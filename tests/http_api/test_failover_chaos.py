"""Chaos on one store: three ``agentfold serve`` processes killed and restarted at random moments.

The failover promise, seen from outside: whatever server dies when, every run is driven on
(a survivor's scan adopts the runs nobody owns every ``--adopt-every`` seconds; input
adopts a parked one), no tool runs twice behind the user's back, no step is lost, and every
call whose outcome died with its server is listed as unknown (never silently made again)
until the host resolves it through the HTTP API, after which the run completes.

Real processes on a real SQLite file and a real PostgreSQL database: three servers with a
0.3 s scan. A chaos thread plays episodes at seeded random moments: it starts a few runs
through one server (runs of several tool calls: one round of two calls, two concurrent
calls, eight rounds, one call, one input wait), sometimes holds the store's write lock (a
stalled disk or database: the runs' calls are made and their outcomes wait to be
recorded), then kills that server with SIGKILL (sometimes SIGTERM) a random moment later
and restarts it on the same store, at once or later. One server is never stopped: the
runs started there, and a tool call blocked there during the whole chaos, must never be
taken from it. Meanwhile the host (this thread) resolves unknown effects and answers input
waits through random servers, and one `agentfold recover` runs beside the servers. Two
runs have a tool blocked in a FIFO nobody reads (a call certainly in flight) when their
server dies: the first early in the chaos (adopted by a scan or by `recover`), the last at
its end (nothing but a scan can adopt it). Each tool writes one line per real execution to
its run's log (a file, or a FIFO the test reads), counted here, outside the processes.

``AGENTFOLD_CHAOS_SEED`` picks the seed (default fixed, for CI); every failure message names
it and the schedule's outcome, so that a failing seed can be run again.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.http_api.support import TOKEN, ApiServer, start_server
from tests.http_api.test_serve_failover import activations, kill, store  # noqa: F401 - a fixture
from tests.http_api.test_serve_failures import FifoReader, blocked_in_the_tool
from tests.test_cli import agentfold
from tests.test_cli_interaction import (
    LEFT_TO_HOST,
    alpha_result,
    approval,
    beta_result,
    logged_calls,
    one_tool_call,
    text,
    two_call_round,
)

SEED = int(os.environ.get("AGENTFOLD_CHAOS_SEED", "20261130"))
SERVERS = 3
STABLE = 0  # the slot whose server the chaos never stops: its runs must never be taken from it
SCAN = "0.3"  # seconds between each server's scans for runs nobody owns
EPISODES = 9  # kills at random moments (the two FIFO runs' kills come on top)
RUNS = 18  # runs with a side-effect log file or an input wait
HOST_FINAL = {"finish_reason": "stop", "message": {"content": "done (the host answered the last model call)"}}
# Eight model rounds, nine tool calls; the first round's two calls run side by side.
ROUNDS = (("r1_a", "r1_b"), *((f"r{i}_a",) for i in range(2, 9)))


def many_rounds(log: Path) -> dict[str, Any]:
    """``ROUNDS``: a long run of model calls and tool calls; the last model call is left to the
    host, so that its request shows every tool result the run holds."""
    tools = []
    responses: list[dict[str, Any]] = []
    for calls in ROUNDS:
        for call_id in calls:
            tool: dict[str, Any] = {"name": f"tool_{call_id}", "parameters": {"type": "object"},
                                    "result": {"output": f"{call_id} ran"}}
            if len(calls) > 1:
                tool["concurrency"] = {"key": f"api_{call_id}", "concurrent": True}
            tools.append(tool)
        responses.append({"finish_reason": "tool_calls", "message": {"content": "", "tool_calls": [
            {"id": call_id, "name": f"tool_{call_id}", "arguments": "{}"} for call_id in calls]}})
    return {
        "name": "many-rounds",
        "model": {"responses": [*responses, LEFT_TO_HOST]},
        "tools": tools,
        "limits": {"max_concurrent_tool_calls": 2},
        "side_effect_log": str(log),
    }


def host_output(call_id: str) -> str:
    return f"host:{call_id}"


@dataclass
class Run:
    start_id: str
    kind: str
    doc: dict[str, Any]
    log: Path | None  # the side-effect log file counted here (None: an input-wait run, a FIFO run)
    # call id -> the tool's own output as the next model request shows it (None: not shown,
    # the run's last model call is scripted)
    outputs: dict[str, Any]
    fifo: Path | None = None
    reader: FifoReader | None = None  # what a FIFO run's tool wrote, once the test reads it
    stable: bool = False  # created through the server the chaos never stops
    released: bool = False  # the chaos thread tried to start it (the host retries until created)
    created: bool = False
    tree_id: str | None = None
    # call id -> its side-effect count when the host first saw it listed unknown
    seen_unknown: dict[str, int] = field(default_factory=dict)
    unknown_codes: list[tuple[str, str]] = field(default_factory=list)  # (kind, diagnostic code)
    final_results: dict[str, Any] | None = None  # call id -> output, from the last model call's request
    resolved: set[str] = field(default_factory=set)  # effect ids whose resolution was accepted
    # The host answers the last model call a little later: the parked run stays with its owner,
    # which may die meanwhile (the answer then adopts the run).
    final_due: float | None = None

    def executions(self) -> Counter[str]:
        """Each call's real executions (side-effect lines) so far."""
        if self.log is not None:
            return Counter(logged_calls(self.log))
        if self.reader is not None:
            return Counter(r["call_id"] for r in self.reader.records)
        return Counter()

    @property
    def final_left_to_host(self) -> bool:
        return bool(self.doc["model"]["responses"][-1] == LEFT_TO_HOST)


def plan_runs(folder: Path) -> list[Run]:
    kinds = ["rounds", "round", "concurrent", "rounds", "pay", "approval"]
    runs = []
    two = {"call_a": alpha_result()["output"], "call_b": beta_result()["output"]}
    for i in range(RUNS):
        kind, log, start_id = kinds[i % len(kinds)], folder / f"run-{i}.jsonl", f"chaos-{i}"
        if kind == "rounds":
            outputs = {c: {"content": text(f"{c} ran")} for calls in ROUNDS for c in calls}
            runs.append(Run(start_id, kind, many_rounds(log), log, outputs))
        elif kind == "round":
            runs.append(Run(start_id, kind, two_call_round(log), log, two))
        elif kind == "concurrent":
            runs.append(Run(start_id, kind, two_call_round(log, concurrent=True), log, two))
        elif kind == "pay":
            runs.append(Run(start_id, kind, one_tool_call(log), log, {"c1": None}))
        else:
            runs.append(Run(start_id, kind, approval(None), None, {}))
    return runs


def fifo_run(folder: Path, name: str) -> Run:
    fifo = folder / f"{name}.fifo"
    os.mkfifo(fifo)
    return Run(name, "fifo", one_tool_call(fifo), None, {"c1": None}, fifo=fifo)


class StoreGate:
    """The store's write lock, held by the test (a stalled disk, a busy database): while it
    is held, the servers' appends wait, so that a run's call is made and the outcome waits
    to be recorded. Held for well under the stores' lock waits (SQLite: 5 s)."""

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            import sqlite3

            self.conn: Any = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=30,
                                             check_same_thread=False)
            self.lock_statements = ["BEGIN IMMEDIATE"]
        else:
            import psycopg

            self.conn = psycopg.connect(url, autocommit=True)
            self.lock_statements = ["BEGIN", "LOCK TABLE agentfold_events IN EXCLUSIVE MODE"]
        self.held = False
        self.times = 0

    def close_(self) -> None:
        for statement in self.lock_statements:
            self.conn.execute(statement)
        self.held = True
        self.times += 1

    def open_(self) -> None:
        if self.held:
            self.conn.execute("ROLLBACK")
            self.held = False

    def dispose(self) -> None:
        self.open_()
        self.conn.close()


class Cluster:
    """The server slots: each holds the current ``agentfold serve`` process (None: dead)."""

    def __init__(self, url: str, folder: Path) -> None:
        self.store = url
        self.folder = folder
        self.lock = threading.Lock()
        self.slots: list[ApiServer | None] = [None] * SERVERS
        self.every: list[ApiServer] = []  # every process started, for their logs
        self.kills = 0
        self.terms = 0
        self.problems: list[str] = []  # what went wrong in the chaos thread

    def start(self, slot: int) -> ApiServer:
        server = start_server(self.store, self.folder, "--adopt-every", SCAN)
        with self.lock:
            self.slots[slot] = server
            self.every.append(server)
        return server

    def live(self) -> list[ApiServer]:
        with self.lock:
            return [s for s in self.slots if s is not None]

    def dead(self) -> list[int]:
        with self.lock:
            return [i for i, s in enumerate(self.slots) if s is None]

    def stop(self, slot: int, *, term: bool) -> None:
        with self.lock:
            server = self.slots[slot]
            self.slots[slot] = None
        assert server is not None
        if term:
            self.terms += 1
            code, last = server.stop()
            if code != 0 or '"stopped": true' not in last:
                self.problems.append(f"a server stopped by SIGTERM exited {code} ({last!r})")
        else:
            self.kills += 1
            kill(server)

    def logs(self) -> str:
        return "\n".join(f"--- server {s.proc.pid}\n{s.logs()}" for s in self.every)



def changed_owner(answer: httpx.Response) -> bool:
    """``409 engine.tree.incarnation_conflict``: the run got a new owner while the server took it
    over for this write (a live competitor; a dead server's takeover committed after its death no
    longer causes it: tests/test_zombie_takeover.py); nothing was recorded: docs/http-api.md says
    to send it again."""
    return answer.status_code == 409 and answer.json().get("code") == "engine.tree.incarnation_conflict"

class Host:
    """The user: starts runs, resolves unknown effects and answers input waits through random
    live servers (or the one given), and keeps what it observed. Used from two threads."""

    def __init__(self, cluster: Cluster, runs: dict[str, Run], rng: random.Random) -> None:
        self.cluster = cluster
        self.runs = runs
        self.rng = rng
        self.lock = threading.Lock()
        self.clients: dict[str, httpx.Client] = {}
        self.unexpected: list[str] = []  # answers a correct server never gives
        self.retried: Counter[str] = Counter()  # answers that only mean "try again" (transport, 503)
        self.lost: set[str] = set()  # requests whose answer was lost (what they asked may have happened)
        self.drive_errors: list[dict[str, Any]] = []
        self.hold: set[str] = set()  # runs whose unknown effects the host leaves alone for now

    def client(self, server: ApiServer) -> httpx.Client:
        with self.lock:
            if server.url not in self.clients:
                self.clients[server.url] = httpx.Client(base_url=server.url, timeout=60.0,
                                                        headers={"Authorization": f"Bearer {TOKEN}"})
            return self.clients[server.url]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def request(self, method: str, path: str, body: Any = None, key: str = "",
                server: ApiServer | None = None) -> httpx.Response | None:
        """One request; None when the server could not answer (killed, stopping: try again)."""
        if server is None:
            live = self.cluster.live()
            if not live:
                return None
            server = self.rng.choice(live)
        try:
            response = self.client(server).request(method, path, json=body)
        except httpx.HTTPError as exc:
            with self.lock:
                self.retried[type(exc).__name__] += 1
                self.lost.add(key)
            return None
        if response.status_code == 503:
            with self.lock:
                self.retried[f"503 {response.json().get('code')}"] += 1
                self.lost.add(key)
            return None
        if response.status_code >= 500:
            self.unexpected.append(f"{method} {path}: {response.status_code} {response.text}")
            return None
        return response

    def start_run(self, run: Run, server: ApiServer | None = None) -> None:
        key = f"start {run.start_id}"
        response = self.request("POST", "/runs", {"scenario": run.doc, "start_id": run.start_id, "wait": 0}, key,
                                 server)
        if response is None:
            return
        # 200 ("created": false) only after an attempt whose answer was lost: that one created it.
        if response.status_code == 201 or (response.status_code == 200 and key in self.lost):
            run.tree_id = response.json()["tree"]["tree_id"]
            run.stable = response.status_code == 201 and server is not None and server is self.cluster.slots[STABLE]
            run.created = True
            self.note_drive_error(response)
        elif response.status_code == 409 and response.json()["code"] == "engine.start.in_progress" and key in self.lost:
            # The lost attempt's append is still on its way (a PostgreSQL append outlives its
            # killed client until the lock it waits for is free): try again.
            with self.lock:
                self.retried["409 engine.start.in_progress"] += 1
        else:
            self.unexpected.append(f"POST /runs {run.start_id}: {response.status_code} {response.text}")

    def note_drive_error(self, response: httpx.Response) -> None:
        error = response.json().get("drive_error")
        if error is not None:
            self.drive_errors.append(error)

    def resolve_unknowns(self) -> None:
        response = self.request("GET", "/unknown-effects")
        if response is None:
            return
        if response.status_code != 200:
            self.unexpected.append(f"GET /unknown-effects: {response.status_code} {response.text}")
            return
        for entry in response.json()["unknown_effects"]:
            run = self.runs.get(entry["start_id"])
            if run is None:
                self.unexpected.append(f"an unknown effect of a run this test never started: {entry}")
                continue
            effect_id = entry["effect_id"]
            if run.start_id in self.hold:
                continue
            if effect_id in run.resolved:
                self.unexpected.append(f"listed unknown after its resolution was accepted: {entry}")
                continue
            body = self.resolution(run, entry)
            if body is None:
                continue
            key = f"resolve {effect_id}"
            answer = self.request("POST", f"/unknown-effects/{effect_id}/resolve", body, key)
            if answer is None:
                continue
            if answer.status_code == 200:
                run.resolved.add(effect_id)
                self.note_drive_error(answer)
            elif answer.status_code == 404 and answer.json()["code"] == "engine.effect.not_pending" and key in self.lost:
                run.resolved.add(effect_id)  # an earlier attempt was recorded; its answer was lost
            elif changed_owner(answer):
                self.retried["409 engine.tree.incarnation_conflict"] += 1  # listed again: resolved next time
            else:
                self.unexpected.append(f"resolve {entry['kind']} of {run.start_id}: {answer.status_code} {answer.text}")

    def resolution(self, run: Run, entry: dict[str, Any]) -> dict[str, Any] | None:
        """The host's resolution of an unknown effect (None: not yet); notes what the listing shows."""
        code = entry["diagnostic"]["code"]
        if entry["kind"] == "tool":
            call_id = entry["request"]["tool_call"]["invocation"]["call"]["id"]
            if call_id not in run.seen_unknown:
                run.unknown_codes.append(("tool", code))
                if run.reader is not None:  # the line is in the FIFO before the outcome is recorded
                    deadline = time.monotonic() + 5
                    while not run.reader.records and time.monotonic() < deadline:
                        time.sleep(0.02)
                run.seen_unknown[call_id] = run.executions()[call_id]
            return {"output": host_output(call_id), "wait": 0}
        assert entry["kind"] == "model", entry
        model_call = entry["request"]["model_call"]
        sequence = model_call["model_call_sequence"]
        if ("model", f"{sequence}:{code}") not in run.unknown_codes:
            run.unknown_codes.append(("model", f"{sequence}:{code}"))
        responses = run.doc["model"]["responses"]
        if sequence == len(responses) and run.final_left_to_host:
            if run.final_due is None:
                run.final_due = time.monotonic() + self.rng.uniform(0.0, 2.0)
            if time.monotonic() < run.final_due:
                return None
            # The last model call: its request holds every tool result of the run.
            run.final_results = {result["id"]: result["output"] for message in model_call["request"]["messages"]
                                 for result in message.get("tool_results", [])}
            return {"model_response": HOST_FINAL, "wait": 0}
        # An interrupted model call: the host answers what the model would have answered.
        return {"model_response": responses[sequence - 1], "wait": 0}

    def answer_inputs(self) -> None:
        response = self.request("GET", "/pending-inputs")
        if response is None:
            return
        if response.status_code != 200:
            self.unexpected.append(f"GET /pending-inputs: {response.status_code} {response.text}")
            return
        for pending in response.json()["pending"]:
            signal_id = "answer-" + pending["wait_id"].split(":")[1][:32]
            path = f"/processes/{pending['process_id']}/waits/{pending['wait_id']}/answer"
            key = f"answer {signal_id}"
            answer = self.request("POST", path, {"response": {"approved": True}, "signal_id": signal_id, "wait": 0}, key)
            if answer is None:
                continue
            if answer.status_code == 200 and (answer.json()["accepted"] or key in self.lost):
                self.note_drive_error(answer)
            elif changed_owner(answer):
                self.retried["409 engine.tree.incarnation_conflict"] += 1  # still pending: answered next time
            else:
                self.unexpected.append(f"answer {pending}: {answer.status_code} {answer.text}")

    def runs_listed(self) -> dict[str, dict[str, Any]] | None:
        response = self.request("GET", "/runs?limit=500")
        if response is None:
            return None
        if response.status_code != 200:
            self.unexpected.append(f"GET /runs: {response.status_code} {response.text}")
            return None
        return {r["start_id"]: r for r in response.json()["runs"]}


def chaos(cluster: Cluster, host: Host, planned: list[Run], fifos: list[Run], gate: StoreGate,
          rng: random.Random, done: threading.Event) -> None:
    """The chaos thread's episodes; the FIFO runs' servers certainly die with a call in flight;
    one `agentfold recover` runs beside the servers."""

    def in_flight_kill(run: Run) -> None:
        server = rng.choice([s for s in cluster.live() if s is not cluster.slots[STABLE]])
        for _attempt in range(5):
            if not run.created:
                host.start_run(run, server)
        assert run.created, f"{run.start_id} was not started: {host.unexpected}"
        deadline = time.monotonic() + 60
        while not blocked_in_the_tool(server.proc.pid):
            assert time.monotonic() < deadline, f"{run.start_id}: its tool never blocked in the FIFO"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        slot = cluster.slots.index(server)
        cluster.stop(slot, term=False)
        cluster.start(slot)

    def recover() -> None:
        recovered = agentfold("recover", "--json", store=cluster.store, timeout=120)
        if recovered.code != 0:
            cluster.problems.append(f"`agentfold recover` beside the servers exited {recovered.code}: "
                                    f"{recovered.stderr}")

    try:
        in_flight_kill(fifos[0])
        recovering = threading.Thread(target=recover, daemon=True)
        recovering.start()
        waiting = list(planned)
        per_episode = -(-len(planned) // EPISODES)
        for _episode in range(EPISODES):
            time.sleep(rng.uniform(0.2, 0.8))
            live = [i for i, s in enumerate(cluster.slots) if s is not None and i != STABLE]
            if not live:  # both others are down: one comes back first
                live = [cluster.dead()[0]]
                cluster.start(live[0])
            slot = rng.choice(live)
            victim = cluster.slots[slot]
            assert victim is not None
            # A few runs start on the victim (in parallel, as clients would), and it dies a
            # random moment later: before, during or after their calls. Sometimes they start
            # on the stable server instead, whose runs nobody may take while it lives.
            size = rng.randint(1, per_episode)
            burst, waiting = waiting[:size], waiting[size:]
            target = cluster.slots[STABLE] if rng.random() < 0.25 else victim
            starters = [threading.Thread(target=host.start_run, args=(run, target)) for run in burst]
            for starter in starters:
                starter.start()
            for run, starter in zip(burst, starters, strict=True):
                starter.join(60)
                run.released = True
            time.sleep(rng.uniform(0.0, 0.05))
            if rng.random() < 0.6:
                # The store stalls: calls made now wait for the append that records them.
                gate.close_()
                time.sleep(rng.uniform(0.05, 0.4))
            term = rng.random() < 0.2
            if term:
                gate.open_()  # a graceful stop waits for its owner lines' store calls
            cluster.stop(slot, term=term)
            if rng.random() < 0.5:
                time.sleep(rng.uniform(0.0, 0.3))  # the survivors' scans meet the stalled store
            # (A server starting creates what is missing in the store: it waits for the lock.)
            gate.open_()
            # Restarted at once (a supervisor) or a little later.
            if rng.random() < 0.5:
                cluster.start(slot)
            for other in cluster.dead():
                if other != slot and rng.random() < 0.7:
                    cluster.start(other)
        for run in waiting:
            run.released = True
        for slot in cluster.dead():
            cluster.start(slot)
        recovering.join(120)
        in_flight_kill(fifos[1])
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        cluster.problems.append(f"the chaos thread failed: {exc!r}")
    finally:
        gate.open_()
        for run in planned:
            run.released = True
        done.set()


def describe(host: Host, runs: dict[str, Run], cluster: Cluster, gate: StoreGate) -> str:
    listed = host.runs_listed() or {}
    lines = [f"seed {SEED} (AGENTFOLD_CHAOS_SEED); {cluster.kills} SIGKILL, {cluster.terms} SIGTERM, "
             f"store stalled {gate.times}x; {', '.join(cluster.problems)}"]
    for run in runs.values():
        row = listed.get(run.start_id, {})
        lines.append(f"{run.start_id} {run.kind} {run.tree_id}: {row.get('status')}/{row.get('classification')} "
                     f"v{row.get('version')}; unknown seen {run.seen_unknown}, codes {run.unknown_codes}")
    return "\n".join(lines)


def test_servers_killed_at_random_moments_run_no_tool_twice_lose_no_step_and_leave_only_unknowns_to_resolve(
    store: str, tmp_path: Path,  # noqa: F811 - the fixture imported above
) -> None:
    began = time.monotonic()
    rng = random.Random(SEED)
    cluster = Cluster(store, tmp_path)
    planned = plan_runs(tmp_path)
    fifos = [fifo_run(tmp_path, "fifo-first"), fifo_run(tmp_path, "fifo-last")]
    # A call in flight on the stable server during the whole chaos: no scan may take it.
    steady = fifo_run(tmp_path, "fifo-stable")
    runs = {run.start_id: run for run in [*planned, *fifos, steady]}
    host = Host(cluster, runs, random.Random(rng.random()))
    host.hold.add(fifos[1].start_id)  # until the quiet check below
    done = threading.Event()
    readers: list[FifoReader] = []
    gate: StoreGate | None = None

    def summary() -> str:
        assert gate is not None
        return describe(host, runs, cluster, gate)

    try:
        for slot in range(SERVERS):
            cluster.start(slot)  # the first creates the store's tables
        stable = cluster.slots[STABLE]
        assert stable is not None
        host.start_run(steady, stable)
        assert steady.created and steady.stable, host.unexpected
        deadline = time.monotonic() + 60
        while not blocked_in_the_tool(stable.proc.pid):
            assert time.monotonic() < deadline, "the stable server's tool never blocked in its FIFO"
            time.sleep(0.05)
        gate = StoreGate(store)
        thread = threading.Thread(target=chaos, args=(cluster, host, planned, fifos, gate,
                                                      random.Random(rng.random()), done), daemon=True)
        thread.start()

        # During the chaos the host starts what the chaos thread could not, and resolves and answers.
        while not done.is_set() or any(not r.created for r in planned):
            for run in planned:
                if run.released and not run.created:
                    host.start_run(run)
            host.resolve_unknowns()
            host.answer_inputs()
            time.sleep(0.1)
            assert time.monotonic() - began < 150, summary()
        thread.join(60)
        assert not cluster.problems, summary()
        # The stable server's call is still under way there, its run never taken by a scan.
        assert blocked_in_the_tool(stable.proc.pid), summary()
        assert steady.tree_id is not None and activations(store, steady.tree_id) == 0, summary()
        steady.reader = FifoReader(steady.fifo)  # type: ignore[arg-type]
        steady.reader.start()
        readers.append(steady.reader)

        # Quiet: nobody sends anything. Every run nobody drives must be adopted by a scan and
        # park (on an unknown outcome or an input wait) or end: none stays `progress`.
        deadline = time.monotonic() + 45
        while True:
            listed = host.runs_listed()
            if listed is not None and all(
                    listed.get(r.start_id, {}).get("classification") in ("parked", "terminal") for r in runs.values()):
                break
            assert time.monotonic() < deadline, "runs left in progress with nobody driving them\n" + summary()
            time.sleep(0.2)
        # The last FIFO run's call died with its server and only a scan could adopt the run: it
        # is listed unknown (interrupted), not made again.
        last = host.request("GET", f"/runs/{fifos[1].start_id}/unknown-effects")
        assert last is not None and last.status_code == 200
        assert [(u["kind"], u["diagnostic"]["code"]) for u in last.json()["unknown_effects"]] == [
            ("tool", "engine.dispatch.interrupted")], summary()
        host.hold.clear()

        # The host resolves every unknown and answers every wait: every run completes.
        deadline = time.monotonic() + 60
        while True:
            host.resolve_unknowns()
            host.answer_inputs()
            listed = host.runs_listed()
            if listed is not None and all(listed.get(r.start_id, {}).get("status") == "completed"
                                          for r in runs.values()):
                break
            assert time.monotonic() < deadline, "runs that did not complete\n" + summary()
            time.sleep(0.1)
        outcome = summary()

        # No server is inside a FIFO tool call (nobody called a FIFO run's tool again); once a
        # reader is there, nothing arrives either.
        for server in cluster.live():
            assert not blocked_in_the_tool(server.proc.pid), outcome
        for run in fifos:
            assert run.fifo is not None
            run.reader = FifoReader(run.fifo)
            run.reader.start()
            readers.append(run.reader)
        time.sleep(0.5)
        for run in fifos:
            assert run.executions() == Counter(), outcome
    finally:
        done.wait(120)
        for reader in readers:
            reader.stop()
        host.close()
        if gate is not None:
            gate.dispose()
        stopped = []
        for slot, running in enumerate(list(cluster.slots)):
            if running is not None:
                cluster.slots[slot] = None
                stopped.append(running.stop())
    assert all(code == 0 and '"stopped": true' in last for code, last in stopped), (stopped, cluster.logs())

    # What a user observes.
    assert host.unexpected == [], "\n".join(host.unexpected) + "\n" + outcome
    assert host.drive_errors == [], f"{host.drive_errors}\n{outcome}"
    for run in runs.values():
        counts = run.executions()
        # Every tool call's side effect happened at most once.
        assert all(n == 1 for n in counts.values()), f"{run.start_id}: a tool ran twice: {counts}\n{outcome}"
        assert set(counts) <= set(run.outputs), f"{run.start_id}: {counts}\n{outcome}"
        for call_id in run.outputs:
            if call_id in run.seen_unknown:
                # Listed unknown: never made again afterwards.
                assert counts[call_id] == run.seen_unknown[call_id], f"{run.start_id} {call_id}\n{outcome}"
            elif run.log is not None or run.reader is not None:
                # Never listed unknown: its recorded outcome is the tool's, from its one execution.
                assert counts[call_id] == 1, f"{run.start_id} {call_id}: its step was lost\n{outcome}"
        # The truth about unknown outcomes: only calls under way when their server died (and the
        # last model call, which the scenario leaves to the host).
        for kind, code in run.unknown_codes:
            if kind == "tool":
                assert code == "engine.dispatch.interrupted", f"{run.start_id}: {run.unknown_codes}\n{outcome}"
            else:
                sequence, model_code = code.split(":", 1)
                last_call = int(sequence) == len(run.doc["model"]["responses"]) and run.final_left_to_host
                allowed = {"engine.dispatch.interrupted", "engine.dispatch.failed"} if last_call else {
                    "engine.dispatch.interrupted"}
                assert model_code in allowed, f"{run.start_id}: {run.unknown_codes}\n{outcome}"
        if run.final_left_to_host:
            # The model's last request shows each call's outcome: the tool's own output exactly
            # when it was never unknown, the host's when it was.
            expected = {c: {"content": text(host_output(c))} if c in run.seen_unknown else out
                        for c, out in run.outputs.items()}
            assert run.final_results == expected, f"{run.start_id}\n{outcome}"
    for run in fifos:
        assert run.seen_unknown == {"c1": 0}, f"{run.start_id}\n{outcome}"
        assert run.tree_id is not None and activations(store, run.tree_id) >= 1, outcome
    # The stable server's call ran once, when the test read its FIFO, and its outcome was recorded.
    assert steady.executions() == Counter({"c1": 1}) and steady.unknown_codes == [], outcome
    # Runs created on the stable server were never taken from it: no other owner, nothing interrupted.
    for run in runs.values():
        if run.stable:
            assert run.tree_id is not None and activations(store, run.tree_id) == 0, f"{run.start_id}\n{outcome}"
            assert not any(code.endswith("interrupted") for _, code in run.unknown_codes), f"{run.start_id}\n{outcome}"
    # The chaos did kill owners of live runs: runs were adopted by other processes.
    adopted = sum(activations(store, run.tree_id) for run in runs.values() if run.tree_id is not None)
    assert adopted >= 2 and cluster.kills >= EPISODES // 2, outcome
    assert "Traceback" not in cluster.logs(), cluster.logs()
    interrupted = sum(code.endswith("engine.dispatch.interrupted") for r in runs.values() for _, code in r.unknown_codes)
    print(f"\nchaos seed {SEED}: {cluster.kills} SIGKILL, {cluster.terms} SIGTERM, store stalled {gate.times}x, "
          f"{adopted} activations, {interrupted} interrupted calls, retried {dict(host.retried)}, "
          f"{time.monotonic() - began:.1f} s")
