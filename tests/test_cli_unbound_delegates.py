"""`agentfold delegates` of a run whose Programs the CLI does not bind is refused, as `results`.

Found by a docs walkthrough: on python.md's own Interaction run (its Program bound only in
the deployment's console script), `agentfold delegates ROOT` answered "process ... is not an
Interaction" (`found` false, exit 0) while `results` refused `engine.program.unavailable`.
"""

from __future__ import annotations

from pathlib import Path

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.kernel_programs import asker_program
from tests.test_cli import agentfold, refused, sqlite_url


def test_delegates_of_a_run_the_cli_cannot_bind_is_refused(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    program = asker_program("mine.unbound")  # bound here, not in the `agentfold` console script
    with Runtime(EventStore(store, create=True), Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {}, start_id="unbound-1")
        runtime.wait_idle(handle.tree_id, timeout=30)
    error = refused(agentfold("delegates", str(handle.root_process_id), "--json", store=store)).error()
    assert error["code"] == "engine.program.unavailable", error
    assert "mine.unbound" in error["message"], error
    results = refused(agentfold("results", "unbound-1", "--json", store=store)).error()
    assert results["code"] == "engine.program.unavailable", results
