"""A child process for the Interaction crash tests: run a scenario, die at a crash point.

    python -m tests.interaction.worker STORE_URL SCENARIO_FILE START_ID CRASH_POINT

The scenario Program is rebuilt by its document alone (``agentfold.adapters.scenario``), so the
test process recovers the tree with nothing but the store: no Program object, no
model, no tool of the dead process survives. Exit 75: the crash plan fired; 0: the
run ended without reaching it (a JSON summary on stdout); 4: any other error.
"""

from __future__ import annotations

import json
import sys
import traceback

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import CrashPlan, Runtime
from agentfold.adapters.scenario import load_scenario_file, scenario_catalog, scenario_input, scenario_program


def main(argv: list[str]) -> int:
    url, scenario, start_id, point = argv
    doc = load_scenario_file(scenario)
    program = scenario_program(doc)
    store = EventStore(url)
    runtime = Runtime(store, scenario_catalog(program), crash=CrashPlan.parse(point), poll_interval=0)
    try:
        handle = runtime.start(program, scenario_input(doc), start_id=start_id)
        result = handle.result(timeout=30)
        print(json.dumps({"status": result.status}))
        return 0
    finally:
        runtime.close()
        store.close()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:  # noqa: BLE001 - report to the test
        traceback.print_exc()
        sys.exit(4)
