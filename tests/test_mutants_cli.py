"""The ``agentfold`` commands as docs/cli.md describes them: behaviour the mutation audit of the CLI
(2026-12-05, "cli") found undefended. Each test failed with its planted bug (named in its
docstring) and passes without it.

Most run the CLI's own entry point, ``main(argv, sources=...)``, in this process (exit status,
stdout, stderr as the console script prints them) on a real SQLite file, beside real runtimes;
the ones whose promise is about a call that hangs past ``--timeout`` run the command as a real
process (tests/forked_cli.py), whose exit abandons the hung call with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.cli import main
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import Delegate, InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources, default_sources
from agentfold.adapters.team import TransformConfig, transform
from agentfold.domain.ids import TreeID
from agentfold.domain.interaction.refs import delegate_child_key
from agentfold.domain.requests import EffectRequest, Settlement
from tests.interaction.tools import WAIT, CallLog, ProbeTool, call, chat_input, final, tool_round
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold, sqlite_url, store_version
from tests.test_cli_interaction import settled_results_digest


def _first_call_unknown(request: EffectRequest, context: DispatchContext) -> Settlement:
    # The first call's outcome was not observed (a connection reset): the host must find it out.
    index = (request.payload or {}).get("index")
    return Settlement.unknown() if index == 0 else Settlement.succeeded({"value": 1})


CHAIN = chain_program(_first_call_unknown, name="test.cli-audit.chain")
SOURCES = default_sources().plus(ProgramSources(programs=(CHAIN,)))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``agentfold ARGV`` through the console script's ``main`` with this file's Programs bound."""
    capsys.readouterr()
    code = main(list(argv), sources=SOURCES)
    out, err = capsys.readouterr()
    return code, out, err


def parked_with_an_unknown(url: str, start_id: str, n: int = 1) -> tuple[TreeID, str]:
    """A chain run whose first call's outcome is unknown, parked, its owner gone: (tree, effect id)."""
    store = EventStore(url, create=True)
    try:
        with Runtime(store, Catalog([CHAIN]), poll_interval=0) as runtime:
            handle = runtime.start(CHAIN, {"n": n}, start_id=start_id)
            tree = runtime.wait_idle(handle.tree_id, timeout=30)
            [effect_id] = [r.effect_id for p in tree.processes.values() for r in p.unknown_effects()]
            return handle.tree_id, str(effect_id)
    finally:
        store.close()


def test_a_disposition_given_for_an_effect_that_is_not_a_tool_call_is_refused_and_appends_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md: ``--disposition`` belongs to tool calls; any other Effect is resolved with
    ``--status``. Mutant (resolution.py): the refusal removed: ``--disposition failed`` on the
    kernel-style call was ignored and the call recorded as *succeeded* (exit 0), the run went on
    as if the outside world had said yes."""
    url = sqlite_url(tmp_path)
    tree_id, effect_id = parked_with_an_unknown(url, "disposition-1")
    before = store_version(url, tree_id)

    code, out, err = cli(capsys, "resolve", effect_id, "--output", '{"declined": true}', "--disposition", "failed",
                         "--json", "--store", url)
    assert (code, out) == (2, ""), err
    error = json.loads(err)["error"]
    assert error["code"] == "cli.usage" and "--disposition applies to tool calls only" in error["message"], error
    assert store_version(url, tree_id) == before
    code, out, _ = cli(capsys, "unknown", "--json", "--store", url)
    assert [e["effect_id"] for e in json.loads(out)["unknown_effects"]] == [effect_id]


def test_resolving_a_run_another_live_runtime_owns_says_that_runtime_drives_it_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md, resolve ``--json``: ``driven`` is false when another live runtime owns the
    tree (and drives it on). Mutant (cli.py cmd_resolve): ``driven`` always true: an operator
    (or a script) was told this command drove a run that a server it did not see drives."""
    url = sqlite_url(tmp_path)
    store = EventStore(url, create=True)
    owner = Runtime(store, Catalog([CHAIN]), poll_interval=0.05)
    try:
        handle = owner.start(CHAIN, {"n": 2}, start_id="owned-1")
        tree = owner.wait_idle(handle.tree_id, timeout=30)
        [effect_id] = [str(r.effect_id) for p in tree.processes.values() for r in p.unknown_effects()]
        assert owner.owns(handle.tree_id)  # the owner keeps the parked run (as `serve` does)

        code, out, err = cli(capsys, "resolve", effect_id, "--output", '{"value": 5}', "--json", "--timeout", "30",
                             "--store", url)
        assert code == 0, err
        resolved = json.loads(out)
        assert (resolved["effect_id"], resolved["driven"]) == (effect_id, False), resolved
        # The owner, not the command, makes the second call and completes the run.
        assert handle.result(30).output == {"total": 6, "effects": 2}
    finally:
        owner.close()
        store.close()


