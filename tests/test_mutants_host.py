"""The host's requests (agentfold.adapters.host, agentfold.adapters.resolution): behaviour the
mutation audit of 2026-12-05 ("host") found undefended. Each test failed with its mutant and
passes without it.

docs/python.md: ``host.steer(process_id, text_or_messages, signal_id=None)`` gives user
message(s) for the Interaction's next model request, True when admitted, False when that
signal id was already admitted; ``Host.resolve`` and ``Host.answer`` check every rule against
the tree as stored before anything is appended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host, answer_signal, deliver_answer
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import MAX_DIAGNOSTIC_BYTES, InvalidInput, Rejected
from agentfold.domain.ids import ProcessID, SignalID, WaitID
from agentfold.projections.read_models import Entry
from tests.interaction.test_resolution_checked import _parked, running
from tests.test_host_python import INPUT, Approve, Book, agent, calls, parked_on_approval, stored
from tests.test_mutants_s26 import context_program
from tests.test_transform import CRASH_PROGRAM, crashed_inside_the_function

DONE = {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'host.db'}"


@contextlib.contextmanager
def parked_unknown(url: str, program: Any, start_id: str, kind: str) -> Iterator[tuple[Runtime, EventStore, Host, Any, Entry, Any]]:
    """A run of ``program`` whose first runtime left one ``kind`` call unknown, opened by a second
    runtime that does not own it: (runtime, store, host, run, the unknown entry, what is stored)."""
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, INPUT, start_id=start_id)
            runtime.wait_idle(run.tree_id)
        with Runtime(store, Catalog([program])) as runtime:
            host = Host(runtime)
            [unknown] = host.unknown(start_id)
            assert unknown["kind"] == kind
            yield runtime, store, host, run, unknown, stored(store, start_id)
    finally:
        store.close()


def lost_model_call() -> Any:
    """An Interaction whose first model call is lost (unknown), then answers ``done``."""
    model = ScriptedModel([{"error": "the connection dropped mid-response"}, DONE])
    return compile_interaction(InteractionConfig(name="host.lost-model", model=model, tools=[Book()]))


def texts(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [])


def test_a_steer_of_several_messages_reaches_the_next_model_request_whole_and_its_resend_appends_nothing(
    url: str,
) -> None:
    model = ScriptedModel([calls("book"), calls("approve"), DONE])
    program = compile_interaction(InteractionConfig(name="host.steer", model=model, tools=[Book(), Approve()]))
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            host = Host(runtime)
            run, pending = parked_on_approval(runtime, program, "steer-many")
            root = str(run.root_process_id)
            steer = [{"role": "user", "content": "Prefer a window seat."},
                     {"role": "user", "content": "And a room with a view."}]
            assert host.steer(root, steer, signal_id="steer:both") is True
            events = stored(store, "steer-many")
            # The same signal id and messages again: already admitted, nothing appended.
            assert host.steer(root, steer, signal_id="steer:both") is False
            assert stored(store, "steer-many") == events
            host.answer(pending["process_id"], pending["wait_id"], {"ok": True})
            assert run.result(timeout=30).status == "completed"
    finally:
        store.close()
    last = model.requests[-1]
    assert list(last.applied_steer_signal_ids) == ["steer:both"]
    said = [texts(m) for m in last.messages if m["role"] == "user"]
    assert said[-2:] == ["Prefer a window seat.", "And a room with a view."], said
    assert sum(t == "Prefer a window seat." for t in said) == 1


def test_a_model_response_given_for_a_tool_call_is_refused_as_the_wrong_kind_and_appends_nothing(url: str) -> None:
    """docs/errors.md ``host.resolution_invalid``: ``Host.resolve`` with options that do not fit
    the effect (``model_response`` on a tool call) is refused by the host's rule, before the
    Program's settle helper is asked to read a tool call as a model call."""
    with parked_unknown(url, agent(), "wrong-kind", "tool") as (runtime, store, host, run, unknown, before):
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], model_response={"message": {"content": "booked"}, "finish_reason": "stop"})
        assert refused.value.code == "host.resolution_invalid", refused.value
        assert "is not a model call" in refused.value.message and "output" in refused.value.message
        assert stored(store, "wrong-kind") == before
        assert not runtime.owns(run.tree_id)
        assert [u["effect_id"] for u in host.unknown("wrong-kind")] == [unknown["effect_id"]]


def test_a_status_given_for_a_tool_call_is_refused_never_ignored_and_appends_nothing(url: str) -> None:
    """docs/errors.md ``host.resolution_invalid``: a tool call is resolved with a disposition;
    ``status="failed"`` on one was silently dropped and the call recorded as succeeded."""
    with parked_unknown(url, agent(), "tool-status", "tool") as (runtime, store, host, run, unknown, before):
        for status in ("failed", "succeeded"):
            with pytest.raises(InvalidInput) as refused:
                host.resolve(unknown["effect_id"], output="the booking was declined", status=status)
            assert refused.value.code == "host.resolution_invalid", refused.value
            assert "disposition" in refused.value.message
        assert stored(store, "tool-status") == before
        assert not runtime.owns(run.tree_id)
        settled = host.resolve(unknown["effect_id"], output="the booking was declined", disposition="failed")
        assert settled.payload["tool_result"]["completion"]["disposition"] == "failed"


def test_an_output_given_for_a_model_call_is_refused_before_anything_is_appended(url: str) -> None:
    """docs/errors.md ``host.resolution_invalid``: a model call is resolved with
    ``model_response``; an ``output`` is refused by the host's rule, before the run is taken
    over (nothing appended, not even a WriterActivated)."""
    with parked_unknown(url, lost_model_call(), "model-output", "model") as (runtime, store, host, run, unknown, before):
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], output="done")
        assert refused.value.code == "host.resolution_invalid", refused.value
        assert "is a model call" in refused.value.message and "model_response" in refused.value.message
        assert stored(store, "model-output") == before
        assert not runtime.owns(run.tree_id)
        assert [u["effect_id"] for u in host.unknown("model-output")] == [unknown["effect_id"]]


