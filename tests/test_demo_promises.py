"""What `scripts/demo` (the README's main job) narrates is what happened: it fails, and says
so, when a promise does not hold.

Found by a mutation audit of agentfold/adapters/demo.py: a demo that resolved the wrong call,
never sent the steering message, recorded the booking as failed, accepted two bookings, or
ignored a step's exit status still ran to the end and passed the earlier tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters import demo
from agentfold.adapters.demo import DemoFailed, run_demo
from agentfold.adapters.eventstore import EventStore
from agentfold.domain.events import EffectDeclared, EffectResolved


def _bookings(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "side-effects.jsonl").read_text().splitlines()
    return [entry for entry in map(json.loads, lines) if entry["tool"] == "book_hotel"]


def test_the_history_holds_what_the_demo_narrates(tmp_path: Path) -> None:
    said: list[str] = []
    seen = run_demo(say=said.append, workdir=str(tmp_path))
    text = "\n".join(said)
    # Step 3 shows the call the process was killed inside: the hotel booking.
    assert 'book_hotel({"city": "Lisbon", "nights": 3})' in text
    [booking] = _bookings(tmp_path)

    store = EventStore(seen["store"])
    try:
        [tree_id] = store.tree_ids()
        events = [record.event for record in store.read(tree_id)]
    finally:
        store.close()
    # Step 4: the host resolved that very call, as succeeded, with the hotel's confirmation.
    [resolved] = [e for e in events if isinstance(e, EffectResolved)]
    assert resolved.effect_id == booking["effect_id"]
    completion = resolved.payload["tool_result"]["completion"]
    assert completion["disposition"] == "succeeded"
    assert completion["output"]["details"]["confirmation"] == "H-1042"
    # Step 5: the steering message reached the model, in its last request (after the tool results).
    model_calls = [e.payload["model_call"] for e in events
                   if isinstance(e, EffectDeclared) and isinstance(e.payload, dict) and "model_call" in e.payload]
    assert [call.get("applied_steer_signal_ids", []) for call in model_calls][-1] == ["steer-window-seat"]
    assert all("steer-window-seat" not in call.get("applied_steer_signal_ids", []) for call in model_calls[:-1])


def test_the_demo_reports_the_bookings_it_counted_and_refuses_a_second_one(tmp_path: Path) -> None:
    # A booking already in the hotel's log: the run books once more, so the world saw two.
    (tmp_path / "side-effects.jsonl").write_text(json.dumps({"tool": "book_hotel", "call_id": "earlier"}) + "\n")
    said: list[str] = []
    with pytest.raises(DemoFailed, match="expected one booking and a completed run, got 2"):
        run_demo(say=said.append, workdir=str(tmp_path))
    assert any("the outside world saw 2 booking(s)" in line for line in said), said
    assert any("the hotel was booked 2 time(s)" in line for line in said), said


def test_the_demo_fails_when_a_step_does_not_exit_as_it_promises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No crash happens (there is no 99th dispatcher call): step 1 promised a process killed inside the booking.
    monkeypatch.setattr(demo, "CRASH_POINT", "in-dispatch:99")
    with pytest.raises(DemoFailed, match="exited 0"):
        run_demo(say=lambda _: None, workdir=str(tmp_path))
