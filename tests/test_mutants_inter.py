"""Interaction and team behaviour the mutation audit of 2026-12-05 ("inter") found undefended.

Each test failed with a planted bug that the rest of the suite let through (the audit's
report lists them). Real runtimes on real SQLite files, real tools and child Programs; the
model is a ScriptedModel; team coordinators are transforms of the policies below. What is
asserted is what a host observes: the Host's answers (``delegates``, ``results``,
``pending``, ``unknown``, which the CLI and the HTTP API serve too), ``agentfold replay``,
the requests the model and the context processor received, the calls the tools received,
what the completion validator was given and the run's or the collaboration's outcome.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import Delegate, InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
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
from agentfold.adapters.tools import ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.budget import Budget
from agentfold.domain.interaction.interaction import CompletionCandidate, CompletionDecision
from agentfold.domain.interaction.refs import delegate_child_key
from agentfold.domain.program import Program
from tests.audit.support import cli
from tests.interaction.tools import WAIT, CallLog, ProbeTool, call, chat_input, final, tool_round, user
from tests.test_cli import agentfold, ok, sqlite_url
from tests.test_cli_interaction import LEFT_TO_HOST, approval, model_call, run_json, unknowns, user_message, write

TASK_SCHEMA = {"type": "object", "required": ["task"], "properties": {"task": {"type": "string"}},
               "additionalProperties": False}
APPROVAL_SCHEMA = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}},
                   "additionalProperties": False}


def interaction(name: str, model: ScriptedModel, tools: list[Any] = (), **options: Any) -> Program:  # type: ignore[assignment]
    return compile_interaction(InteractionConfig(name=name, model=model, tools=list(tools), **options))


def task_input(arguments: Any) -> Any:
    return {"messages": [user(f"task: {arguments['task']}")]}


def asking(log: CallLog) -> ProbeTool:
    """A tool that asks a human before it acts (an input wait), then reports the answer."""

    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.continuation is None:
            raise ToolInputRequired({"question": "approve?"}, APPROVAL_SCHEMA, None)
        return ToolOutput.text(f"approved={invocation.continuation.response['ok']}")

    return ProbeTool("ask", log, behave)


def runtime_on(tmp_path: Path, *programs: Program) -> tuple[EventStore, Runtime]:
    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    return store, Runtime(store, Catalog(programs))


def run_to_end(tmp_path: Path, program: Program, given: Any) -> Any:
    """Start ``program`` on ``given`` in a fresh runtime and store, and return its result."""
    store, runtime = runtime_on(tmp_path, program)
    try:
        return runtime.start(program, given).result(WAIT)
    finally:
        runtime.close()
        store.close()


def child_with_key(runtime: Runtime, tree_id: Any, key: str) -> str:
    [pid] = [p.process_id for p in runtime.capture(tree_id).processes.values() if p.child_key == key]
    return str(pid)


# ---------------------------------------------------------------------------
# Delegates


def test_a_delegate_started_beside_a_refused_delegate_start_is_attributed_to_its_own_call(tmp_path: Path) -> None:
    """One round asks for two Delegates in a row; the first one's start is refused (its grant
    does not fit the root's finite budget), the second starts and completes. ``delegates``
    names the one child that exists under the call that started it (``d1``, index 1), never
    under the refused call (``d0``), whose result the model sees as a rejected start."""
    too_big = Budget.of(steps=10_000, effects=10_000, signals=10_000)
    fits = Budget.of(steps=50, effects=50, signals=50)
    big = interaction("test.big", ScriptedModel([final("big did it")]))
    small = interaction("test.small", ScriptedModel([final("small did it")]))
    model = ScriptedModel([
        tool_round(call("d0", "big", {"task": "a"}), call("d1", "small", {"task": "b"})),
        final("done"),
    ])
    program = interaction(
        "test.delegating", model,
        delegates=[Delegate("big", "Too big to start.", big, TASK_SCHEMA, budget=too_big, build_input=task_input),
                   Delegate("small", "Fits.", small, TASK_SCHEMA, budget=fits, build_input=task_input)],
    )
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, chat_input("go"), budget=Budget.of(steps=500, effects=500, signals=500))
        assert run.result(WAIT).status == "completed"
        small_child = child_with_key(runtime, run.tree_id, delegate_child_key(1, "d1", "small"))
        listed = Host(runtime).delegates(str(run.root_process_id))
    finally:
        runtime.close()
        store.close()
    results = model.requests[1].messages[-1]["tool_results"]
    assert [(r["id"], bool(r.get("is_error"))) for r in results] == [("d0", True), ("d1", False)]
    assert [(d["tool_call_ref"], d["tool_call"]["id"], d["child_key"], d["child_process_id"])
            for d in listed["delegates"]] == [
        (f"{run.root_process_id}/1/1", "d1", delegate_child_key(1, "d1", "small"), small_child)]


# ---------------------------------------------------------------------------
# SettledResults


def test_settled_results_list_a_delegated_interactions_open_round_before_its_parents_round(tmp_path: Path) -> None:
    """docs/interaction.md: ``results`` gives each open round "child Interactions before
    parents". The parent's round [probe, delegate] has its probe result; the Delegate's own
    round [probe, ask] has its probe result and waits for a human. The child's round is
    listed first, then the parent's, each with its own definite entries."""
    log = CallLog()
    worker_model = ScriptedModel([tool_round(call("c0", "probe"), call("c1", "ask")), final("worker done")])
    worker = interaction("test.worker", worker_model, [ProbeTool("probe", log), asking(log)])
    model = ScriptedModel([tool_round(call("t0", "probe"), call("d1", "research", {"task": "a"})), final("done")])
    program = interaction(
        "test.parent", model, [ProbeTool("probe", log)],
        delegates=[Delegate("research", "Researches.", worker, TASK_SCHEMA, build_input=task_input)],
    )
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, chat_input("go"))
        runtime.wait_idle(run.tree_id, WAIT)
        host = Host(runtime)
        assert len(host.pending(str(run.tree_id))) == 1  # the worker's ask waits for its answer
        child = child_with_key(runtime, run.tree_id, delegate_child_key(1, "d1", "research"))
        rounds = host.results(str(run.tree_id))["rounds"]
    finally:
        runtime.close()
        store.close()
    assert [(r["process_id"], [e["call"]["id"] for e in r["entries"]], r["call_count"]) for r in rounds] == [
        (child, ["c0"], 2), (str(run.root_process_id), ["t0"], 2)]


