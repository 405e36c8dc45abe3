"""``Runtime.close()`` while a canceled call is within its cancellation grace period.

The grace timer fired after ``close()`` and raised ``RuntimeError: cannot schedule new futures
after shutdown`` in its thread (a traceback on stderr; found by a differential fuzz of the
kernel). Nothing a closed runtime started may raise; the call is recorded unknown by whoever
drives the tree next, as after a crash.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program


def test_a_grace_timer_that_fires_after_close_raises_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    entered = threading.Event()

    def slow(request: Any, context: Any) -> Settlement:
        entered.set()
        time.sleep(1.0)  # ignores context.cancelled
        return Settlement.succeeded({"value": 1})

    program = chain_program(slow)
    store = EventStore(f"sqlite:///{tmp_path / 'a.db'}")
    runtime = Runtime(store, Catalog([program]), cancel_grace=0.3)
    try:
        handle = runtime.start(program, {"n": 3})
        assert entered.wait(10)
        runtime.cancel(handle.root_process_id)
        runtime.close()
        time.sleep(1.5)  # past the grace period and the call's own end
    finally:
        runtime.close()
        store.close()
    assert raised == []
