"""A realistic team run, observed through every surface agentfold has.

The team (docs/team.md): a **model coordinator** (``adapt`` around an Interaction whose model
reads the rendered Turn and answers a Decision as JSON text), and three workers: an
Interaction with a real tool (``team.researcher``), a transform (``team.summarize``) and an
InputGate (``team.approve``). Turn 1 starts the researcher and the gate and waits; the team
parks at the gate until a host answers it; the last turn completes with an output built from
the researcher's final answer and the human's answer.

That run is then looked at as a user would:

1. Python: ``Runtime`` + ``Host`` (``gates``, ``answer_gate``, ``unknown``, ``runs``, ``run``);
2. the CLI through a console script that binds the Programs (``cli`` below, docs/python.md):
   ``trees``, ``show``, ``audit verify --all``, ``audit drift``, ``replay --at``, ``export``,
   ``import`` into a fresh store and ``audit verify`` there;
3. the read models (``project``, then the tables, docs/read-models.md);
4. the HTTP API (``serve`` from the console script, in its own process);
5. the Kafka feed (``publish --once``) and the transcripts consumer (``transcripts --once``).

And a team that fails (its coordinator fails, or returns a Decision the team refuses): its
folded state must stay readable (``wait_idle``, ``capture``, a snapshot).

The coordinator's model: ``ScriptedModel`` scripts the n-th model call *of one Process*, and
each turn of a coordinator is a new Process (a new Interaction whose first call is call 1), so
a plain script would answer every turn with its first entry. ``TurnModel`` therefore answers
with a one-entry ``ScriptedModel`` built for the Turn it reads in the request: a deterministic
model, so recovery, ``audit drift`` and ``replay`` see exactly the same answers.

Run as a console script (``python -m tests.test_team_surfaces ARGS``, or ``cli(argv)`` in
process); the module re-imports itself by its package name so every process binds the same
ProgramRefs (a transform's default identity, an adapter's ``build_input`` and a tool class are
named by their module).
"""

from __future__ import annotations

import contextlib
import io
import json
import select
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import AdapterConfig, InteractionConfig, adapt, compile_interaction
from agentfold.adapters.models import ModelRequest, ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources, default_sources
from agentfold.adapters.team import (
    DECISION_SCHEMA,
    TURN_SCHEMA,
    InputGateConfig,
    TeamConfig,
    TeamMember,
    TransformConfig,
    compile_input_gate,
    compile_team,
    transform,
)
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.canonical import JSON, digest_of
from agentfold.domain.ids import Digest
from agentfold.domain.program import Program

ROOT = Path(__file__).resolve().parent.parent
START_ID = "surfaces-1"
QUESTION = "Which retry policy should the billing service use?"
FINDING = "Use exponential backoff capped at 30 s (policy doc RP-7)."
APPROVAL = {"approved": True, "by": "ana"}
APPROVE_PROMPT = "Publish the research on retries?"
TEXT: JSON = {"type": "string"}


# ---------------------------------------------------------------------------
# The team


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def final(text: str) -> dict[str, Any]:
    return {"finish_reason": "stop", "message": {"role": "assistant", "content": [{"type": "text", "text": text}]}}


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content") or []
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


class PolicyDocs:
    """The researcher's tool: looks up a policy document (real, counted calls)."""

    name = "policy_docs"
    description = "Look up the engineering policy documents."
    parameters: JSON = {"type": "object", "required": ["topic"], "properties": {"topic": {"type": "string"}}}
    calls: list[JSON] = []

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        PolicyDocs.calls.append(arguments)
        assert isinstance(arguments, dict)
        return ToolOutput.text(f"RP-7: {arguments['topic']}: exponential backoff, cap 30 s",
                               details={"doc": "RP-7"})


def researcher_model() -> ScriptedModel:
    return ScriptedModel([
        {"finish_reason": "tool_calls",
         "message": {"role": "assistant", "tool_calls": [
             {"id": "look-1", "name": "policy_docs", "arguments": json.dumps({"topic": "retries"})}]}},
        final(FINDING),
    ])


