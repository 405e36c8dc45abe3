"""Programs shared by the team (collaboration) tests, built identically in the test process and
in crash subprocesses (``python -m tests.team.worker``).

Coordinators are ``transform`` Programs over the module-level policy functions below
(``policy(turn) -> decision``): a transform's configuration digest names its function, so a
subprocess that imports this module binds the very same ProgramRef. Every policy and worker
function appends one JSON line per real call to the file named by the ``AGENTFOLD_TEAM_LOG``
environment variable (``{"kind": ..., "value": ...}``): the Turn inputs the coordinator saw and
the worker calls are counted outside the process, also across a process death.

A policy holds a call open with :func:`hold` (it writes ``entered`` and waits until a
``<log>.release`` file exists), so a test can act while a coordinator turn is running.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

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
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.canonical import JSON
from agentfold.domain.program import Program

LOG_ENV = "AGENTFOLD_TEAM_LOG"
HOLD_SECONDS = 30.0
TEXT: JSON = {"type": "string"}


# ---------------------------------------------------------------------------
# The call log


def log_path() -> Path:
    return Path(os.environ[LOG_ENV])


def log(kind: str, value: JSON) -> None:
    with log_path().open("a") as out:
        out.write(json.dumps({"kind": kind, "value": value}, sort_keys=True) + "\n")
        out.flush()


def entries(kind: str, path: Path | None = None) -> list[Any]:
    """The values logged under ``kind``, in call order."""
    path = path or log_path()
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line["value"] for line in lines if line["kind"] == kind]


def turns(path: Path | None = None) -> list[dict[str, Any]]:
    """The Turn inputs the coordinators received, in call order."""
    return entries("turn", path)


def release_file(path: Path | None = None) -> Path:
    path = path or log_path()
    return path.with_name(path.name + ".release")


def hold(what: str) -> None:
    """Log ``entered`` and wait until the test creates the release file (bounded: never hangs)."""
    log("entered", what)
    deadline = time.monotonic() + HOLD_SECONDS
    while not release_file().exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} was never released")
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# Decisions


def finish(turn: dict[str, Any], output: JSON) -> dict[str, Any]:
    return {"mode": "", "state": turn["state"], "output": output}


def task(key: str, worker: str, input: JSON) -> dict[str, Any]:
    return {"key": key, "worker": worker, "input": input}


def output_of(task: dict[str, Any]) -> Any:
    return task["outcome"]["result"]["output"]


# ---------------------------------------------------------------------------
# Workers


def echo_fn(text: JSON) -> JSON:
    log("echo", text)
    return f"echo: {text}"


def crashing_fn(text: JSON) -> JSON:
    """A worker call that ends its process (real death) inside the call, after logging it."""
    log("crashing", text)
    if os.environ.get("AGENTFOLD_TEAM_CRASH") == "worker":
        os._exit(75)
    return f"done: {text}"


def echo() -> Program:
    return transform(TransformConfig("test.echo", echo_fn, "Echo a text.", input_schema=TEXT, output_schema=TEXT))


def crashing() -> Program:
    return transform(TransformConfig("test.crashing", crashing_fn, "Work, or die trying.",
                                     input_schema=TEXT, output_schema=TEXT))


def gate() -> Program:
    return compile_input_gate(InputGateConfig("test.gate", answer_schema=TEXT, description="Receive input.",
                                              request_schema=TEXT))


WORKER_BUDGET = Budget(steps=Quota(32), effects=Quota(16), signals=Quota(32))
COORDINATOR_BUDGET = Budget(steps=Quota(32), effects=Quota(16), signals=Quota(32))


def coordinator(policy: Any, name: str = "test.coordinator") -> Program:
    return transform(TransformConfig(name, policy, "Decide the next step.",
                                     input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA))


def team(policy: Any, *workers: Program, state_schema: JSON = TEXT, output_schema: JSON = TEXT,
         coordinator_member: TeamMember | None = None, **options: Any) -> Program:
    """The test collaboration (Scope's ``fixtureConfig``): string state and output by default."""
    return compile_team(TeamConfig(
        name="test.collaboration",
        description="Coordinate tasks.",
        coordinator=coordinator_member or TeamMember(coordinator(policy), COORDINATOR_BUDGET),
        workers=[TeamMember(w, WORKER_BUDGET) for w in workers],
        state_schema=state_schema,
        output_schema=output_schema,
        **options,
    ))


# ---------------------------------------------------------------------------
# Policies (one per scenario; each logs the Turn it received first)


def background_control(turn: dict[str, Any]) -> dict[str, Any]:
    """27: continue beside a running gate, then signal + cancel it, then finish."""
    log("turn", turn)
    n = turn["number"]
    if n == 1:
        return {"mode": "continue", "state": "working", "tasks": [task("background", "test.gate", "wait")]}
    if n == 2:
        return {"mode": "wait", "state": turn["state"], "controls": [
            {"task": "background", "signal": {"id": "signal:steer", "payload": "new direction"}},
            {"task": "background", "cancel_reason": "No longer needed."},
        ]}
    if n == 3:
        return finish(turn, "continued, controlled, drained")
    raise RuntimeError("unexpected turn")


def follow_up(turn: dict[str, Any]) -> dict[str, Any]:
    """28: a follow-up task with a new key carries the previous output."""
    log("turn", turn)
    n = turn["number"]
    if n == 1:
        return {"mode": "wait", "state": turn["state"], "tasks": [task("draft", "test.echo", "draft")]}
    if n == 2:
        previous = output_of(turn["tasks"][0])
        return {"mode": "wait", "state": turn["state"], "tasks": [task("revision", "test.echo", f"{previous} revised")]}
    if n == 3:
        return finish(turn, output_of(turn["tasks"][1]))
    raise RuntimeError("unexpected turn")


def addressed_input(turn: dict[str, Any]) -> dict[str, Any]:
    """29: wait for an InputGate worker; its answer wakes the coordinator."""
    log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "wait", "state": turn["state"], "tasks": [task("input", "test.gate", "instruction")]}
    if turn["number"] == 2:
        answer = output_of(turn["tasks"][0])
        return finish(turn, f"{answer['id']}:{json.dumps(answer['payload'])}")
    raise RuntimeError("unexpected turn")


