"""``Runtime.result``, ``wait_idle`` and ``status`` as a host calls them: with ids in text, for a
run another runtime drives, and after the runtime was closed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime, RuntimeStopped
from agentfold.domain.program import Target
from tests.kernel_programs import CallLog, GatedCall, asker_program, chain_program


def _calls_in_flight(tree: Any) -> int:
    return sum(r.target == Target.DISPATCHER for p in tree.live.values() for r in p.in_flight())


def test_result_wait_idle_and_status_take_a_start_id_or_a_tree_id_in_text(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'text.db'}")
    program = chain_program(name="test.waits.text")
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {"n": 2}, start_id="by-text")
        assert runtime.result("by-text", timeout=30).output == {"total": 2, "effects": 2}
        assert runtime.result(str(handle.tree_id), timeout=30).status == "completed"
        assert runtime.wait_idle("by-text").root.status == "completed"
        assert runtime.wait_idle(str(handle.tree_id)).root.status == "completed"
        assert runtime.status("by-text") == runtime.status(str(handle.tree_id)) == "completed"
    with Runtime(store, Catalog([program])) as other:  # a runtime that never drove it reads it too
        assert other.result("by-text", timeout=5).status == "completed"
        assert other.wait_idle("by-text").root.status == "completed"
    store.close()


def test_wait_idle_waits_for_a_run_another_runtime_drives(durable_store_url: str, tmp_path: Path) -> None:
    """A host process that does not drive the run (``adopt_on_admit=False``) waits until the
    run's owner has nothing left to do: not while a call is in flight."""
    log = CallLog(tmp_path / "calls.jsonl")
    gated = GatedCall(log, at=0)
    program = chain_program(gated, name="test.waits.elsewhere")
    store, host_store = EventStore(durable_store_url), EventStore(durable_store_url)
    with Runtime(store, Catalog([program])) as owner, \
            Runtime(host_store, Catalog([program]), adopt_on_admit=False) as host:
        handle = owner.start(program, {"n": 2}, start_id="driven-elsewhere")
        assert gated.entered.wait(30)
        with pytest.raises(TimeoutError, match="still busy"):
            host.wait_idle("driven-elsewhere", timeout=0.3)
        answers: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: answers.setdefault("tree", host.wait_idle(handle.tree_id, timeout=30)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive(), "wait_idle returned while the owner's call was in flight"
        gated.release.set()
        waiter.join(30)
        tree = answers["tree"]
        assert tree.root.status == "completed" and _calls_in_flight(tree) == 0
    store.close()
    host_store.close()


def test_a_parked_run_driven_elsewhere_is_idle_at_once(durable_store_url: str) -> None:
    program = asker_program("test.waits.parked")
    store, host_store = EventStore(durable_store_url), EventStore(durable_store_url)
    with Runtime(store, Catalog([program])) as owner, \
            Runtime(host_store, Catalog([program]), adopt_on_admit=False) as host:
        handle = owner.start(program, {}, start_id="parked-elsewhere")
        owner.wait_idle(handle.tree_id)
        began = time.monotonic()
        tree = host.wait_idle("parked-elsewhere", timeout=10)
        assert time.monotonic() - began < 5
        assert tree.root.status == "waiting" and tree.root.current_wait is not None
    store.close()
    host_store.close()


def test_result_and_wait_idle_after_close_say_so_instead_of_waiting(tmp_path: Path) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    gated = GatedCall(log, at=0)
    program = chain_program(gated, name="test.waits.closed")
    store = EventStore(f"sqlite:///{tmp_path / 'closed.db'}")
    runtime = Runtime(store, Catalog([program]), cancel_grace=0.1)
    handle = runtime.start(program, {"n": 2}, start_id="closed-under-it")
    assert gated.entered.wait(30)
    runtime.close(timeout=1)
    gated.release.set()
    outcomes: dict[str, BaseException] = {}

    def call(name: str, fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - recorded, asserted below
            outcomes[name] = exc

    threads = [
        threading.Thread(target=call, args=("result", lambda: handle.result())),  # no timeout: waited for good before
        threading.Thread(target=call, args=("wait_idle", lambda: runtime.wait_idle(handle.tree_id, timeout=30))),
    ]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert time.monotonic() - began < 5
    for name in ("result", "wait_idle"):
        assert isinstance(outcomes.get(name), RuntimeStopped), outcomes
        assert outcomes[name].code == "engine.runtime.closed"  # type: ignore[attr-defined]
    store.close()


def test_a_wait_idle_under_way_when_the_runtime_closes_says_so_instead_of_a_busy_state(tmp_path: Path) -> None:
    gated = GatedCall(CallLog(tmp_path / "calls.jsonl"), at=0)
    program = chain_program(gated, name="test.waits.closing")
    store = EventStore(f"sqlite:///{tmp_path / 'closing.db'}")
    runtime = Runtime(store, Catalog([program]), cancel_grace=0.1)
    handle = runtime.start(program, {"n": 2}, start_id="closing-under-a-wait")
    assert gated.entered.wait(30)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["tree"] = runtime.wait_idle(handle.tree_id, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - recorded, asserted below
            outcome["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    runtime.close(timeout=1)
    waiter.join(10)
    gated.release.set()
    assert "tree" not in outcome, "wait_idle returned a tree with a call in flight"
    assert isinstance(outcome["error"], RuntimeStopped) and outcome["error"].code == "engine.runtime.closed"
    store.close()


def test_cli_commands_answer_a_run_another_runtime_drives_as_stored_without_waiting(tmp_path: Path) -> None:
    """docs/cli.md: when another live runtime owns the tree, `driven` is false and the tree is
    the summary as stored; the command does not wait for that runtime's calls."""
    from agentfold.adapters import cli
    from agentfold.adapters.sources import ProgramSources

    gated = GatedCall(CallLog(tmp_path / "calls.jsonl"), at=0)
    program = chain_program(gated, name="test.waits.cli.elsewhere")
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    store = EventStore(url)
    with Runtime(store, Catalog([program])) as owner:
        handle = owner.start(program, {"n": 2}, start_id="cli-elsewhere")
        assert gated.entered.wait(30)
        began = time.monotonic()
        code = cli.main(["pause", str(handle.root_process_id), "--store", url, "--timeout", "20", "--json"],
                        sources=ProgramSources(programs=(program,)))
        assert code == 0 and time.monotonic() - began < 10
        gated.release.set()
        owner.wait_idle(handle.tree_id, timeout=30)
    store.close()


def test_a_request_the_owner_line_does_not_take_in_time_is_a_classified_error_and_stays_queued(tmp_path: Path) -> None:
    """A host request waits for the tree's owner line; a line busy with a long pass (here: held)
    answered a bare TimeoutError although the request was applied later (extremes audit)."""
    program = asker_program("test.waits.busy-line")
    store = EventStore(f"sqlite:///{tmp_path / 'busy.db'}")
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {}, start_id="busy-line")
        runtime.wait_idle(handle.tree_id)
        driver = runtime._drivers[handle.tree_id]
        with driver.lock:  # the line cannot run a cycle meanwhile
            with pytest.raises(RuntimeStopped) as busy:
                driver.call(lambda kernel: (kernel.request_control(handle.root_process_id, "pause", "busy"), True),
                            timeout=0.3)
        assert busy.value.code == "engine.runtime.busy" and "still queued" in busy.value.message
        assert runtime.wait_idle(handle.tree_id).root.status == "paused"  # applied once the line got to it
    store.close()