def test_recover_reports_every_live_tree_in_index_order_each_with_its_unknown_effects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md, recover ``--json``: ``{"trees": [ENTRY, ...]}`` in index order, each ENTRY a
    TREE SUMMARY (``unknown_effect_ids`` included) plus ``outcome``; a parked tree's summary is its
    index row. Mutants (cli.py cmd_recover): the entries left in the order they were decided (or
    reversed), and a parked tree's ``unknown_effect_ids`` dropped (a host reading the listing
    saw nothing waiting for it)."""
    url = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    # First in the index: a kernel demo run whose charge was cut by a real process death.
    crashed = agentfold("kernel-demo-run", "--start-id", "order-1", "--side-effect-log", str(log),
                        "--crash-after", "in-dispatch:1", "--store", url)
    assert crashed.code == 75, crashed.stderr
    # Second: a run parked on an unknown outcome, nobody owning it (nothing to adopt).
    _, parked_effect = parked_with_an_unknown(url, "parked-1")

    code, out, err = cli(capsys, "recover", "--json", "--timeout", "30", "--store", url)
    assert code == 0, err
    entries = json.loads(out)["trees"]
    assert [(e["start_id"], e["outcome"]) for e in entries] == [("order-1", "recovered"), ("parked-1", "parked")]
    recovered, parked = entries
    assert len(recovered["unknown_effect_ids"]) == 1  # the charge, settled unknown, calling nothing
    assert parked["unknown_effect_ids"] == [parked_effect]
    assert (parked["status"], parked["classification"]) == ("running", "parked")


@pytest.fixture()
def hanging_log(tmp_path: Path) -> Path:
    """The kernel demo's side-effect log as a FIFO nobody reads: its charge blocks in open()."""
    fifo = tmp_path / "side-effects.fifo"
    os.mkfifo(fifo)
    return fifo


def _error(stderr: str) -> dict[str, Any]:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return json.loads(lines[0])["error"]  # type: ignore[no-any-return]


def test_a_run_still_working_after_its_timeout_exits_1_with_cli_timeout(tmp_path: Path, hanging_log: Path) -> None:
    """docs/cli.md exit status 1: "a tree was still busy after --timeout". Mutant (cli.py main):
    a TimeoutError reported on stderr but the exit status 0, so a script took the run for parked."""
    url = sqlite_url(tmp_path)
    ran = agentfold("kernel-demo-run", "--start-id", "slow-1", "--side-effect-log", str(hanging_log),
                    "--timeout", "0", "--json", "--store", url)
    assert (ran.code, ran.stdout) == (1, ""), ran.stderr
    error = _error(ran.stderr)
    assert error["code"] == "cli.timeout" and "still working after 0 s" in error["message"], error


def test_recover_exits_1_when_a_tree_it_took_is_still_working_after_its_timeout(
    tmp_path: Path, hanging_log: Path
) -> None:
    """docs/cli.md, recover: "Exit 1 if any tree could not be recovered"; its entry is
    ``"outcome": "error"``. Mutant (cli.py cmd_recover): a tree still working after the drain
    reported as an error entry but the command exited 0."""
    url = sqlite_url(tmp_path)
    # Declared, not dispatched: the next owner makes the call (it is not unknown), and it hangs.
    crashed = agentfold("kernel-demo-run", "--start-id", "slow-2", "--side-effect-log", str(hanging_log),
                        "--crash-after", "declared:1", "--store", url)
    assert crashed.code == 75, crashed.stderr

    ran = agentfold("recover", "--timeout", "0", "--json", "--store", url)
    assert ran.code == 1, (ran.stdout, ran.stderr)
    [entry] = json.loads(ran.stdout)["trees"]
    assert (entry["start_id"], entry["outcome"], entry["error"]["code"]) == ("slow-2", "error", "cli.timeout"), entry