def decide_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """What the coordinator's model answers to a Turn (deterministic in the Turn)."""
    done = {t["request"]["key"]: t["outcome"]["result"] for t in turn["tasks"] if "outcome" in t}
    state = turn["state"]
    if not turn["tasks"]:
        return {"mode": "wait", "state": state, "tasks": [
            {"key": "research", "worker": "team.researcher", "input": {"messages": [user(state["question"])]}},
            {"key": "approve", "worker": "team.approve", "input": APPROVE_PROMPT},
        ]}
    if "research" in done and "approve" in done:
        research, approval = done["research"], done["approve"]
        return {"mode": "", "state": state, "output": {
            "question": state["question"],
            "finding": text_of(research["output"]["model_response"]["message"]),
            "approved": approval["output"]["payload"]["approved"],
            "approved_by": approval["output"]["payload"]["by"],
            "answer_signal": approval["output"]["id"],
        }}
    return {"mode": "wait", "state": state}


class TurnModel:
    """The coordinator's model: reads the Turn from the request and answers its Decision."""

    def call(self, request: ModelRequest) -> dict[str, Any]:
        turn = json.loads(text_of(request.messages[-1]))
        return ScriptedModel([final(json.dumps(decide_turn(turn), sort_keys=True))]).call(request)


def render_turn(turn: JSON) -> JSON:
    return {"messages": [user(json.dumps(turn, sort_keys=True))]}


def parse_decision(output: JSON) -> JSON:
    assert isinstance(output, dict)
    decision: JSON = json.loads(text_of(output["model_response"]["message"]))
    return decision


def summarize(text: JSON) -> JSON:
    return f"summary: {text}"


def build_team() -> Program:
    budget = Budget(steps=Quota(64), effects=Quota(64), signals=Quota(16))
    inner = Budget(steps=Quota(32), effects=Quota(32), signals=Quota(8))
    # Explicit identities: pytest imports this file as ``test_team_surfaces``, the console script
    # as ``tests.test_team_surfaces``; default identities (module-qualified names) would differ.
    coordinator_interaction = compile_interaction(InteractionConfig(
        "team.coordinator.model", TurnModel(), max_model_calls=2, model_identity=Digest.of(b"team_surfaces.TurnModel/1")))
    coordinator = adapt(AdapterConfig(
        "team.coordinator", coordinator_interaction, build_input=render_turn, decode_output=parse_decision,
        input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA, budget=inner,
        # AdapterConfig names build_input/decode_output by module; only the whole digest can be given.
        configuration_digest=digest_of({"interaction": coordinator_interaction.ref.digest, "budget": inner.to_json(),
                                        "build_input": "team_surfaces.render_turn/1",
                                        "decode_output": "team_surfaces.parse_decision/1"}),
    ))
    researcher = compile_interaction(InteractionConfig(
        "team.researcher", researcher_model(), "Researches a question.", tools=[PolicyDocs()], max_model_calls=4,
        tool_budget=Budget(steps=Quota(8), effects=Quota(8), signals=Quota(4)),
        tool_identity=Digest.of(b"team_surfaces.PolicyDocs/1")))
    approve = compile_input_gate(InputGateConfig(
        "team.approve", {"type": "object", "required": ["approved", "by"],
                         "properties": {"approved": {"type": "boolean"}, "by": {"type": "string"}}},
        "Asks a human to approve."))
    summarizer = transform(TransformConfig("team.summarize", summarize, "Summarizes a text.", input_schema=TEXT,
                                           output_schema=TEXT, identity="tests.team_surfaces.summarize/1"))
    return compile_team(TeamConfig(
        "team.research_desk", coordinator=TeamMember(coordinator, budget),
        workers=[TeamMember(researcher, budget), TeamMember(summarizer, budget), TeamMember(approve, budget)],
        state_schema={"type": "object", "required": ["question"]},
        max_turns=6, max_tasks=4, max_concurrent_tasks=3, max_controls_per_turn=1,
    ))


TEAM = build_team()


def sources() -> ProgramSources:
    return default_sources().plus(ProgramSources(programs=(TEAM,)))


def cli(argv: list[str] | None = None) -> int:
    """The deployment's console script: agentfold's CLI with the team bound."""
    from agentfold.adapters.cli import main as agentfold_main

    return agentfold_main(argv, sources=sources())


def run_cli(*argv: str, store: str | None = None) -> tuple[int, str]:
    """``myapp ARGS... [--store STORE]`` in this process: its exit status and what it printed."""
    out = io.StringIO()
    err = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli([*argv, *(["--store", store] if store else [])])
    return status, out.getvalue() + err.getvalue()