# ---------------------------------------------------------------------------
# Teams


def _status_of(task: dict[str, Any]) -> str:
    return str(task["outcome"]["result"]["status"]) if "outcome" in task else "running"


def cancel_the_second(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 starts two waiting gates beside each other; turn 2 cancels only ``second``;
    turn 3 reports what each task had become when the coordinator was asked."""
    n = turn["number"]
    if n == 1:
        return {"mode": "continue", "state": "started", "tasks": [
            {"key": "first", "worker": "test.inter.gate", "input": "one"},
            {"key": "second", "worker": "test.inter.gate", "input": "two"},
        ]}
    if n == 2:
        return {"mode": "wait", "state": "cancelling", "controls": [
            {"task": "second", "cancel_reason": "second is no longer needed"}]}
    return {"mode": "", "state": "done",
            "output": " ".join(f"{t['request']['key']}:{_status_of(t)}" for t in turn["tasks"])}


def gate_team(name: str, coordinator_name: str, policy: Any, gate_name: str) -> Program:
    """A team of text whose coordinator is the transform ``policy`` and whose one worker is an
    InputGate of text named ``gate_name``."""
    gate = compile_input_gate(InputGateConfig(gate_name, answer_schema={"type": "string"},
                                              request_schema={"type": "string"}))
    coordinator = transform(TransformConfig(coordinator_name, policy, "Decide.",
                                            input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA))
    return compile_team(TeamConfig(name=name, coordinator=TeamMember(coordinator), workers=[TeamMember(gate)],
                                   state_schema={"type": "string"}, output_schema={"type": "string"}))


def test_a_coordinators_cancel_control_stops_the_task_it_names_and_no_other(tmp_path: Path) -> None:
    """docs/team.md: a Decision's control acts on the task it names. Two gate tasks wait;
    the coordinator cancels ``second``: ``second`` ends canceled (its gate is no longer
    pending) while ``first`` keeps waiting for its answer until the collaboration completes."""
    program = gate_team("test.inter.team", "test.inter.coordinator", cancel_the_second, "test.inter.gate")
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, "begin")
        result = run.result(WAIT)
        tree = runtime.capture(run.tree_id)
    finally:
        runtime.close()
        store.close()
    assert result.status == "completed" and result.output == "first:running second:canceled"
    statuses = {str(p.child_key): p.status for p in tree.processes.values() if p.child_key in ("first", "second")}
    # The collaboration's completion cancels the task still running; the control had cancelled the other.
    assert statuses == {"first": "canceled", "second": "canceled"}


def shout(text: Any) -> Any:
    return f"{text}!"


def one_after_another(turn: dict[str, Any]) -> dict[str, Any]:
    """Three tasks, each started only once the previous one finished (at most one at a time)."""
    done = [t for t in turn["tasks"] if "outcome" in t]
    if len(done) < 3:
        key = f"step{len(done) + 1}"
        return {"mode": "wait", "state": turn["state"],
                "tasks": [{"key": key, "worker": "test.inter.shout", "input": key}]}
    return {"mode": "", "state": turn["state"],
            "output": " ".join(str(t["outcome"]["result"]["output"]) for t in done)}


def test_finished_tasks_do_not_count_against_the_concurrent_task_limit(tmp_path: Path) -> None:
    """``max_concurrent_tasks`` bounds the tasks *running* beside a Decision's new ones
    (spec 8.2 rule 3): with a limit of 1 a coordinator may start a task after each previous
    one finished, three times in a row, and the collaboration completes with their outputs."""
    worker = transform(TransformConfig("test.inter.shout", shout, "Shouts.", input_schema={"type": "string"},
                                       output_schema={"type": "string"}))
    coordinator = transform(TransformConfig("test.inter.sequencer", one_after_another, "Decide.",
                                            input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA))
    program = compile_team(TeamConfig(name="test.inter.sequence", coordinator=TeamMember(coordinator),
                                      workers=[TeamMember(worker)], max_concurrent_tasks=1))
    result = run_to_end(tmp_path, program, "begin")
    assert result.status == "completed", result.termination
    assert result.output == "step1! step2! step3!"


def do_task(arguments: Any) -> Any:
    return f"did {arguments['task']}"


def test_a_delegate_call_with_invalid_arguments_between_two_valid_ones_keeps_every_result_on_its_own_call(
    tmp_path: Path,
) -> None:
    """Three Delegate calls in one round, the middle one with arguments its input schema
    refuses: the model sees ``a`` done on d0, a rejected d1 (no child started for it) and
    ``c`` done on d2; each valid call started exactly one child, attributed to it."""
    worker = transform(TransformConfig("test.inter.doer", do_task, "Does a task.", input_schema=TASK_SCHEMA,
                                       output_schema={"type": "string"}))
    model = ScriptedModel([
        tool_round(call("d0", "doer", {"task": "a"}), call("d1", "doer", {"job": "b"}), call("d2", "doer", {"task": "c"})),
        final("done"),
    ])
    program = interaction("test.delegating", model,
                          delegates=[Delegate("doer", "Does a task.", worker, TASK_SCHEMA)])
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, chat_input("go"))
        assert run.result(WAIT).status == "completed"
        tree = runtime.capture(run.tree_id)
        listed = Host(runtime).delegates(str(run.root_process_id))
    finally:
        runtime.close()
        store.close()
    results = model.requests[1].messages[-1]["tool_results"]
    assert [(r["id"], r["output"].get("details"), bool(r.get("is_error"))) for r in results] == [
        ("d0", "did a", False), ("d1", None, True), ("d2", "did c", False)]
    assert "input contract" in results[1]["output"]["content"][0]["text"]
    children = {str(p.child_key): (p.input, p.output) for p in tree.processes.values() if p.parent_id is not None}
    assert children == {delegate_child_key(1, "d0", "doer"): ({"task": "a"}, "did a"),
                        delegate_child_key(1, "d2", "doer"): ({"task": "c"}, "did c")}
    assert [(d["tool_call_ref"], d["child_key"]) for d in listed["delegates"]] == [
        (f"{run.root_process_id}/1/0", delegate_child_key(1, "d0", "doer")),
        (f"{run.root_process_id}/1/2", delegate_child_key(1, "d2", "doer"))]


def test_a_round_that_mixes_a_direct_result_tool_with_an_ordinary_tool_goes_back_to_the_model(tmp_path: Path) -> None:
    """docs/interaction.md "Direct results": a round completes with its tool results only when
    *every* call's tool completes directly. A round [direct, ordinary] runs both tools once and
    then calls the model again, whose final answer is the run's output."""
    log = CallLog()
    model = ScriptedModel([tool_round(call("c0", "lookup"), call("c1", "note")), final("both seen")])
    program = interaction("test.mixed-direct", model,
                          [ProbeTool("lookup", log, direct_result=True), ProbeTool("note", log)])
    result = run_to_end(tmp_path, program, chat_input("go"))
    assert result.status == "completed"
    assert "direct_tool_results" not in result.output
    assert result.output["model_calls"] == 2
    assert result.output["model_response"]["message"]["content"][0]["text"] == "both seen"
    assert len(model.requests) == 2 and log.started() == ["c0", "c1"]


def test_tool_calls_cut_by_the_token_limit_are_rejected_to_the_model_and_never_run(tmp_path: Path) -> None:
    """A response that asks for tools but ended with ``length`` (its calls may be truncated):
    no tool runs, each call gets a rejected result telling the model to emit it again, and
    the run goes on with the next model call (it does not fail)."""
    log = CallLog()
    model = ScriptedModel([
        tool_round(call("c0", "lookup", {"q": "a"}), call("c1", "lookup", {"q": "b"}), reason="length"),
        final("gave up on the tools"),
    ])
    program = interaction("test.truncated", model, [ProbeTool("lookup", log)])
    result = run_to_end(tmp_path, program, chat_input("go"))
    assert result.status == "completed", result.termination
    assert result.output["model_calls"] == 2 and log.count() == 0
    results = model.requests[1].messages[-1]["tool_results"]
    assert [(r["id"], r.get("is_error")) for r in results] == [("c0", True), ("c1", True)]
    assert all("reached its token limit" in r["output"]["content"][0]["text"] for r in results)


# ---------------------------------------------------------------------------
# Tool attempts


def test_each_resumed_tool_attempt_carries_the_next_attempt_number(tmp_path: Path) -> None:
    """docs/interaction.md: a Tool child declares one Effect per attempt, numbered
    ``{"tool_call": {"attempt": n, ...}}``. A tool that asks twice and then loses its reply:
    its third attempt (the second resume) is the unknown Effect a host investigates, and its
    request says attempt 3 with the latest answer, not a repeated number."""
    log = CallLog()

    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        asked = invocation.continuation.state if invocation.continuation is not None else None
        if asked is None:
            raise ToolInputRequired({"question": "first?"}, APPROVAL_SCHEMA, "first")
        if asked == "first":
            raise ToolInputRequired({"question": "second?"}, APPROVAL_SCHEMA, "second")
        raise ConnectionResetError("the reply was lost")

    model = ScriptedModel([tool_round(call("c0", "ask")), final("done")])
    program = interaction("test.asks-twice", model, [ProbeTool("ask", log, behave)])
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, chat_input("go"))
        host = Host(runtime)
        for answer in (True, False):
            runtime.wait_idle(run.tree_id, WAIT)
            [wait] = host.pending(str(run.tree_id))
            assert host.answer(wait["process_id"], wait["wait_id"], {"ok": answer})
        runtime.wait_idle(run.tree_id, WAIT)
        [unknown] = host.unknown(str(run.tree_id))
    finally:
        runtime.close()
        store.close()
    assert log.count() == 3
    request = unknown["request"]["tool_call"]
    assert request["attempt"] == 3
    assert request["resume"]["input_response"] == {"ok": False}


