"""agentfold.adapters.host.Host: the Python host's questions and actions, with the CLI's and the HTTP API's rules.

docs/python.md shows the happy path (tests/test_docs_python.py runs it); these prove the
promises around it on a real SQLite store: a refused action appends nothing (no event, no
owner change), a second answer under another signal id names the signal that answered, input for a run
another runtime owns is taken up by that owner, and a Host reads runs its runtime never
started when given their Programs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.adapters.tools import ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.errors import InvalidInput, NotFound, Rejected
from agentfold.domain.ids import ProcessID, TreeID
from agentfold.domain.program import Program

INPUT = {"messages": [{"role": "user", "content": "Book it."}]}


class Book:
    name = "book"
    description = "Books (its reply is lost)."
    parameters = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise ConnectionResetError("the connection dropped after the request was sent")


class Approve:
    name = "approve"
    description = "Asks a human."
    parameters = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.continuation is None:
            raise ToolInputRequired({"question": "ok?"}, {"type": "object", "required": ["ok"]}, None)
        return ToolOutput.text(f"answer: {invocation.continuation.response}")


def calls(name: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": None, "tool_calls": [{"id": name, "name": name, "arguments": "{}"}]},
            "finish_reason": "tool_calls"}


def agent() -> Program:
    model = ScriptedModel([calls("book"), calls("approve"), {"message": {"role": "assistant", "content": "done"},
                                                             "finish_reason": "stop"}])
    return compile_interaction(InteractionConfig(name="host.test", model=model, tools=[Book(), Approve()]))


def parked_on_approval(runtime: Runtime, program: Program, start_id: str) -> tuple[Any, dict[str, Any]]:
    """Start a run, settle its lost booking as booked, and return it with its pending approval."""
    host = Host(runtime)
    run = runtime.start(program, INPUT, start_id=start_id)
    runtime.wait_idle(run.tree_id)
    host.resolve(host.unknown(start_id)[0]["effect_id"], output="booked")
    runtime.wait_idle(run.tree_id)
    [pending] = host.pending(start_id)
    return run, pending


def stored(store: EventStore, start_id: str) -> list[str]:
    return [type(r.event).__name__ for r in store.read(TreeID.for_start(start_id))]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'host.db'}"


def test_refused_resolutions_append_nothing_and_do_not_take_the_run_over(url: str) -> None:
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as first:
            run = first.start(program, INPUT, start_id="r1")
            first.wait_idle(run.tree_id)
        # The run's owner is gone; a host process opens its own runtime.
        before = stored(store, "r1")
        with Runtime(store, Catalog([program])) as runtime:
            host = Host(runtime)
            [unknown] = host.unknown("r1")
            assert unknown["kind"] == "tool" and unknown["diagnostic"]["code"] == "engine.dispatch.failed"
            with pytest.raises(InvalidInput) as bad_disposition:
                host.resolve(unknown["effect_id"], output="x", disposition="perhaps")
            assert bad_disposition.value.code == "interaction.settlement.invalid"
            with pytest.raises(InvalidInput) as model_shape:
                host.resolve(unknown["effect_id"], model_response={"message": {"content": "hi"}})
            assert model_shape.value.code == "host.resolution_invalid"
            with pytest.raises(NotFound) as no_such:
                host.resolve("effect:" + "0" * 64, output="x")
            assert no_such.value.code == "engine.effect.not_pending"
            # Nothing was appended: not even a WriterActivated of this host's runtime.
            assert stored(store, "r1") == before
            assert not runtime.owns(TreeID.for_start("r1"))
            settlement = host.resolve(unknown["effect_id"], output={"content": "booked", "details": {"id": 7}})
            assert settlement.payload["tool_result"]["completion"]["disposition"] == "succeeded"
            runtime.wait_idle(run.tree_id)
            assert host.unknown("r1") == []
            assert stored(store, "r1")[len(before)] == "WriterActivated"
    finally:
        store.close()


def test_a_second_answer_under_another_signal_id_names_the_signal_that_answered_and_changes_nothing(url: str) -> None:
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            host = Host(runtime)
            run, pending = parked_on_approval(runtime, program, "r2")
            with pytest.raises(InvalidInput) as schema:
                host.answer(pending["process_id"], pending["wait_id"], {"nope": 1})
            assert schema.value.code == "engine.signal.schema"
            assert host.answer(pending["process_id"], pending["wait_id"], {"ok": True}, signal_id="answer:first")
            # The same signal id and answer again: a retry, accepted false, nothing new.
            assert host.answer(pending["process_id"], pending["wait_id"], {"ok": True}, signal_id="answer:first") is False
            assert run.result(timeout=30).status == "completed"
            events = stored(store, "r2")
            with pytest.raises(Rejected) as late:
                host.answer(pending["process_id"], pending["wait_id"], {"ok": False}, signal_id="answer:second")
            assert late.value.code == "engine.signal.rejected"
            assert late.value.details["wait"]["answered_by"] == "answer:first"
            assert stored(store, "r2") == events
    finally:
        store.close()


def test_input_for_a_run_another_runtime_owns_is_taken_up_by_that_owner(url: str) -> None:
    program = agent()
    owner_store, host_store = EventStore(url), EventStore(url)
    try:
        with Runtime(owner_store, Catalog([program]), poll_interval=0.05) as owner, \
                Runtime(host_store, Catalog([program])) as elsewhere:
            run = owner.start(program, INPUT, start_id="r3")
            owner.wait_idle(run.tree_id)
            host = Host(elsewhere)
            host.resolve(host.unknown("r3")[0]["effect_id"], output="booked")
            assert owner.owns(run.tree_id) and not elsewhere.owns(run.tree_id)
            found: list[Any] = []
            for _ in range(200):  # the owner takes the resolution up and asks for approval
                found = host.pending("r3")
                if found:
                    break
                time.sleep(0.05)
            [pending] = found
            host.answer(pending["process_id"], pending["wait_id"], {"ok": True})
            assert owner.result(run.tree_id, timeout=30).status == "completed"
            assert "WriterActivated" not in stored(host_store, "r3")[1:]
    finally:
        owner_store.close()
        host_store.close()


def test_a_host_reads_runs_its_runtime_never_started_when_given_their_programs(url: str) -> None:
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            runtime.wait_idle(runtime.start(program, INPUT, start_id="r4").tree_id)
        with Runtime(store) as bare:
            # Without the Program the stored payload is all there is: which tool, with what
            # arguments, is rebuilt from the Program's state, and resolving is refused.
            [kernel_view] = Host(bare).unknown()
            assert "invocation" not in kernel_view["request"]["tool_call"]
            with pytest.raises(NotFound) as unbound:
                Host(bare).resolve(kernel_view["effect_id"], output="booked")
            assert unbound.value.code == "engine.program.unavailable"
            host = Host(bare, ProgramSources(programs=(program,)))
            [entry] = host.unknown()
            assert entry["request"]["tool_call"]["invocation"]["call"]["name"] == "book"
            assert host.run("r4")["status"] == "waiting"
            assert [r["start_id"] for r in host.runs(status="waiting")] == ["r4"]
            assert host.runs(status="completed") == []
            root = host.run("r4")["root_process_id"]
            assert host.delegates(root) == {"process_id": root, "found": True, "delegates": []}
            host.resolve(entry["effect_id"], output="booked")
            bare.wait_idle(TreeID.for_start("r4"))
            assert [p["prompt"] for p in host.pending("r4")] == [{"question": "ok?"}]
    finally:
        store.close()


def test_arguments_of_the_wrong_kind_get_classified_errors_and_change_nothing(url: str) -> None:
    # Found by an error-code audit: these ended in TypeError / AttributeError, a library's
    # IntegrityError, a silently empty listing, or (result of a tree that does not exist) a
    # wait for as long as the timeout, for ever without one.
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run, _ = parked_on_approval(runtime, program, "kinds")
            host = Host(runtime)
            root = str(run.root_process_id)
            before = stored(store, "kinds")
            cases: list[tuple[Any, str]] = [
                (lambda: host.steer(root, 5), "interaction.signal.invalid"),  # type: ignore[arg-type]
                (lambda: host.steer(root, None), "interaction.signal.invalid"),  # type: ignore[arg-type]
                (lambda: host.run(5), "identity.invalid"),  # type: ignore[arg-type]
                (lambda: host.results(None), "identity.invalid"),  # type: ignore[arg-type]
                (lambda: host.runs(status="frob"), "host.page_invalid"),
                (lambda: host.runs(limit=0), "host.page_invalid"),
                (lambda: host.runs(limit="5"), "host.page_invalid"),  # type: ignore[arg-type]
                (lambda: host.runs(after="x"), "host.page_invalid"),  # type: ignore[arg-type]
                (lambda: host.runs(after=-1), "host.page_invalid"),
            ]
            for call, code in cases:
                with pytest.raises(InvalidInput) as refused:
                    call()
                assert refused.value.code == code
            started = time.monotonic()
            with pytest.raises(NotFound) as missing:
                runtime.result(TreeID.for_start("never-started"), 30)
            assert missing.value.code == "engine.tree.not_found" and time.monotonic() - started < 10
            assert [e["start_id"] for e in host.runs(status="waiting", limit=1)] == ["kinds"]
            assert stored(store, "kinds") == before
    finally:
        store.close()


@pytest.mark.parametrize(("control", "target", "ended"), [
    ("cancel", "root", "canceled"), ("kill", "tool", "killed"), ("deadline", "tool", "timed_out"),
])
def test_an_answer_to_the_input_of_a_process_that_ended_says_the_process_ended(
    url: str, control: str, target: str, ended: str,
) -> None:
    """It said ``engine.signal.rejected`` "not a pending tool input", where ``deliver_signals``
    and ``steer`` say ``engine.process.finished`` (a review of the Python API). Whatever ended
    the process that asked (the run canceled, its tool call killed or past its deadline: the
    last two found by the mutation audit of 2026-12-05), its wait takes no answer and nothing
    is stored."""
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            host = Host(runtime)
            run, pending = parked_on_approval(runtime, program, f"r-{control}")
            getattr(runtime, control)(pending["process_id"] if target == "tool" else run.root_process_id)
            assert run.result(timeout=30).status in ("failed", "canceled")
            tool = runtime.capture(run.tree_id).processes[ProcessID(pending["process_id"])]
            assert tool.status == ended, tool.status
            events = stored(store, f"r-{control}")
            with pytest.raises(Rejected) as late:
                host.answer(pending["process_id"], pending["wait_id"], {"ok": True})
            assert late.value.code == "engine.process.finished", late.value
            assert f"already ended {ended}" in late.value.message, late.value.message
            assert stored(store, f"r-{control}") == events
    finally:
        store.close()