def cli_json(*argv: str, store: str | None = None, expect: int = 0) -> Any:
    status, text = run_cli(*argv, "--json", store=store)
    assert status == expect, f"{argv}: exit {status}\n{text}"
    return json.loads(text)


# ---------------------------------------------------------------------------
# One run, driven in Python (surface 1)


def run_team(url: str, while_parked: Any = None) -> dict[str, Any]:
    """Start the team, answer its gate as a host, and return what the host observed;
    ``while_parked(seen)`` runs while the team waits at its gate."""
    PolicyDocs.calls.clear()
    seen: dict[str, Any] = {}
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([TEAM])) as runtime:
            host = Host(runtime)
            run = runtime.start(TEAM, {"question": QUESTION}, start_id=START_ID)
            seen["tree_id"] = str(run.tree_id)
            runtime.wait_idle(run.tree_id)
            seen["parked_run"] = host.run(START_ID)
            seen["parked_runs"] = list(host.runs())
            seen["gates"] = host.gates(START_ID)
            seen["unknown"] = host.unknown(START_ID)
            if while_parked is not None:
                while_parked(seen)
            [gate] = seen["gates"]
            seen["answered"] = host.answer_gate(gate["process_id"], gate["wait_id"], APPROVAL, signal_id="approve-1")
            seen["answered_again"] = host.answer_gate(gate["process_id"], gate["wait_id"], APPROVAL,
                                                      signal_id="approve-1")
            result = run.result(timeout=30)
            seen["status"], seen["output"] = result.status, result.output
            seen["final_run"] = host.run(START_ID)
            seen["final_runs"] = list(host.runs())
            seen["final_unknown"] = host.unknown()
            seen["gates_after"] = host.gates(START_ID)
    finally:
        store.close()
    seen["tool_calls"] = list(PolicyDocs.calls)
    return seen


EXPECTED_OUTPUT = {"question": QUESTION, "finding": FINDING, "approved": True, "approved_by": "ana",
                   "answer_signal": "approve-1"}

#: The Processes of the finished run, in creation order: (child key, Program, is an Interaction, status).
EXPECTED_PROCESSES = [
    (None, "team.research_desk", False, "completed"),
    ("collaboration.turn.1", "team.coordinator", False, "completed"),
    ("adapter.interaction", "team.coordinator.model", True, "completed"),
    ("research", "team.researcher", True, "completed"),
    ("approve", "team.approve", False, "completed"),
    ("interaction.tool.1.0", "team.researcher.tools", False, "completed"),
    ("collaboration.turn.2", "team.coordinator", False, "completed"),
    ("adapter.interaction", "team.coordinator.model", True, "completed"),
    ("collaboration.turn.3", "team.coordinator", False, "completed"),
    ("adapter.interaction", "team.coordinator.model", True, "completed"),
]


def processes_of(summary: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(p["child_key"], p["program"], p["interaction"], p["status"]) for p in summary["processes"]]


def test_python_runtime_and_host_see_the_team_park_at_its_gate_and_complete(durable_store_url: str) -> None:
    seen = run_team(durable_store_url)
    # Parked: the researcher has finished, the gate waits for a human.
    parked = seen["parked_run"]
    assert (parked["status"], parked["classification"]) == ("waiting", "parked"), parked
    assert {p["child_key"]: p["status"] for p in parked["processes"]}["research"] == "completed"
    assert {p["child_key"]: p["status"] for p in parked["processes"]}["approve"] == "waiting"
    [gate] = seen["gates"]
    assert (gate["task"], gate["request"], gate["parent_id"]) == ("approve", APPROVE_PROMPT,
                                                                   parked["root_process_id"]), gate
    assert gate["answer_schema"]["required"] == ["approved", "by"]
    assert seen["unknown"] == []
    assert [(r["start_id"], r["classification"]) for r in seen["parked_runs"]] == [(START_ID, "parked")]
    # The answer is admitted once; the same answer again is deduplicated.
    assert (seen["answered"], seen["answered_again"]) == (True, False)
    # The team completes with an output built from both tasks; the tool ran once.
    assert (seen["status"], seen["output"]) == ("completed", EXPECTED_OUTPUT)
    assert seen["tool_calls"] == [{"topic": "retries"}]
    final_run = seen["final_run"]
    assert (final_run["status"], final_run["classification"], final_run["output"]) == (
        "completed", "terminal", EXPECTED_OUTPUT), final_run
    assert processes_of(final_run) == EXPECTED_PROCESSES
    assert [(r["start_id"], r["status"], r["program"]) for r in seen["final_runs"]] == [
        (START_ID, "completed", "team.research_desk")]
    assert seen["final_unknown"] == [] and seen["gates_after"] == []