def finish_at_once(turn: dict[str, Any]) -> dict[str, Any]:
    log("turn", turn)
    return finish(turn, "done")


def null_output(turn: dict[str, Any]) -> dict[str, Any]:
    """31: one task, then complete with an explicit JSON null."""
    log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "wait", "state": turn["state"], "tasks": [task("draft", "test.echo", "draft")]}
    return {"mode": "", "state": turn["state"], "output": None}


FAILURE_MESSAGE = "x" * 1000


def failing_second_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """32: start a background gate, then fail the turn."""
    log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "continue", "state": turn["state"], "tasks": [task("background", "test.gate", "wait")]}
    raise RuntimeError(FAILURE_MESSAGE)


def during_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """33: turn 2 is held open while the test answers the gate; turn 3 must see that outcome.
    The initial state names how many gates turn 1 starts ("1" or "2")."""
    log("turn", turn)
    n = turn["number"]
    if n == 1:
        tasks = [task("input", "test.gate", "answer")]
        if turn["state"] == "2":
            tasks.append(task("other", "test.gate", "waiting"))
        return {"mode": "continue", "state": turn["state"], "tasks": tasks}
    if n == 2:
        hold("turn 2")
        return {"mode": "wait", "state": turn["state"]}
    if n == 3:
        return finish(turn, "observed during decision")
    raise RuntimeError("unexpected turn")


def wait_for_crashing(turn: dict[str, Any]) -> dict[str, Any]:
    """Recovery: turn 1 waits for a worker (which may die inside its call); turn 2 finishes with its output."""
    log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "wait", "state": turn["state"], "tasks": [task("job", "test.crashing", "job")]}
    if turn["number"] == 2:
        return finish(turn, f"job said {output_of(turn['tasks'][0])}")
    raise RuntimeError("unexpected turn")


def keep_continuing(turn: dict[str, Any]) -> dict[str, Any]:
    """35: never completes."""
    log("turn", turn)
    return {"mode": "continue", "state": turn["state"]}


def unknown_worker(turn: dict[str, Any]) -> dict[str, Any]:
    """35: names a worker that does not exist."""
    log("turn", turn)
    return {"mode": "wait", "state": turn["state"], "tasks": [task("t", "test.missing", "x")]}


