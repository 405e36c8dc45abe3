"""A CLI command on an SQLite store does not import psycopg (nor eventsourcing's PostgreSQL
module): about a tenth of a second of every command, measured at 0.07-0.1 s of the 0.35 s
that importing the CLI took. PostgreSQL's parts are imported when a PostgreSQL store is opened
(agentfold.adapters.recorders_postgres, ``interruptible_connection()``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
from agentfold.adapters.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": sorted(m for m in sys.modules
                  if m.split(".")[0] in ("psycopg", "psycopg_pool", "psycopg_binary") or m == "eventsourcing.postgres")}),
      file=sys.stderr)
"""


def run(*args: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    result: dict[str, object] = json.loads(proc.stderr.strip().splitlines()[-1])
    return result


def test_commands_on_an_sqlite_store_never_import_psycopg(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    started = run("--store", store, "kernel-demo-run", "--side-effect-log", str(tmp_path / "effects.log"))
    assert started["code"] in (0, None) and started["loaded"] == [], started
    for command in (["trees"], ["unknown", "--json"], ["audit", "verify", "--all"]):
        ran = run("--store", store, *command)
        assert ran["code"] in (0, 1, None) and ran["loaded"] == [], (command, ran)