# ---------------------------------------------------------------------------
# The CLI through the console script (surface 2)


def fresh_store(url: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'imported.db'}"
    from tests.conftest import fresh_pg_database

    return fresh_pg_database(request)


def test_the_console_script_lists_shows_audits_replays_exports_and_imports_the_team_run(
    durable_store_url: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    url = durable_store_url
    seen = run_team(url)
    tree_id = seen["tree_id"]

    [row] = cli_json("trees", store=url)["trees"]
    assert (row["tree_id"], row["start_id"], row["program"], row["status"], row["classification"]) == (
        tree_id, START_ID, "team.research_desk", "completed", "terminal")
    version = row["version"]

    shown = cli_json("show", START_ID, store=url)
    assert shown["classification"] == "terminal"
    root = next(p for p in shown["processes"] if p["parent_id"] is None)
    assert (root["status"], root["output"]) == ("completed", EXPECTED_OUTPUT)
    keys = [p["child_key"] for p in shown["processes"]]
    assert {"collaboration.turn.1", "collaboration.turn.2", "collaboration.turn.3", "research", "approve"} <= set(keys)
    status, text = run_cli("show", START_ID, store=url)
    assert status == 0 and "team.research_desk  completed" in text and FINDING in text, text

    verified = cli_json("audit", "verify", "--all", store=url)
    assert (verified["ok"], verified["trees"], verified["events"], verified["first_error"]) == (True, 1, version, None)
    [result] = verified["results"]
    assert (result["tree"], result["ok"], result["programs_bound"], result["problems"]) == (tree_id, True, True, [])

    drift = cli_json("audit", "drift", START_ID, store=url)
    assert (drift["ok"], drift["first_drift"], drift["error"], drift["events"]) == (True, None, None, version), drift
    assert drift["decisions"] > 0

    # Export, and find where the human's answer was admitted: replay just before it.
    out = tmp_path / "team.jsonl"
    exported = cli_json("export", START_ID, "--out", str(out), store=url)
    assert (exported["tree_id"], exported["events"]) == (tree_id, version)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[-1] == {"end": {"events": version, "head_digest": row["head_digest"]}, "tree": tree_id}
    answer_at = next(r["position"] for r in records[:-1]
                     if r["topic"].endswith("SignalAdmitted") and "approve-1" in r["state"])
    replay = cli_json("replay", START_ID, "--at", str(answer_at - 1), store=url)
    assert (replay["position"], replay["programs_bound"]) == (answer_at - 1, True)
    assert replay["tree"]["classification"] == "parked"
    states = {p["child_key"]: p["status"] for p in replay["tree"]["processes"]}
    assert (states[None], states["research"], states["approve"]) == ("waiting", "completed", "waiting")
    interactions = [p["process_id"] for p in replay["tree"]["processes"]
                    if p["program"]["name"] in ("team.researcher", "team.coordinator.model")]
    assert set(replay["working_context"]) == set(interactions), replay["working_context"].keys()
    at_end = cli_json("replay", START_ID, "--at", str(version), store=url)
    assert at_end["tree"] == shown

    # Import into a fresh store: verified there, and the same run.
    target = fresh_store(url, tmp_path, request)
    imported = cli_json("import", str(out), store=target)
    assert (imported["tree_id"], imported["events"], imported["written"], imported["changed"],
            imported["programs_bound"]) == (tree_id, version, version, True, True), imported
    there = cli_json("audit", "verify", "--all", store=target)
    assert (there["ok"], there["trees"], there["events"]) == (True, 1, version), there
    assert cli_json("show", START_ID, store=target) == shown
    assert cli_json("audit", "drift", START_ID, store=target)["ok"] is True
    again = cli_json("import", str(out), store=target)
    assert (again["changed"], again["written"]) == (False, 0)


# ---------------------------------------------------------------------------
# Read models (surface 3)


def test_the_console_script_answers_the_gate_and_drives_the_team_to_its_end(durable_store_url: str,
                                                                             tmp_path: Path) -> None:
    """``gates RUN`` (and ``GET /runs/{tree}/gates``) list the waiting gate; ``answer PROCESS WAIT
    JSON`` takes an InputGate's wait as well as a tool's (the same ``answer_signal`` serves
    ``Host.answer`` and ``POST .../answer``): a bad answer is refused with nothing stored, the good
    one is admitted and the console script drives the team to its end."""
    url = durable_store_url
    PolicyDocs.calls.clear()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([TEAM])) as runtime:
            run = runtime.start(TEAM, {"question": QUESTION}, start_id=START_ID)
            runtime.wait_idle(run.tree_id)
            [gate] = Host(runtime).gates(START_ID)
        head = store.max_notification_id()
    finally:
        store.close()
    # Listing the waiting gate: the console script, and a plain `agentfold serve` (a gate is told by
    # its wait: listing needs no Program bound).
    assert cli_json("gates", START_ID, store=url) == {"gates": [gate]}
    assert cli_json("gates", "no-such-run", store=url, expect=2)["error"]["code"] == "engine.tree.not_found"
    from tests.http_api.support import ok, problem, start_server

    server = start_server(url, tmp_path)
    try:
        with server.client() as client:
            assert ok(client.get(f"/runs/{START_ID}/gates")) == {"gates": [gate]}
            problem(client.get("/runs/no-such-run/gates"), 404, "engine.tree.not_found")
    finally:
        server.stop()
    refused = cli_json("answer", gate["process_id"], gate["wait_id"], json.dumps({"approved": "yes"}), store=url,
                       expect=2)
    assert refused["error"]["code"] == "engine.signal.schema", refused
    store = EventStore(url)
    try:
        assert store.max_notification_id() == head
    finally:
        store.close()
    answered = cli_json("answer", gate["process_id"], gate["wait_id"], json.dumps(APPROVAL), "--signal-id",
                        "approve-1", store=url)
    assert answered["accepted"] is True and answered["tree"]["status"] == "completed", answered
    again = cli_json("answer", gate["process_id"], gate["wait_id"], json.dumps(APPROVAL), "--signal-id", "approve-1",
                     store=url)
    assert again["accepted"] is False
    [tree] = cli_json("trees", store=url)["trees"]
    assert (tree["start_id"], tree["status"]) == (START_ID, "completed")
    shown = cli_json("show", START_ID, store=url)
    root = shown["processes"][0]
    assert root["output"] == EXPECTED_OUTPUT