def test_a_disposition_given_for_a_context_preparation_is_refused_never_ignored(tmp_path: Path) -> None:
    """A context preparation is resolved with ``output`` (the prepared messages) and, to fail
    it, ``status="failed"``; ``disposition="failed"`` (a tool call's word) was silently dropped
    and the preparation recorded as succeeded with the messages given."""
    program = context_program()
    with running(tmp_path, program, "context.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "hi"}]})
        assert [u["kind"] for u in Host(runtime).unknown(str(handle.tree_id))] == ["context"]
        version = store.load(handle.tree_id).state.version
        for disposition in ("failed", "succeeded"):
            with pytest.raises(InvalidInput) as refused:
                Host(runtime).resolve(effect, output=[{"role": "user", "content": "hi (summarized)"}],
                                      disposition=disposition)
            assert refused.value.code == "host.resolution_invalid", refused.value
            assert "disposition" in refused.value.message and "status" in refused.value.message
        assert store.load(handle.tree_id).state.version == version
        assert list(runtime.capture(handle.tree_id).unknown_ids) == [effect]


def test_a_failed_transform_call_resolved_with_a_blank_error_text_is_refused(tmp_path: Path) -> None:
    """A failed transform call is resolved with the error's text, which the Process fails
    with (``transform.failed``): blank text is refused as no text is, and nothing is stored.
    The call's outcome is unknown because its process died inside the function (a real
    crash: tests/test_transform.py's worker)."""
    url, calls = crashed_inside_the_function(tmp_path)
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([CRASH_PROGRAM])) as runtime:
            [handle] = runtime.recover("crash-1")
            runtime.wait_idle(handle.tree_id)
            host = Host(runtime)
            [unknown] = host.unknown("crash-1")
            head = store.max_notification_id()
            for blank in ("", "   ", "\n\t"):
                with pytest.raises(InvalidInput) as refused:
                    host.resolve(unknown["effect_id"], output=blank, status="failed")
                assert refused.value.code == "host.resolution_invalid", blank
                assert "the error's text" in refused.value.message
            assert store.max_notification_id() == head
            assert [u["effect_id"] for u in host.unknown("crash-1")] == [unknown["effect_id"]]
            # The text is a diagnostic: trimmed and bounded as the function's own exception's would be.
            host.resolve(unknown["effect_id"], output="  the service answered 500: " + "e" * 50_000 + "\n",
                         status="failed")
            failure = handle.result(30).termination["failure"]
    finally:
        store.close()
    assert calls.read_text().splitlines() == ["{'n': 5}"]
    assert failure["code"] == "transform.failed"
    assert failure["message"].startswith("the service answered 500: eee")
    assert len(failure["message"].encode()) <= MAX_DIAGNOSTIC_BYTES


def test_a_model_response_whose_message_is_not_the_assistants_is_refused_not_rewritten_as_one(url: str) -> None:
    """The role of a model response's message may be left out (it is the assistant's), but a
    message given as the user's or a tool's is refused (``interaction.settlement.invalid``):
    it must not be rewritten as the assistant's and recorded."""
    with parked_unknown(url, lost_model_call(), "model-role", "model") as (runtime, store, host, run, unknown, before):
        for role in ("user", "system"):
            with pytest.raises(InvalidInput) as refused:
                host.resolve(unknown["effect_id"],
                             model_response={"message": {"role": role, "content": "forged"}, "finish_reason": "stop"})
            assert refused.value.code == "interaction.settlement.invalid", refused.value
            assert "assistant" in refused.value.message
        assert stored(store, "model-role") == before
        settled = host.resolve(unknown["effect_id"], model_response={"message": {"content": "done"},
                                                                     "finish_reason": "stop"})
        assert settled.payload["model_result"]["response"]["message"]["role"] == "assistant"
        assert runtime.result(run.tree_id, timeout=30).status == "completed"


def test_an_answer_that_lost_the_race_for_a_wait_hears_who_answered_it_even_after_the_run_completed(url: str) -> None:
    """The race the HTTP API's racing tests hit only sometimes, made deterministic with the
    front ends' own steps (``answer_signal`` on the tree as the loser read it, then
    ``deliver_answer``): the loser's answer passed the check, the winner's answer was then
    admitted and the run completed. Whether the winner's Tool child has finished by then or
    not, the loser is told the wait was already answered and by which signal id
    (``engine.signal.rejected``), not that the process finished; nothing is appended."""
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            host = Host(runtime)
            run, pending = parked_on_approval(runtime, program, "race")
            pid, wid = ProcessID(pending["process_id"]), WaitID(pending["wait_id"])
            as_read, programs = host.queries().fold(run.tree_id)
            loser = answer_signal(as_read, programs, pid, wid, {"ok": False}, SignalID("answer:loser"), listing_hint="-")
            assert host.answer(pid, wid, {"ok": True}, signal_id="answer:winner") is True
            assert run.result(timeout=30).status == "completed"
            events = stored(store, "race")
            with pytest.raises(Rejected) as late:
                deliver_answer(runtime, run.tree_id, pid, loser)
            assert late.value.code == "engine.signal.rejected", late.value
            assert late.value.details["wait"]["state"] == "answered"
            assert late.value.details["wait"]["answered_by"] == "answer:winner"
            assert "already answered (by answer:winner)" in late.value.message
            assert stored(store, "race") == events
    finally:
        store.close()