# ---------------------------------------------------------------------------
# Steering


class KeepEverything:
    """A context processor that keeps the working context as it is (and records what it saw)."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def prepare_context(self, request: Any) -> list[dict[str, Any]]:
        self.seen.append(request)
        return list(request.messages)


def test_a_steer_applied_before_context_preparation_is_reported_on_the_model_call_it_reached(tmp_path: Path) -> None:
    """docs/interaction.md: a model call records the steering signals it applied
    (``applied_steer_signal_ids``). With a context processor bound, the steer sent during
    a tool round is in the messages the processor prepares and the model receives, and the
    model call that follows names it, as it does without a processor."""
    log = CallLog()
    tool = ProbeTool("fetch", log)
    gate = tool.hold("c0")
    model = ScriptedModel([tool_round(call("c0", "fetch")), final("steered")])
    processor = KeepEverything()
    program = interaction("test.prepared-steer", model, [tool], context_processor=processor)
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, chat_input("fetch"))
        assert gate.entered.wait(WAIT)
        assert Host(runtime).steer(str(run.root_process_id), "also check the archive", signal_id="signal:steer-1")
        gate.release.set()
        result = run.result(WAIT)
    finally:
        runtime.close()
        store.close()
    assert result.status == "completed" and result.output["model_calls"] == 2
    second = model.requests[1]
    assert second.messages[-1]["role"] == "user" and "also check the archive" in repr(second.messages[-1])
    assert processor.seen[1].messages == second.messages
    assert list(second.applied_steer_signal_ids) == ["signal:steer-1"]
    assert list(model.requests[0].applied_steer_signal_ids) == []


def test_replay_of_a_completed_round_shows_the_queued_steer_in_the_next_model_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``agentfold replay --at`` (docs/audit.md): at the position where a tool round is
    complete, ``next_model_request`` holds the messages the next model call will send:
    the context, the round's assistant message, its tool message, then the steering that
    queued during the round, exactly as the model call recorded next sends them."""
    store = sqlite_url(tmp_path)
    started = run_json(store, write(tmp_path, approval(None, final=LEFT_TO_HOST)), "--start-id", "steer-replay")
    root, tree_id = started["root_process_id"], started["tree_id"]
    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]
    ok(agentfold("steer", root, "Also book a window seat.", "--signal-id", "steer-1", store=store))
    ok(agentfold("answer", wait["process_id"], wait["wait_id"], '{"approved": true}', store=store))
    [entry] = unknowns(store)
    sent = model_call(entry)["request"]["messages"]
    assert sent[-1] == user_message("Also book a window seat.")
    last = ok(agentfold("show", tree_id, "--json", store=store)).json()["version"]
    complete = []
    for position in range(1, last + 1):
        ran = cli(capsys, "replay", tree_id, "--at", str(position), "--json", "--store", store)
        assert ran.code == 0, ran.stderr
        context = ran.json()["working_context"][root]
        if context["phase"] == "round_complete":
            complete.append(context)
    assert complete, "no position shows the round complete"
    for context in complete:
        assert [p["signal_id"] for p in context["pending_steer"]] == ["steer-1"]
        assert context["next_model_request"]["messages"] == sent