def rm_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as conn:
            return list(conn.execute(sql).fetchall())
    import psycopg

    with psycopg.connect(url) as conn:
        return list(conn.execute(sql).fetchall())


def body(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def test_project_writes_the_team_run_into_the_read_model_tables_parked_then_completed(durable_store_url: str) -> None:
    url = durable_store_url
    parked_rows: list[tuple[Any, ...]] = []

    def project_while_parked(seen: dict[str, Any]) -> None:
        status, text = run_cli("project", store=url)
        assert status == 0, text
        parked_rows.extend(rm_rows(url, "SELECT status, classification, pending_count, unknown_count, body "
                                        "FROM agentfold_rm_runs"))

    seen = run_team(url, while_parked=project_while_parked)
    [(status, classification, pending, unknown, parked_body)] = parked_rows
    assert (status, classification, pending, unknown) == ("waiting", "parked", 0, 0)
    assert body(parked_body) == seen["parked_run"]

    status, text = run_cli("project", store=url)
    assert status == 0, text
    [(tree_id, start_id, program, status, classification, version, projected, run_body)] = rm_rows(
        url, "SELECT tree_id, start_id, program, status, classification, version, events_projected, body "
             "FROM agentfold_rm_runs")
    assert (tree_id, start_id, program, status, classification) == (
        seen["tree_id"], START_ID, "team.research_desk", "completed", "terminal")
    assert projected == version == seen["final_run"]["version"]
    assert body(run_body) == seen["final_run"]
    assert body(run_body)["output"] == EXPECTED_OUTPUT
    assert processes_of(body(run_body)) == EXPECTED_PROCESSES
    for table in ("agentfold_rm_pending_inputs", "agentfold_rm_unknown_effects", "agentfold_rm_corrupt_trees",
                  "agentfold_rm_settled_results", "agentfold_rm_delegates"):
        assert rm_rows(url, f"SELECT count(*) FROM {table}") == [(0,)], table
    # The tables agree with the history.
    verified = cli_json("audit", "verify", "--all", store=url)
    assert verified["ok"] and verified["results"][0]["read_model"] == "equal", verified


# ---------------------------------------------------------------------------
# The HTTP API (surface 4)


def test_serve_from_the_console_script_answers_the_team_run(durable_store_url: str, tmp_path: Path) -> None:
    from tests.http_api.support import TOKEN, ok, server_env

    url = durable_store_url
    seen = run_team(url)
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "tests.test_team_surfaces", "serve", "--store", url, "--port", "0", "--json"]
    with log.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=server_env())
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        assert line, f"the server did not start\n{log.read_text()}"
        base = json.loads(line)["listening"]
        import httpx

        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            listing = ok(client.get("/runs"))
            [run] = listing["runs"]
            assert listing["next_after"] is None
            for served, hosted in zip(run["processes"], seen["final_run"]["processes"], strict=True):
                assert served == hosted, json.dumps([processes_of(run), processes_of(seen["final_run"])])
            assert {k: v for k, v in run.items() if k != "cursor"} == seen["final_run"]
            one = ok(client.get(f"/runs/{START_ID}"))
            assert one == seen["final_run"]
            assert (one["status"], one["output"]) == ("completed", EXPECTED_OUTPUT)
            assert processes_of(one) == EXPECTED_PROCESSES
            assert ok(client.get(f"/runs/{seen['tree_id']}")) == one
            assert ok(client.get("/runs", params={"status": "completed"}))["runs"][0]["tree_id"] == seen["tree_id"]
            assert ok(client.get("/runs", params={"classification": "parked"}))["runs"] == []
            assert ok(client.get("/unknown-effects"))["unknown_effects"] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()


