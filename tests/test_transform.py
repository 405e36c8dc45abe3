"""Transforms (``agentfold.adapters.team.transform``): a Program whose one Effect calls a Python
function of its input. What a user observes: the function's exception fails the Process
(``transform.failed``, with the exception's text), a non-JSON return value too; the input and the
output are stored once; a crash inside the function (real process death) leaves the Effect
unknown, recovery calls nothing, and the host's resolution (the function's return value, or
its error text) decides the run, while a resolution that cannot be a transform's outcome is
refused before anything is stored.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import TransformConfig, transform
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import EffectDeclared, ProcessTerminated

ROOT = Path(__file__).resolve().parent.parent
WAIT = 20.0


def boom(value: Any) -> Any:
    raise ValueError(f"cannot handle {value!r}")


def not_json(value: Any) -> Any:
    return {1, 2}


def double(value: Any) -> Any:
    return {"doubled": value * 2, "note": "x" * 600}


def crash_once(value: Any) -> Any:
    """Counts its call in a file outside the process, then dies (os._exit) mid-call."""
    with open(os.environ["TRANSFORM_CALLS"], "a") as log:
        log.write(f"{value}\n")
    os._exit(75)


def _run(program: Any, value: Any) -> Any:
    store = EventStore("memory:")
    runtime = Runtime(store, Catalog([program]))
    try:
        return runtime.start(program, value).result(WAIT)
    finally:
        runtime.close()
        store.close()


def test_an_exception_fails_the_process_with_its_text() -> None:
    result = _run(transform(TransformConfig("t.boom", boom)), 7)
    assert result.status == "failed"
    failure = result.termination["failure"]
    assert (failure["kind"], failure["code"]) == ("execution", "transform.failed")
    assert failure["message"] == "ValueError: cannot handle 7"


def test_a_return_value_that_is_not_json_fails_the_process() -> None:
    result = _run(transform(TransformConfig("t.set", not_json)), 1)
    failure = result.termination["failure"]
    assert failure["code"] == "transform.failed" and "returned no JSON value" in failure["message"]


def test_the_input_and_the_output_are_stored_once(tmp_path: Path) -> None:
    program = transform(TransformConfig("t.double", double, input_schema={"type": "integer"}))
    store = EventStore(f"sqlite:///{tmp_path / 'once.db'}")
    runtime = Runtime(store, Catalog([program]))
    try:
        handle = runtime.start(program, 21)
        result = handle.result(WAIT)
    finally:
        runtime.close()
    try:
        assert result.status == "completed" and result.output["doubled"] == 42
        events = [record.event for record in store.read(handle.tree_id)]
    finally:
        store.close()
    declared = [e for e in events if isinstance(e, EffectDeclared)]
    assert [e.payload for e in declared] == [{"transform": {}}]  # the input is not copied into the Effect
    [ended] = [e for e in events if isinstance(e, ProcessTerminated)]
    assert ended.output is None and ended.output_of is not None  # the output refers to the Effect's result


def test_a_bad_input_is_refused_at_the_start_and_stores_nothing(tmp_path: Path) -> None:
    program = transform(TransformConfig("t.double", double, input_schema={"type": "integer"}))
    store = EventStore(f"sqlite:///{tmp_path / 'bad.db'}")
    runtime = Runtime(store, Catalog([program]))
    try:
        with pytest.raises(InvalidInput):
            runtime.start(program, "twenty-one")
        assert store.max_notification_id() == 0
    finally:
        runtime.close()
        store.close()


# A pinned identity: pytest and the worker import this module under different names.
CRASH_PROGRAM = transform(TransformConfig("t.crash", crash_once, identity="tests.crash_once/1",
                                          output_schema={"type": "object"}))

_WORKER = """
import sys
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.test_transform import CRASH_PROGRAM
store = EventStore(sys.argv[1])
runtime = Runtime(store, Catalog([CRASH_PROGRAM]))
runtime.start(CRASH_PROGRAM, {"n": 5}, start_id="crash-1").result(30)
"""


def crashed_inside_the_function(tmp_path: Path) -> tuple[str, Path]:
    """A process that died (for real) inside CRASH_PROGRAM's function, run ``crash-1``: the
    store's URL and the log of the function's calls."""
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    calls = tmp_path / "calls.log"
    env = {**os.environ, "TRANSFORM_CALLS": str(calls), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _WORKER, url], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 75, done.stderr
    return url, calls


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_crash_inside_the_function_waits_for_the_host_and_nothing_runs_twice(tmp_path: Path, outcome: str) -> None:
    url, calls = crashed_inside_the_function(tmp_path)
    assert calls.read_text().splitlines() == ["{'n': 5}"]
    os.environ["TRANSFORM_CALLS"] = str(calls)
    store = EventStore(url)
    runtime = Runtime(store, Catalog([CRASH_PROGRAM]))
    try:
        [handle] = runtime.recover("crash-1")
        runtime.wait_idle(handle.tree_id)
        host = Host(runtime)
        [unknown] = host.unknown("crash-1")
        assert unknown["request"] == {"transform": {"input": {"n": 5}}}  # what the call was given
        head = store.max_notification_id()
        # Neither a value without a status' meaning nor a failure without its text is taken.
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], output={"code": 3}, status="failed")
        assert refused.value.code == "host.resolution_invalid"
        # A value the function could not have returned (its output schema) would fail the run.
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], output=10)
        assert refused.value.code == "host.resolution_invalid" and "output schema" in refused.value.message
        assert store.max_notification_id() == head
        if outcome == "succeeded":
            host.resolve(unknown["effect_id"], output={"value": 10})
        else:
            host.resolve(unknown["effect_id"], output="the service answered 500", status="failed")
        result = handle.result(WAIT)
    finally:
        runtime.close()
        store.close()
    assert calls.read_text().splitlines() == ["{'n': 5}"]  # recovery and resolution called nothing
    if outcome == "succeeded":
        assert (result.status, result.output) == ("completed", {"value": 10})
    else:
        assert result.status == "failed"
        assert result.termination["failure"]["code"] == "transform.failed"
        assert result.termination["failure"]["message"] == "the service answered 500"