def scripted(turn: dict[str, Any]) -> dict[str, Any]:
    """The decision the working state scripts for this turn: ``{"script": [decision, ...]}``,
    entry n-1 for turn n (its ``state`` is the Turn's state unless the entry names one)."""
    log("turn", turn)
    decision = dict(turn["state"]["script"][turn["number"] - 1])
    decision.setdefault("state", turn["state"])
    return decision


WRITER_INPUT: JSON = {"messages": [{"role": "user", "content": [{"type": "text", "text": "initial"}]}]}


def steer_writer(turn: dict[str, Any]) -> dict[str, Any]:
    """34: start an Interaction worker, steer it while its model call runs, finish with its answer."""
    from agentfold.adapters.interaction import steer_signal

    log("turn", turn)
    n = turn["number"]
    if n == 1:
        return {"mode": "continue", "state": turn["state"], "tasks": [task("writer", "test.interaction", WRITER_INPUT)]}
    if n == 2:
        hold("turn 2")
        steer = steer_signal("signal:revise", {"role": "user", "content": [{"type": "text", "text": "revise"}]})
        return {"mode": "wait", "state": turn["state"],
                "controls": [{"task": "writer", "signal": {"id": str(steer.id), "payload": steer.payload}}]}
    if n == 3:
        response = output_of(turn["tasks"][0])["model_response"]["message"]
        return finish(turn, "".join(part.get("text", "") for part in response["content"]))
    raise RuntimeError("unexpected turn")


# ---------------------------------------------------------------------------
# Programs the crash worker builds by name


def build(name: str) -> Program:
    if name == "crash-worker":
        return team(wait_for_crashing, crashing())
    if name == "during-turn":
        return team(during_turn, gate())
    if name == "null-output":
        return team(null_output, echo(), output_schema={"type": "null"})
    raise ValueError(f"unknown program {name}")


# ---------------------------------------------------------------------------
# The crash worker: ``python -m tests.team.programs STORE_URL PROGRAM START_ID INPUT MODE``
#
# MODE ``run``: run to the end (a JSON summary on stdout, exit 0). ``crash:<point>``: the Runtime
# ends the process with os._exit(75) at that CrashPlan point. ``answer-during-turn-2``: once
# turn 2's policy call is held, answer the ``input`` gate, wait until the collaboration has
# consumed that outcome (it waits again with nothing pending), then die with os._exit(75) while
# turn 2's call is still in flight. Exit 4: any other error.


def wait_for(predicate: Any, what: str, timeout: float = HOLD_SECONDS) -> None:
    """Poll ``predicate`` until true; TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.runtime import CrashPlan, Runtime
    from agentfold.domain.program import SignalRequest

    url, name, start_id, input, mode = argv
    program = build(name)
    crash = CrashPlan.parse(mode.removeprefix("crash:")) if mode.startswith("crash:") else None
    store = EventStore(url)
    runtime = Runtime(store, Catalog([program]), crash=crash, poll_interval=0)
    try:
        handle = runtime.start(program, json.loads(input), start_id=start_id)
        if mode == "answer-during-turn-2":
            def gate() -> Any:
                return next((p for p in runtime.capture(handle.tree_id).processes.values()
                             if p.child_key == "input"), None)

            wait_for(lambda: entries("entered") == ["turn 2"], "turn 2 to be held")
            wait_for(lambda: gate() is not None and gate().current_wait is not None, "the gate to wait")
            answered = gate()
            runtime.deliver_signals(answered.process_id,
                                    [SignalRequest("signal:during-decision", "answer", answered.current_wait)])

            def consumed() -> bool:
                root = runtime.capture(handle.tree_id).root
                return bool(gate().terminal and root.pending_count == 0 and root.current_wait is not None)

            wait_for(consumed, "the collaboration to consume the gate's outcome")
            os._exit(75)
        result = handle.result(timeout=HOLD_SECONDS)
        print(json.dumps({"status": result.status, "output": result.output}))
        return 0
    finally:
        runtime.close()
        store.close()


if __name__ == "__main__":
    import sys
    import traceback

    from tests.team import programs as _self  # the functions under their importable names

    try:
        sys.exit(_self.main(sys.argv[1:]))
    except Exception:  # noqa: BLE001 - report to the test
        traceback.print_exc()
        sys.exit(4)
