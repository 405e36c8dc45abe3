"""What `agentfold transcript` and `agentfold transcripts` print.

A transcript's text comes from the topic (anyone allowed to write to it fills it): its control
characters are printed escaped (``\\u001b``), never raw, so a message cannot clear the
terminal, set its title or move the cursor; ``--json`` is unchanged. A ``--db`` URL is never
printed with its password, and ``transcripts.unavailable`` says what to check.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.cli_feed import transcript_text
from agentfold.adapters.transcripts import TranscriptStore
from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.integrity import chain_digest
from tests.feed.support import ROOT

AGENTFOLD = [sys.executable, "-m", "agentfold.adapters.cli"]
ATTACK = "\u001b[2J\u001b]0;PWNED\u0007\u009b31mred\u007f"
RAW_CONTROLS = [chr(c) for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0))]
TREE, PID = "tree:" + "a" * 32, "process:" + "b" * 32


def _envelopes() -> list[dict[str, Any]]:
    """One Interaction whose every printed text carries terminal control sequences, chained as
    the publisher chains them (so the consumer takes them: the chain is not about content)."""
    answer = {"role": "assistant", "content": "answer " + ATTACK, "tool_calls": [
        {"id": "c0", "name": "look" + ATTACK, "arguments": '{"q": "' + "\\u001b[2J" + '"}'}]}
    events: list[tuple[str, dict[str, Any]]] = [
        ("TreeStarted", {"input": {"messages": [{"role": "user" + ATTACK, "content": "hello " + ATTACK}]}}),
        ("EffectDeclared", {"effect_id": "effect:m1", "target": "dispatcher",
                            "payload": {"model_call": {"model_call_sequence": 1, "message_count": 1}}}),
        ("SignalAdmitted", {"signal_id": "steer-1", "payload": {"steer": {"messages": [
            {"role": "user", "content": ATTACK + "...window seat please"}]}}}),
        ("EffectSettled", {"effect_id": "effect:m1", "status": "succeeded", "payload": {"model_result": {"response": {
            "finish_reason": "tool_calls", "message": answer}}}}),
        ("ProcessTerminated", {"status": "failed" + ATTACK, "cause": "error" + ATTACK, "reason": "why " + ATTACK}),
    ]
    out, previous = [], None
    for position, (kind, payload) in enumerate(events, start=1):
        body = {"process_id": PID, **payload}
        timestamp = "2026-01-01T00:00:00.000000Z"
        previous = chain_digest(previous, TREE, position, kind, canonical_bytes({"event": body, "timestamp": timestamp}))
        out.append({"notification_id": position, "tree_id": TREE, "position": position, "process_id": PID, "type": kind,
                    "schema_version": 1, "timestamp": timestamp, "payload": body, "digest": previous})
    return out


def _no_raw_controls(text: str) -> None:
    found = sorted({f"U+{ord(c):04X}" for c in text if c in RAW_CONTROLS})
    assert not found, f"raw control characters printed: {found}"


def test_agentfold_transcript_prints_control_characters_escaped_and_json_unchanged(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'transcripts.db'}"
    store = TranscriptStore(db)
    try:
        report = store.apply(_envelopes())
        assert (report.applied, report.entries) == (5, 4)
    finally:
        store.close()
    shown = subprocess.run([*AGENTFOLD, "transcript", PID, "--db", db], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    _no_raw_controls(shown.stdout)
    escaped = "\\u001b[2J\\u001b]0;PWNED\\u0007\\u009b31mred\\u007f"
    lines = shown.stdout.splitlines()
    assert lines[1] == f"  1 [user{escaped}] hello {escaped}"
    assert lines[2] == f"  2 [steering] {escaped}...window seat please"
    assert lines[3] == f"  3 [assistant #1] answer {escaped}"
    assert lines[4].startswith(f"      -> look{escaped}(")
    assert lines[5] == f"  4 [failed] failed{escaped} error{escaped} why {escaped}"
    as_json = subprocess.run([*AGENTFOLD, "transcript", PID, "--db", db, "--json"], cwd=ROOT, capture_output=True, text=True)
    assert as_json.returncode == 0, as_json.stderr
    entries = json.loads(as_json.stdout)["entries"]
    assert entries[1]["text"] == ATTACK + "...window seat please"  # the data itself is kept as it came


def test_every_printed_field_is_escaped() -> None:
    bad = "x\u001b]0;T\u0007\u0085"
    entries = [
        {"seq": 1, "kind": "tool_result", "tool_name": bad, "disposition": bad, "status": "completed", "text": bad,
         "tool_call_ref": bad},
        {"seq": 2, "kind": "input_prompt", "prompt": bad, "tool_call_ref": bad},
        {"seq": 3, "kind": "delegate_start", "started": True, "child_process_id": bad, "delegate_name": bad},
        {"seq": 4, "kind": "unknown_resolved", "effect_kind": bad, "status": bad, "resolved_by": bad},
        {"seq": 5, "kind": bad},
    ]
    text = transcript_text({"process_id": bad, "tree_id": bad, "status": bad, "entry_count": 5,
                            "tool_call_ref": bad, "entries": entries})
    _no_raw_controls(text)
    assert len(text.splitlines()) == 7
    assert "x\\u001b]0;T\\u0007\\u0085" in text.splitlines()[0]


SECRET = "S3cr3t"


@pytest.mark.parametrize(
    "db",
    [
        f"mysql://alice:{SECRET}@h/db",
        f"MYSQL://alice@h/db?password={SECRET}",
        f"postgresql://alice:{SECRET}@[bad/db",
        f"postgresql://alice:{SECRET}@h:1/db?bogus=1",
        f"postgresql://alice:{SECRET}@h:99999/db",  # was transcripts.unavailable (exit 1) after a connect attempt
    ],
)
@pytest.mark.parametrize("command", ["transcript", "transcripts"])
def test_an_invalid_db_url_is_refused_without_its_password(tmp_path: Path, db: str, command: str) -> None:
    args = ["transcript", "process:ab"] if command == "transcript" else [
        "transcripts", "--bootstrap", "127.0.0.1:1", "--topic", "t", "--group", "g"]
    ran = subprocess.run([*AGENTFOLD, *args, "--db", db, "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 2, ran.stderr
    assert SECRET not in ran.stderr + ran.stdout
    error = json.loads(ran.stderr)["error"]
    assert error["code"] == "transcripts.url_invalid" and error["hint"], error
    assert "***" in error["message"]


def test_an_unreachable_db_is_unavailable_with_a_hint_and_without_its_password(tmp_path: Path) -> None:
    not_a_db = tmp_path / "garbage.db"
    not_a_db.write_bytes(b"this is not an SQLite database" * 100)
    for db in (f"postgresql://alice@127.0.0.1:1/db?password={SECRET}", f"postgresql://alice:{SECRET}@127.0.0.1:1/db",
               f"sqlite:///{not_a_db}"):
        ran = subprocess.run([*AGENTFOLD, "transcript", "process:ab", "--db", db, "--json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 1, ran.stderr
        assert SECRET not in ran.stderr + ran.stdout
        error = json.loads(ran.stderr)["error"]
        assert error["code"] == "transcripts.unavailable", error
        assert error["hint"].startswith("check --db"), error


def test_a_new_sqlite_transcript_database_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    # Found by a review: the store was made 0600 ("it holds every conversation") but the
    # transcript database, which holds the same conversations, stayed 0644.
    old = os.umask(0o022)
    try:
        TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "transcripts.db").stat().st_mode) == 0o600


def test_a_db_url_scheme_in_capitals_names_the_same_database(tmp_path: Path) -> None:
    # Found by a review: `--store SQLite:///...` was accepted, `--db SQLite:///...` refused.
    TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}").close()
    again = TranscriptStore(f"SQLite:///{tmp_path / 'transcripts.db'}", create=False)
    try:
        assert again.backend == "sqlite" and again.transcripts(None) == {}
    finally:
        again.close()