def test_a_model_response_given_with_an_output_a_status_or_a_disposition_is_refused_and_appends_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md, resolve a model call: ``--output``, ``--disposition`` and ``--status`` are
    refused with ``--model-response`` (``cli.usage``). Mutant (resolution.py): the refusal removed:
    ``--status failed`` (or an ``--output``) was silently dropped and the model call recorded as a
    succeeded response, completing the run the operator meant to fail."""
    url = sqlite_url(tmp_path)
    scenario = tmp_path / "left-to-host.json"
    scenario.write_text(json.dumps({
        "name": "left-to-host",
        "input": {"messages": [{"role": "user", "content": "Say hello."}]},
        "model": {"responses": [{"error": "this model call is left to the host"}]},
    }))
    code, out, err = cli(capsys, "run", str(scenario), "--json", "--store", url)
    assert code == 0, err
    tree_id = TreeID(json.loads(out)["tree_id"])
    code, out, err = cli(capsys, "unknown", "--json", "--store", url)
    [unknown] = json.loads(out)["unknown_effects"]
    assert unknown["kind"] == "model", unknown
    before = store_version(url, tree_id)

    response = '{"finish_reason": "stop", "message": {"content": "Hello!"}}'
    for extra in (["--status", "failed"], ["--output", '"Hello!"'], ["--disposition", "failed"]):
        code, out, err = cli(capsys, "resolve", unknown["effect_id"], "--model-response", response, *extra,
                             "--json", "--store", url)
        assert (code, out) == (2, ""), (extra, err)
        error = _error(err)
        assert error["code"] == "cli.usage" and "--model-response takes no" in error["message"], (extra, error)
    assert store_version(url, tree_id) == before
    code, out, _ = cli(capsys, "unknown", "--json", "--store", url)
    assert [e["effect_id"] for e in json.loads(out)["unknown_effects"]] == [unknown["effect_id"]]


def _refuse(arguments: Any) -> Any:
    raise RuntimeError("the archive is closed")


def test_a_failed_delegate_is_a_failed_settled_result_the_same_error_the_model_then_receives(tmp_path: Path) -> None:
    """docs/concepts.md, settled results: the definite results of an open round, as the model will
    see them. A round starts two Delegates (one batch: the round takes their outcomes when both
    have ended): ``archive``'s worker fails at once, ``research``'s asks a human and waits. The
    failed one is listed ``failed`` with ``is_error``: exactly the result the model receives once
    the round completes. The worker's own open round comes first, naming its parent and child key.
    Mutants (settled_results.py): a failed worker listed as ``succeeded`` (``_delegate_result``; a
    host resuming from SettledResults would have told the model it worked); a child round's
    ``child_key`` left out of its JSON and digest (``RoundResults.json_value``)."""
    from tests.test_mutants_inter import TASK_SCHEMA, asking, task_input

    log = CallLog()
    failing = transform(TransformConfig("test.cli-audit.archivist", _refuse, "Fails.", input_schema=TASK_SCHEMA))
    asking_worker = compile_interaction(InteractionConfig(
        name="test.cli-audit.researcher",
        model=ScriptedModel([tool_round(call("c0", "probe"), call("c1", "ask")), final("researched")]),
        tools=[ProbeTool("probe", log), asking(log)],
    ))
    model = ScriptedModel([
        tool_round(call("d0", "archive", {"task": "a"}), call("d1", "research", {"task": "b"})), final("done"),
    ])
    program = compile_interaction(InteractionConfig(
        name="test.cli-audit.delegating", model=model,
        delegates=[Delegate("archive", "Archives.", failing, TASK_SCHEMA),
                   Delegate("research", "Researches.", asking_worker, TASK_SCHEMA, build_input=task_input)],
    ))
    store = EventStore(sqlite_url(tmp_path), create=True)
    runtime = Runtime(store, Catalog([program]), poll_interval=0)
    try:
        run = runtime.start(program, chat_input("go"))
        runtime.wait_idle(run.tree_id, WAIT)
        host = Host(runtime)
        [wait] = host.pending(str(run.tree_id))  # the research worker's human
        research, round_ = host.results(str(run.tree_id))["rounds"]  # child Interactions before parents
        assert round_["process_id"] == str(run.root_process_id), round_
        # The worker's own open round: its probe result, under its own identity in the tree.
        assert (research["parent_id"], research["child_key"]) == (
            str(run.root_process_id), delegate_child_key(1, "d1", "research")), research
        assert [e["call"]["id"] for e in research["entries"]] == ["c0"], research
        assert research["digest"] == settled_results_digest(research)
        assert (round_["call_count"], round_["complete"]) == (2, False), round_
        [entry] = round_["entries"]  # research has not ended: only archive's outcome is definite
        assert (entry["tool_call_index"], entry["call"]["id"], entry["disposition"]) == (0, "d0", "failed"), entry
        assert entry["result"]["is_error"] is True, entry
        assert "RuntimeError: the archive is closed" in json.dumps(entry["result"]["output"]), entry

        assert host.answer(wait["process_id"], wait["wait_id"], {"ok": True}) is True
        assert run.result(WAIT).status == "completed"
    finally:
        runtime.close()
        store.close()
    delegated = model.requests[1].messages[-1]["tool_results"][0]
    assert delegated["id"] == "d0" and delegated["is_error"] is True, delegated
    assert delegated["output"] == entry["result"]["output"], (delegated, entry)




def test_a_refused_delegate_start_is_a_rejected_settled_result_at_every_position_of_its_history(
    tmp_path: Path,
) -> None:
    """docs/interaction.md (Delegates): a Delegate whose start the engine refuses (its grant does
    not fit the run's budget) gets a model-visible ``rejected`` result. Between the refusal and
    the parent's next Step (a run whose owner died there, read by ``results``), SettledResults
    takes it from the refused start itself; from that Step on, from the round's record. At every
    position of the history it is the same entry: ``rejected``, ``is_error``, the refusal's code,
    exactly what the model then receives. Mutant (C11 of the cli audit, settled_results.py
    ``_round_entries``): the refusal listed as ``failed`` in that window; no test looked there."""
    from agentfold.adapters.audit import replay
    from agentfold.domain.budget import Budget
    from agentfold.projections.settled_results import settled_results
    from tests.test_mutants_inter import TASK_SCHEMA

    too_big = Budget.of(steps=10_000, effects=10_000, signals=10_000)
    refused = transform(TransformConfig("test.cli-audit.refused", _refuse, "Never starts.", input_schema=TASK_SCHEMA))
    model = ScriptedModel([tool_round(call("d0", "archive", {"task": "a"})), final("done")])
    program = compile_interaction(InteractionConfig(
        name="test.cli-audit.refusing", model=model,
        delegates=[Delegate("archive", "Archives.", refused, TASK_SCHEMA, budget=too_big)],
    ))
    store = EventStore(sqlite_url(tmp_path), create=True)
    runtime = Runtime(store, Catalog([program]), poll_interval=0)
    try:
        run = runtime.start(program, chat_input("go"), budget=Budget.of(steps=500, effects=500, signals=500))
        assert run.result(WAIT).status == "completed"
        end = store.head(run.tree_id).version
        seen: dict[int, dict[str, Any]] = {}
        for position in range(1, end + 1):
            tree = replay(store, run.tree_id, position, ProgramSources(programs=(program,))).tree
            for round_ in settled_results(tree):
                for entry in round_.entries:
                    seen[position] = entry.json_value()
    finally:
        runtime.close()
        store.close()
    assert [p.program.name for p in tree.processes.values()] == ["test.cli-audit.refusing"]  # never started
    delegated = model.requests[1].messages[-1]["tool_results"][0]
    assert delegated["id"] == "d0" and delegated["is_error"] is True, delegated
    assert "delegated worker child start failed: engine.child.budget_exhausted" in json.dumps(delegated), delegated
    # The round is open from the refusal until the model's second call: several positions.
    assert len(seen) >= 2, seen
    for position, entry in seen.items():
        assert (entry["tool_call_index"], entry["call"]["id"], entry["disposition"]) == (0, "d0", "rejected"), (
            position, entry)
        assert entry["result"]["is_error"] is True and entry["result"]["output"] == delegated["output"], (position, entry)
