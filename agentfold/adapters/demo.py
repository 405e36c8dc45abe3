"""``agentfold demo``: the bundled trip-planner scenario, narrated, on a temporary SQLite store.

Every step runs the real ``agentfold`` command in a new process, so the crash is a
real process death: a tool round; a crash inside the hotel booking after the booking
happened; recovery, which surfaces that call as unknown instead of running it again;
the host's resolution; a human answer to an input wait; a steering message; the final
answer. At the end it checks the outside world: the hotel was booked exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

CRASH_POINT = "in-dispatch:3"  # dispatcher effects in commit order: model call, weather, book_hotel


class DemoFailed(Exception):
    pass


def _cli(store: str, *args: str, expect: Sequence[int] = (0,)) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "agentfold.adapters.cli", "--store", store, *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    if proc.returncode not in expect:
        raise DemoFailed(f"`agentfold {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}")
    return proc.returncode, proc.stdout, proc.stderr


def _json(store: str, *args: str) -> Any:
    return json.loads(_cli(store, *args, "--json")[1])


def run_demo(say: Callable[[str], None] = print, workdir: str | None = None) -> dict[str, Any]:
    """Run the narrated demo; returns what it observed (raises DemoFailed on any surprise)."""
    folder = Path(workdir or tempfile.mkdtemp(prefix="agentfold-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    scenario = json.loads(resources.files("agentfold.adapters").joinpath("scenarios/demo.json").read_text())
    log = folder / "side-effects.jsonl"
    scenario["side_effect_log"] = str(log)
    scenario_file = folder / "trip-planner.json"
    scenario_file.write_text(json.dumps(scenario, indent=2))
    store = f"sqlite:///{folder / 'demo.db'}"

    def bookings() -> int:
        if not log.exists():
            return 0
        return sum(1 for line in log.read_text().splitlines() if json.loads(line)["tool"] == "book_hotel")

    say(f"agentfold demo: every step below is a separate `agentfold` process on {store}\n")
    say("1. Start the trip planner. The model asks for the weather and a hotel booking (one tool round);")
    say(f"   the process is killed INSIDE the hotel booking, right after the booking happened ({CRASH_POINT}).")
    code, _, _ = _cli(store, "run", str(scenario_file), "--start-id", "demo-trip", "--crash-after", CRASH_POINT,
                      expect=(75,))
    say(f"   -> the process died with exit status {code}; the outside world saw {bookings()} booking(s).\n")

    say("2. Recover. Nothing is called again: the booking was dispatched but its outcome was never recorded,")
    say("   so it becomes UNKNOWN and waits for a host. The weather result, already recorded, is kept.")
    recovered = _json(store, "recover")["trees"][0]
    say(f"   -> tree {recovered['tree_id']} is {recovered['classification']}; unknown: {recovered['unknown_effect_ids']}\n")

    unknown = _json(store, "unknown")["unknown_effects"]
    if len(unknown) != 1 or unknown[0]["kind"] != "tool":
        raise DemoFailed(f"expected one unknown tool call, got {unknown}")
    entry = unknown[0]
    call = entry["request"]["tool_call"]["invocation"]["call"]
    if call["name"] != "book_hotel":  # the call the process was killed inside, as step 1 says
        raise DemoFailed(f"expected the hotel booking to be the unknown call, got {call['name']}")
    say("3. `agentfold unknown` shows what a host must investigate:")
    say(f"   effect {entry['effect_id']}")
    say(f"   tool call {entry['tool_call_ref']}: {call['name']}({call['arguments']})")
    say(f"   diagnostic: {entry['diagnostic']['code']}: {entry['diagnostic']['message']}\n")

    say(f"4. The host checks the hotel's system: the booking exists ({bookings()} in the side-effect log).")
    say("   It resolves the unknown call with the real confirmation; the run continues without booking again.")
    output = json.dumps({"details": {"hotel": "Hotel Alfama", "confirmation": "H-1042", "total_eur": 420}})
    _json(store, "resolve", entry["effect_id"], "--output", output)
    pending = _json(store, "pending")["pending"]
    if len(pending) != 1:
        raise DemoFailed(f"expected one pending tool input, got {pending}")
    wait = pending[0]
    say(f"   -> the model asked for budget approval; tool call {wait['tool_call_ref']} waits for a human:")
    say(f"      prompt: {json.dumps(wait['prompt'])}\n")

    root = recovered["root_process_id"]
    say("5. While the tool waits, the traveller sends a steering message to the planner.")
    _json(store, "steer", root, "Please also note that I prefer a window seat.", "--signal-id", "steer-window-seat")
    say("   -> it is queued: it will appear in the next model request, after this round's tool results.\n")

    say("6. An answer that does not match the response schema is refused and the wait stays open:")
    code, _, err = _cli(store, "answer", wait["process_id"], wait["wait_id"], '{"approved": "yes"}', expect=(2,))
    say(f"   -> exit status {code}: {err.strip()}")
    say("   A valid answer completes the run:")
    _json(store, "answer", wait["process_id"], wait["wait_id"], '{"approved": true}', "--signal-id", "approve-1")
    tree = _json(store, "show", "demo-trip")
    root_state = tree["processes"][0]
    final = root_state["output"]["model_response"]["message"]["content"][0]["text"]
    say(f"   -> the run is {root_state['status']} after {root_state['output']['model_calls']} model calls:")
    say(f"      {final}\n")

    count = bookings()
    say(f"7. The outside world: the hotel was booked {count} time(s).")
    if count != 1 or root_state["status"] != "completed":
        raise DemoFailed(f"expected one booking and a completed run, got {count} and {root_state['status']}")
    say(f"   Inspect the history: agentfold --store {store} show demo-trip")
    return {"store": store, "bookings": count, "status": root_state["status"], "final": final}


def main() -> int:
    try:
        run_demo()
    except DemoFailed as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
