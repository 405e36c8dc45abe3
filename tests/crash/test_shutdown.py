"""Closing a Runtime and then its store must not kill the process.

``Runtime.close()`` has to wait for its watcher thread: otherwise the watcher can be
inside a SQLite query when the caller closes the store, and the process dies with a
segmentation fault. The loop runs in a child process so such a death fails this test
instead of the whole test run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.crash.support import ROOT

SCRIPT = """
import sys
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.kernel_programs import asker_program

directory = sys.argv[1]
for i in range(60):
    store = EventStore(f"sqlite:///{directory}/close-{i}.db")
    runtime = Runtime(store, poll_interval=0.0005)  # the watcher queries the store all the time
    handle = runtime.start(asker_program(), None)
    runtime.wait_idle(handle.tree_id)
    runtime.close()
    store.close()
print("closed cleanly")
"""


def test_closing_the_runtime_then_its_store_never_kills_the_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "closed cleanly"