# ---------------------------------------------------------------------------
# The Kafka feed and the transcripts (surface 5)


def test_publish_then_the_transcripts_consumer_hold_each_interactions_final_output(
    durable_store_url: str, tmp_path: Path, kafka_bootstrap: str,
) -> None:
    from agentfold.adapters.transcripts import TranscriptStore

    url = durable_store_url
    seen = run_team(url)
    version = seen["final_run"]["version"]
    topic = f"team-surfaces-{uuid.uuid4().hex[:8]}"
    published = cli_json("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", store=url)
    assert (published["topic"], published["events"], published["position"], published["failures"]) == (
        topic, version, version, 0), published

    db = f"sqlite:///{tmp_path / 'transcripts.db'}"
    consumed = cli_json("transcripts", "--bootstrap", kafka_bootstrap, "--topic", topic, "--group", f"g-{topic}",
                        "--db", db, "--once")
    assert (consumed["envelopes"], consumed["applied"], consumed["duplicates"], consumed["rejected"]) == (
        version, version, 0, 0), consumed

    interactions = {p["process_id"]: p for p in seen["final_run"]["processes"] if p["interaction"]}
    tables = TranscriptStore(db)
    try:
        transcripts = tables.transcripts(seen["tree_id"])
    finally:
        tables.close()
    assert set(transcripts) == set(interactions)
    for pid, transcript in transcripts.items():
        assert transcript["status"] == "completed", transcript
        assert transcript["parent_process_id"] == interactions[pid]["parent_id"]
        [entry] = [e for e in transcript["entries"] if e["kind"] == "final_output"]
        assert transcript["entries"][-1] == entry
        assert text_of(entry["output"]["model_response"]["message"]) == entry["text"]
    researcher = next(pid for pid, p in interactions.items() if p["program"] == "team.researcher")
    research = transcripts[researcher]
    kinds = [e["kind"] for e in research["entries"]]
    assert kinds == ["input_message", "assistant_message", "tool_result", "assistant_message", "final_output"], kinds
    assert research["entries"][-1]["text"] == FINDING
    [tool] = [e for e in research["entries"] if e["kind"] == "tool_result"]
    assert (tool["tool_name"], tool["disposition"]) == ("policy_docs", "succeeded")
    # The coordinator's three turns: each Interaction's final text is the Decision it returned;
    # the last one is the completing Decision, whose output is the team's.
    coordinator_texts = [transcripts[pid]["entries"][-1]["text"] for pid, p in interactions.items()
                         if p["program"] == "team.coordinator.model"]
    decisions = [json.loads(text) for text in coordinator_texts]
    assert [d["mode"] for d in decisions] == ["wait", "wait", ""]
    assert decisions[-1]["output"] == EXPECTED_OUTPUT
    # ``transcript PROCESS_ID`` prints the researcher's.
    status, text = run_cli("transcript", researcher, "--db", db)
    assert status == 0 and FINDING in text and "policy_docs" in text, text