GATE_WAITS: dict[str, str] = {}
"""The wait id of the gate task, handed by the test to the coordinator of the next test."""


def answer_through_a_control(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 starts a gate task; turn 2 answers the gate's wait with a signal control
    addressed to that wait (it waits until the test tells it the wait id); turn 3 completes
    with what the gate received."""
    n = turn["number"]
    if n == 1:
        return {"mode": "continue", "state": "asking",
                "tasks": [{"key": "input", "worker": "test.inter.answerable", "input": "question"}]}
    if n == 2:
        deadline = time.monotonic() + WAIT
        while "input" not in GATE_WAITS and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"mode": "wait", "state": "answering", "controls": [{"task": "input", "signal": {
            "id": "signal:from-the-coordinator", "payload": "answered by the coordinator",
            "wait_id": GATE_WAITS.get("input")}}]}
    [task] = turn["tasks"]
    return {"mode": "", "state": "done", "output": task["outcome"]["result"]["output"]["payload"]}


def test_a_coordinators_signal_control_addressed_to_a_workers_wait_answers_that_wait(tmp_path: Path) -> None:
    """docs/team.md: a control ``{"task", "signal": {"id", "payload", "wait_id"}}`` is a
    signal to the task's Process under its own input contract, addressed to ``wait_id`` when
    given. A coordinator answers an InputGate task's wait that way: the gate completes with
    the coordinator's answer and the collaboration completes with it."""
    GATE_WAITS.clear()
    program = gate_team("test.inter.answering", "test.inter.answerer", answer_through_a_control, "test.inter.answerable")
    store, runtime = runtime_on(tmp_path, program)
    try:
        run = runtime.start(program, "begin")
        host = Host(runtime)
        deadline = time.monotonic() + WAIT
        while not (gates := host.gates(str(run.tree_id))) and time.monotonic() < deadline:
            time.sleep(0.01)
        [waiting] = gates
        assert waiting["task"] == "input"
        GATE_WAITS["input"] = waiting["wait_id"]
        result = run.result(WAIT)
    finally:
        GATE_WAITS.clear()
        runtime.close()
        store.close()
    assert result.status == "completed", result.termination
    assert result.output == "answered by the coordinator"


def do_or_fail(arguments: Any) -> Any:
    if arguments["task"] == "impossible":
        raise ValueError("this task cannot be done")
    return f"did {arguments['task']}"


def test_the_completion_validator_is_given_only_the_artifacts_of_delegates_that_succeeded(tmp_path: Path) -> None:
    """docs/interaction.md: the completion validator judges a candidate with "every successful
    Delegate Artifact so far". A round whose first Delegate call fails and whose second
    succeeds gives the validator one Artifact, the second call's, with its output."""
    worker = transform(TransformConfig("test.inter.maybe", do_or_fail, "Does a task, or fails.",
                                       input_schema=TASK_SCHEMA, output_schema={"type": "string"}))
    seen: list[Any] = []

    def validator(candidate: CompletionCandidate) -> CompletionDecision:
        seen.append(candidate.artifacts)
        return CompletionDecision(True)

    model = ScriptedModel([
        tool_round(call("d0", "maybe", {"task": "impossible"}), call("d1", "maybe", {"task": "easy"})),
        final("one of two"),
    ])
    program = interaction("test.validated", model, delegates=[Delegate("maybe", "Maybe does it.", worker, TASK_SCHEMA)],
                          completion_validator=validator)
    result = run_to_end(tmp_path, program, chat_input("go"))
    assert result.status == "completed", result.termination
    results = model.requests[1].messages[-1]["tool_results"]
    assert [(r["id"], bool(r.get("is_error"))) for r in results] == [("d0", True), ("d1", False)]
    assert seen == [({"model_call_sequence": 1, "tool_call_id": "d1", "delegate_name": "maybe", "output": "did easy"},)]