# ---------------------------------------------------------------------------
# A team that fails: every surface still shows it


def missing_worker(turn: dict[str, Any]) -> dict[str, Any]:
    """A coordinator's Decision that names a worker the team does not have."""
    return {"mode": "wait", "state": turn["state"], "tasks": [{"key": "t", "worker": "team.missing", "input": "x"}]}


class MissingWorkerModel:
    def call(self, request: ModelRequest) -> dict[str, Any]:
        turn = json.loads(text_of(request.messages[-1]))
        return ScriptedModel([final(json.dumps(missing_worker(turn)))]).call(request)


def failing_team(kind: str) -> Program:
    """``budget``: the adapter is built without a budget (its Interaction child asks for an unlimited
    one under the member's finite budget: the coordinator fails); ``decision``: the model answers a
    Decision the team refuses (collaboration.decision.invalid)."""
    budget = Budget(steps=Quota(64), effects=Quota(64), signals=Quota(16))
    model: Any = TurnModel() if kind == "budget" else MissingWorkerModel()
    inner = Budget() if kind == "budget" else Budget(steps=Quota(32), effects=Quota(32), signals=Quota(8))
    interaction = compile_interaction(InteractionConfig(f"failing.{kind}.model", model, max_model_calls=2,
                                                        model_identity=Digest.of(f"failing.{kind}/1".encode())))
    coordinator = adapt(AdapterConfig(
        f"failing.{kind}.coordinator", interaction, build_input=render_turn, decode_output=parse_decision,
        input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA, budget=inner,
        configuration_digest=digest_of({"interaction": interaction.ref.digest, "budget": inner.to_json()}),
    ))
    summarizer = transform(TransformConfig("team.summarize", summarize, input_schema=TEXT, output_schema=TEXT,
                                           identity="tests.team_surfaces.summarize/1"))
    return compile_team(TeamConfig(f"failing.{kind}", coordinator=TeamMember(coordinator, budget),
                                   workers=[TeamMember(summarizer, budget)]))


@pytest.mark.parametrize(("kind", "code"), [("budget", "engine.child.budget_exhausted"),
                                            ("decision", "collaboration.decision.invalid")])
def test_a_failed_team_is_shown_failed_by_wait_idle_capture_and_a_snapshot(
    kind: str, code: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/team.md: a coordinator that fails fails the team with its own failure; a bad Decision
    fails it with collaboration.decision.invalid. The run's folded state must stay readable:
    ``wait_idle`` (as in the docs' example), ``capture`` and a snapshot taken at the end."""
    team = failing_team(kind)
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([team]), snapshot_every=1) as runtime:
            run = runtime.start(team, {"question": QUESTION}, start_id="failing-1")
            result = run.result(timeout=30)
            root = result.process_id
            assert result.status == "failed"
            assert result.termination["failure"]["code"] == code, result.termination
            problems = []
            for what, read in (("wait_idle", runtime.wait_idle), ("capture", runtime.capture)):
                try:
                    tree = read(run.tree_id)
                    assert tree.processes[root].status == "failed"
                except Exception as exc:  # noqa: BLE001 - collected: both reads are reported
                    problems.append(f"{what}: {type(exc).__name__}: {exc}")
            assert Host(runtime).run("failing-1")["failure"]["code"] == code
    finally:
        store.close()
    # A new process loads the tree from its snapshot, without falling back to the events.
    store = EventStore(url)
    try:
        with caplog.at_level("WARNING"), Runtime(store, Catalog([team])) as runtime:
            assert runtime.capture("failing-1").processes[root].status == "failed"
    finally:
        store.close()
    problems += [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert problems == []


if __name__ == "__main__":
    # Re-import by the package name: the ProgramRefs must be the ones the tests bind.
    from tests.test_team_surfaces import cli as _cli

    sys.exit(_cli())
