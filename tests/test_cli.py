"""The ``agentfold`` CLI, run as a real subprocess against real stores (docs/cli.md).

Every test drives the command line the way an operator does: a child process runs the
console script's ``entry()`` (forked from a launcher that imported agentfold once,
tests/forked_cli.py; some tests run the installed console script itself) on an SQLite file
(and, for the main flow, on PostgreSQL too). Crashes are real process deaths
(``os._exit(75)`` inside the charge dispatch); external calls are counted in the demo
program's side-effect log, outside the processes that made them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.kernel_demo import charge_id_for, payment_program, read_log
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import Settlement
from tests import forked_cli
from tests.kernel_programs import asker_program, chain_program

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def error(self) -> dict[str, Any]:
        """The one-line JSON error a ``--json`` command writes to stderr."""
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, self.stderr
        return json.loads(lines[0])["error"]  # type: ignore[no-any-return]


def agentfold(*args: str, store: str | None = None, cwd: Path | None = None,
              env: dict[str, str] | None = None, timeout: float = 120) -> Ran:
    """Run ``agentfold ARGS [--store STORE]`` in a child process (forked: tests/forked_cli.py)."""
    child_env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    child_env["PYTHONPATH"] = str(ROOT)
    child_env.update(env or {})
    argv = [*args, *(["--store", store] if store is not None else [])]
    proc = forked_cli.run(argv, env=child_env, cwd=cwd or ROOT, timeout=timeout)
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def ok(ran: Ran) -> Ran:
    assert ran.code == 0, f"exit {ran.code}\nstdout: {ran.stdout}\nstderr: {ran.stderr}"
    return ran


def refused(ran: Ran) -> Ran:
    """Exit status 2 with exactly one line on stderr."""
    assert ran.code == 2, f"exit {ran.code}\nstdout: {ran.stdout}\nstderr: {ran.stderr}"
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert ran.stdout == ""
    return ran


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'agentfold.db'}"


def count(log: Path, action: str) -> int:
    return sum(1 for line in read_log(log) if line["action"] == action)


def start_crashing_run(store: str, log: Path, start_id: str = "order-1", point: str = "in-dispatch:1") -> None:
    ran = agentfold("kernel-demo-run", "--start-id", start_id, "--side-effect-log", str(log),
                    "--crash-after", point, store=store)
    assert ran.code == 75, f"expected the crash exit status 75, got {ran.code}: {ran.stderr}"


def store_version(store: str, tree_id: str) -> tuple[int, int]:
    """(index head version, number of stored events) of one tree."""
    events = EventStore(store)
    try:
        head = events.head(TreeID(tree_id))
        assert head is not None
        return head.version, len(events.read_raw(TreeID(tree_id)))
    finally:
        events.close()


# ---------------------------------------------------------------------------
# The main flow: crash inside the charge, recover, list the unknown, resolve, complete


def test_crash_inside_the_charge_recovers_to_an_unknown_that_a_host_resolves(
    durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(store, log)
    assert count(log, "charge") == 1  # the side effect happened before the crash

    trees = ok(agentfold("trees", "--json", store=store)).json()["trees"]
    assert len(trees) == 1
    tree_id = trees[0]["tree_id"]
    assert trees[0]["start_id"] == "order-1"
    assert trees[0]["program"] == "demo.payment"
    assert trees[0]["status"] == "running"
    assert trees[0]["unknown_effect_ids"] == []
    # Before recovery the charge is in flight, not unknown: nothing waits for a host yet.
    assert ok(agentfold("unknown", "--json", store=store)).json() == {"unknown_effects": []}

    recovered = ok(agentfold("recover", "--json", store=store)).json()["trees"]
    assert len(recovered) == 1
    entry = recovered[0]
    assert entry["outcome"] == "recovered"
    assert entry["tree_id"] == tree_id
    assert entry["status"] == "running"
    assert entry["classification"] == "parked"
    assert len(entry["unknown_effect_ids"]) == 1
    effect_id = entry["unknown_effect_ids"][0]
    assert count(log, "charge") == 1  # recovery called nothing

    unknown = ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]
    assert len(unknown) == 1
    u = unknown[0]
    assert u["effect_id"] == effect_id
    assert u["tree_id"] == tree_id
    assert u["start_id"] == "order-1"
    assert u["process_id"] == entry["root_process_id"]
    assert (u["step"], u["index"], u["replay"], u["attempts"]) == (1, 0, "never", 1)
    assert u["payload"]["action"] == "charge"
    assert u["payload"]["amount_cents"] == 1250
    assert u["diagnostic"]["code"] == "engine.dispatch.interrupted"
    assert u["diagnostic"]["kind"] == "external"
    human = ok(agentfold("unknown", store=store)).stdout
    assert effect_id in human and "engine.dispatch.interrupted" in human

    charge = next(line for line in read_log(log) if line["action"] == "charge")
    assert charge["effect_id"] == effect_id
    # What the host looks up at the provider: the charge id derived from the unknown Effect's id.
    assert charge["charge_id"] == charge_id_for(effect_id)
    receipt = {"charge_id": charge["charge_id"], "customer": "ada", "amount_cents": 1250}
    resolved = ok(agentfold("resolve", effect_id, "--output", json.dumps(receipt), "--json", store=store)).json()
    assert resolved["effect_id"] == effect_id
    assert resolved["process_id"] == entry["root_process_id"]
    assert resolved["resolution"] == {"status": "succeeded", "payload": receipt}
    assert resolved["driven"] is True
    assert resolved["tree"]["status"] == "completed"
    assert resolved["tree"]["classification"] == "terminal"
    assert resolved["tree"]["unknown_effect_ids"] == []

    assert count(log, "charge") == 1  # exactly once, across the crash
    assert count(log, "send_receipt") == 1
    shown = ok(agentfold("show", "order-1", "--json", store=store)).json()
    root = shown["processes"][0]
    assert root["status"] == "completed"
    assert root["output"]["charge"] == receipt
    assert root["output"]["receipt_sent"] is True
    assert root["termination"]["cause"] == "completion"
    assert len(shown["incarnations"]) == 3  # the crashed writer, `recover`, `resolve`
    assert ok(agentfold("unknown", "--json", store=store)).json() == {"unknown_effects": []}
    assert ok(agentfold("recover", "--json", store=store)).json() == {"trees": []}


def test_the_payment_demo_charges_the_customer_and_amount_it_was_given(tmp_path: Path) -> None:
    log = tmp_path / "side-effects.jsonl"
    ran = agentfold("kernel-demo-run", "--start-id", "order-bob", "--side-effect-log", str(log), "--customer", "bob",
                    "--amount-cents", "999", "--crash-after", "in-dispatch:1", store=sqlite_url(tmp_path))
    assert ran.code == 75, ran.stderr
    [charge] = [line for line in read_log(log) if line["action"] == "charge"]
    assert (charge["customer"], charge["amount_cents"]) == ("bob", 999)
    assert charge["charge_id"] == charge_id_for(charge["effect_id"])


def test_a_same_identity_effect_interrupted_by_a_crash_is_dispatched_again_not_left_unknown(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(store, log, point="in-dispatch:2")  # inside send_receipt
    assert (count(log, "charge"), count(log, "send_receipt")) == (1, 1)

    recovered = ok(agentfold("recover", "--json", store=store)).json()["trees"]
    assert [(t["status"], t["unknown_effect_ids"]) for t in recovered] == [("completed", [])]
    # Re-dispatched under the same effect id; the mailer deduplicates by message id.
    assert (count(log, "charge"), count(log, "send_receipt")) == (1, 1)


def test_resolving_as_failed_fails_the_run_with_the_programs_own_code(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(store, log)
    effect_id = ok(agentfold("recover", "--json", store=store)).json()["trees"][0]["unknown_effect_ids"][0]

    ran = ok(agentfold("resolve", effect_id, "--status", "failed", "--output", '{"declined": true}', store=store))
    assert f"resolved {effect_id} as failed" in ran.stdout
    root = ok(agentfold("show", "order-1", "--json", store=store)).json()["processes"][0]
    assert root["status"] == "failed"
    assert root["termination"]["failure"]["code"] == "demo.payment.charge_failed"
    assert count(log, "send_receipt") == 0


# ---------------------------------------------------------------------------
# Refused input: exit 2, one line, and nothing appended


def test_refused_resolutions_exit_2_and_leave_the_store_unchanged(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(store, log)
    entry = ok(agentfold("recover", "--json", store=store)).json()["trees"][0]
    tree_id, effect_id = entry["tree_id"], entry["unknown_effect_ids"][0]
    before = store_version(store, tree_id)

    assert refused(agentfold("resolve", "not an id!", "--output", "{}", "--json", store=store)).error()["code"] == (
        "identity.invalid"
    )
    assert refused(agentfold("resolve", effect_id, "--output", '{"charge_id": ', "--json", store=store)).error()[
        "code"
    ] == "payload.invalid"
    assert refused(agentfold("resolve", "effect:does-not-exist", "--output", "{}", "--json", store=store)).error()[
        "code"
    ] == "identity.invalid"
    assert refused(agentfold("resolve", "effect:" + "0" * 64, "--output", "{}", "--json", store=store)).error()[
        "code"
    ] == "engine.effect.not_pending"
    assert refused(agentfold("resolve", effect_id, "--output", "{}", "--status", "unknown", store=store)).stderr.startswith(
        "agentfold: error: cli.usage:"
    )
    assert refused(agentfold("resolve", effect_id, store=store)).stderr.startswith("agentfold: error: cli.usage:")
    assert store_version(store, tree_id) == before
    assert [u["effect_id"] for u in ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]] == [
        effect_id
    ]

    ok(agentfold("resolve", effect_id, "--output", "{}", store=store))
    after = store_version(store, tree_id)
    # The same effect again: it is no longer unknown.
    again = refused(agentfold("resolve", effect_id, "--output", "{}", store=store))
    assert again.stderr.startswith("agentfold: error: engine.effect.not_pending:")
    assert store_version(store, tree_id) == after


def test_an_unknown_left_by_a_canceled_process_cannot_be_resolved_and_nothing_is_appended(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    start_crashing_run(store, tmp_path / "side-effects.jsonl")
    entry = ok(agentfold("recover", "--json", store=store)).json()["trees"][0]
    tree_id, effect_id = entry["tree_id"], entry["unknown_effect_ids"][0]
    events = EventStore(store)
    with Runtime(events, Catalog([payment_program()]), poll_interval=0) as runtime:
        runtime.cancel(entry["root_process_id"], "the customer called off the order")
        runtime.wait_idle(TreeID(tree_id))
    events.close()
    shown = ok(agentfold("show", tree_id, "--json", store=store)).json()
    assert shown["processes"][0]["termination"]["unresolved_effect_ids"] == [effect_id]
    before = store_version(store, tree_id)

    error = refused(agentfold("resolve", effect_id, "--output", "{}", "--json", store=store)).error()
    assert error["code"] == "engine.process.finished"
    # Not even an ownership change (WriterActivated) was appended.
    assert store_version(store, tree_id) == before
    # A terminal process's unknowns are evidence, not work: `unknown` does not list them.
    assert ok(agentfold("unknown", "--json", store=store)).json() == {"unknown_effects": []}


def test_usage_errors_exit_2_with_one_line_in_text_or_json(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    assert refused(agentfold()).stderr.startswith("agentfold: error: cli.usage:")
    assert refused(agentfold("frobnicate", store=store)).stderr.startswith("agentfold: error: cli.usage:")
    assert refused(agentfold("show", "--json", store=store)).error()["code"] == "cli.usage"
    assert refused(agentfold("kernel-demo-run", "--side-effect-log", "x", "--crash-after", "sometime",
                             store=store)).stderr.startswith("agentfold: error: crash.point_invalid:")
    assert refused(agentfold("trees", store="ftp://example")).stderr.startswith("agentfold: error: store.url_invalid:")
    # An option the command does not take names the command's own help (it named `agentfold --help`).
    error = refused(agentfold("recover", "--crash-after", "x", "--json", store=store)).error()
    assert error == {"code": "cli.usage", "message": "unrecognized arguments: --crash-after x",
                     "hint": "see `agentfold recover --help`"}, error


def test_commands_refuse_an_sqlite_store_that_does_not_exist_without_creating_it(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    for command in (["trees"], ["show", "order-1"], ["unknown"], ["recover"], ["resolve", "effect:" + "0" * 64, "--output", "{}"]):
        ran = refused(agentfold(*command, "--json", store=store))
        assert ran.error()["code"] == "store.not_found"
    assert not (tmp_path / "agentfold.db").exists()


def test_show_refuses_invalid_and_unknown_tree_references(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    ok(agentfold("kernel-demo-run", "--start-id", "order-1", "--side-effect-log", str(tmp_path / "l"), store=store))
    assert refused(agentfold("show", "tree:not-hex", "--json", store=store)).error()["code"] == "identity.invalid"
    assert refused(agentfold("show", "tree:" + "0" * 32, "--json", store=store)).error()["code"] == (
        "engine.tree.not_found"
    )
    assert refused(agentfold("show", "order-2", "--json", store=store)).error()["code"] == "engine.tree.not_found"
    assert refused(agentfold("show", "has space", store=store)).stderr.startswith("agentfold: error: identity.invalid:")


def test_a_store_that_fails_exits_1(tmp_path: Path) -> None:
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"this is not an sqlite database" * 100)
    ran = agentfold("trees", store=f"sqlite:///{broken}")
    assert ran.code == 1
    assert len(ran.stderr.strip().splitlines()) == 1
    assert ran.stderr.startswith("agentfold: error:")
    # Commands that create a store classify it the same way (they once said cli.internal)
    demo = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")
    for command in (["trees"], ["run", demo], ["kernel-demo-run", "--side-effect-log", str(tmp_path / "log")]):
        failed = agentfold(*command, "--json", store=f"sqlite:///{broken}")
        assert failed.code == 1, failed.stderr
        assert failed.error()["code"] == "store.damaged"
        assert "is not an SQLite database" in failed.error()["message"]
        assert "names the store's file" in failed.error()["hint"]
    assert broken.read_bytes() == b"this is not an sqlite database" * 100


def test_an_sqlite_file_with_damaged_pages_is_store_damaged_with_what_to_do(tmp_path: Path) -> None:
    # A file damaged below the history (a disk fault, a bad copy): SQLite's "database disk image
    # is malformed" used to be store.unavailable with "check that the store is reachable and writable".
    db = tmp_path / "store.db"
    store = f"sqlite:///{db}"
    ok(agentfold("run", str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"), store=store))
    data = bytearray(db.read_bytes())
    for page in range(1, len(data) // 4096):  # every b-tree page after the first: a wrong cell count
        data[page * 4096 + 3 : page * 4096 + 5] = b"\xff\xff"
    db.write_bytes(bytes(data))
    for command in (["trees"], ["show", "demo"], ["audit", "verify", "--all"], ["unknown"]):
        failed = agentfold(*command, "--json", store=store)
        assert failed.code == 1, failed.stderr
        error = failed.error()
        assert error["code"] == "store.damaged", error
        assert "malformed" in error["message"] and ".recover" in error["hint"]


def test_damage_met_while_reading_a_tree_is_store_damaged_with_what_to_do(tmp_path: Path) -> None:
    # Only the events table is damaged (its root page): the tree index still answers, and the
    # damage is met while a tree's events are read. That read said store.read_failed, without
    # what to do (a review found no test reached it: the test above damages every page).
    import sqlite3

    db = tmp_path / "store.db"
    store = f"sqlite:///{db}"
    ok(agentfold("run", str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"), "--start-id", "demo", store=store))
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the main file
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'agentfold_events'").fetchone()
    data = bytearray(db.read_bytes())
    data[(root - 1) * 4096 + 3 : (root - 1) * 4096 + 5] = b"\xff\xff"  # an impossible cell count
    db.write_bytes(bytes(data))
    assert [t["start_id"] for t in ok(agentfold("trees", "--json", store=store)).json()["trees"]] == ["demo"]
    for command in (["show", "demo"], ["audit", "verify", "demo"]):
        failed = agentfold(*command, "--json", store=store)
        assert failed.code == 1, failed.stderr
        error = failed.error()
        assert error["code"] == "store.damaged", (command, error)
        assert "malformed" in error["message"] and ".recover" in error["hint"]


def test_a_timeout_out_of_range_is_refused_before_anything_is_stored(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    demo = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")
    for timeout in ("-1", "nan", "inf", "2592001"):
        assert refused(agentfold("run", demo, "--timeout", timeout, "--json", store=store)).error()["code"] == "cli.usage"
        assert refused(agentfold("recover", "--timeout", timeout, store=store)).stderr.startswith(
            "agentfold: error: cli.usage: argument --timeout:")
    assert not (tmp_path / "agentfold.db").exists()


# ---------------------------------------------------------------------------
# trees, show, recover: text and JSON


def test_trees_lists_the_index_in_text_and_json(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    done = ok(agentfold("kernel-demo-run", "--start-id", "order-1", "--side-effect-log", str(tmp_path / "l"),
                        "--json", store=store)).json()
    assert done["status"] == "completed" and done["classification"] == "terminal"
    start_crashing_run(store, tmp_path / "l2", start_id="order-2")

    trees = ok(agentfold("trees", "--json", store=store)).json()["trees"]
    assert [t["start_id"] for t in trees] == ["order-1", "order-2"]
    first = trees[0]
    assert set(first) == {
        "tree_id", "start_id", "root_process_id", "program", "status", "classification", "version",
        "head_digest", "unknown_effect_ids", "created_at", "updated_at",
    }
    assert first["tree_id"] == done["tree_id"] and first["status"] == "completed"
    assert first["version"] == done["version"]
    assert first["head_digest"].startswith("sha256:")
    live = ok(agentfold("trees", "--live", "--json", store=store)).json()["trees"]
    assert [t["start_id"] for t in live] == ["order-2"]

    text = ok(agentfold("trees", store=store)).stdout
    assert text.splitlines()[0].split()[:3] == ["TREE", "START", "PROGRAM"]
    assert done["tree_id"] in text and "order-2" in text and "completed" in text


def test_show_accepts_a_tree_id_a_start_id_or_a_process_id(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    done = ok(agentfold("kernel-demo-run", "--start-id", "order-1", "--side-effect-log", str(tmp_path / "l"),
                        "--json", store=store)).json()
    by_start = ok(agentfold("show", "order-1", "--json", store=store)).json()
    assert ok(agentfold("show", done["tree_id"], "--json", store=store)).json() == by_start
    assert ok(agentfold("show", done["root_process_id"], "--json", store=store)).json() == by_start

    assert by_start["tree_id"] == done["tree_id"]
    assert by_start["start_id"] == "order-1"
    assert by_start["classification"] == "terminal"
    assert by_start["version"] == done["version"]
    root = by_start["processes"][0]
    assert root["process_id"] == done["root_process_id"]
    assert root["program"]["name"] == "demo.payment"
    assert root["usage"] == {"steps": 3, "effects": 2, "signals": 2}
    assert root["state"]["phase"] == "done"  # the CLI binds demo.payment, so the strategy state is shown
    # Both settlement signals were consumed; consumed engine signals are counted, not kept.
    assert root["mailbox"]["signals"] == [] and root["mailbox"]["arrivals"] == 2

    text = ok(agentfold("show", "order-1", store=store)).stdout
    assert f"process {done['root_process_id']}  demo.payment  completed" in text
    assert "termination: completed (completion)" in text


def test_show_of_a_parked_run_lists_the_unknown_effect_and_its_diagnostic(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    start_crashing_run(store, tmp_path / "l")
    effect_id = ok(agentfold("recover", "--json", store=store)).json()["trees"][0]["unknown_effect_ids"][0]
    root = ok(agentfold("show", "order-1", "--json", store=store)).json()["processes"][0]
    assert root["status"] == "running"
    assert root["prepared"]["step"] == 1
    [record] = root["prepared"]["effects"]
    assert record["effect_id"] == effect_id
    assert (record["phase"], record["status"], record["replay"]) == ("settled", "unknown", "never")
    assert record["diagnostic"]["code"] == "engine.dispatch.interrupted"
    text = ok(agentfold("show", "order-1", store=store)).stdout
    assert f"#0 {effect_id}  dispatcher  replay never  settled unknown" in text


def test_recover_skips_a_tree_another_runtime_owns_and_leaves_a_parked_one_it_cannot_bind(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    events = EventStore(store)
    asker = asker_program()
    # A tree whose program the CLI does not bind, left parked by a runtime that is gone: with
    # nothing in flight there is nothing to recover, bound or not (test_recover_unbound_parked.py
    # has one with a call in flight, which fails).
    with Runtime(events, Catalog([asker]), poll_interval=0) as runtime:
        orphan = runtime.start(asker, None, start_id="asker-orphan")
        runtime.wait_idle(orphan.tree_id)
    # A tree with a call in flight in a live runtime: it needs recovery, and another owns it.
    release = threading.Event()

    def held(request: Any, context: Any) -> Settlement:
        release.wait(60)
        return Settlement.succeeded({"value": 1})

    chain = chain_program(held)
    owner = Runtime(events, Catalog([chain]), poll_interval=0)
    try:
        owned = owner.start(chain, {"n": 1}, start_id="chain-owned")
        before = store_version(store, owned.tree_id)
        ran = agentfold("recover", "--json", store=store)
        assert ran.code == 0, ran.stderr
        entries = {e["start_id"]: e for e in ran.json()["trees"]}
        assert entries["chain-owned"]["outcome"] == "owned"
        assert entries["asker-orphan"]["outcome"] == "parked"
        assert store_version(store, owned.tree_id) == before
        text = agentfold("recover", store=store).stdout
        assert "skipped " + owned.tree_id in text and "left " + orphan.tree_id in text
        release.set()
        assert owned.result(60).status == "completed"
    finally:
        release.set()
        owner.close()
        events.close()
    # `show` needs no program: the kernel's fold alone describes the tree.
    shown = ok(agentfold("show", "asker-orphan", "--json", store=store)).json()
    assert shown["processes"][0]["status"] == "waiting"
    assert "state" not in shown["processes"][0]


# ---------------------------------------------------------------------------
# Store selection and entry points


def test_the_store_comes_from_the_option_then_the_environment_then_the_default(tmp_path: Path) -> None:
    here = tmp_path / "work"
    here.mkdir()
    other = tmp_path / "other.db"
    ok(agentfold("kernel-demo-run", "--start-id", "in-default", "--side-effect-log", "l", cwd=here))
    assert (here / "agentfold.db").exists()  # sqlite:///./agentfold.db
    ok(agentfold("kernel-demo-run", "--start-id", "in-env", "--side-effect-log", "l", cwd=here,
                 env={"AGENTFOLD_STORE": f"sqlite:///{other}"}))

    def starts(*args: str, env: dict[str, str] | None = None) -> list[str]:
        return [t["start_id"] for t in ok(agentfold("trees", "--json", *args, cwd=here, env=env)).json()["trees"]]

    assert starts() == ["in-default"]
    assert starts(env={"AGENTFOLD_STORE": f"sqlite:///{other}"}) == ["in-env"]
    # --store wins over the environment, before or after the command.
    assert starts("--store", "sqlite:///./agentfold.db", env={"AGENTFOLD_STORE": f"sqlite:///{other}"}) == [
        "in-default"
    ]
    before = ok(agentfold("--store", f"sqlite:///{other}", "--json", "trees", cwd=here)).json()["trees"]
    assert [t["start_id"] for t in before] == ["in-env"]


def test_help_and_the_installed_console_script(tmp_path: Path) -> None:
    ran = ok(agentfold("--help"))
    for command in ("trees", "show", "unknown", "resolve", "recover"):
        assert command in ran.stdout
    script = Path(sys.executable).parent / "agentfold"
    assert script.exists(), "pip install -e . installs the agentfold console script"
    proc = subprocess.run([str(script), "trees", "--json", "--store", sqlite_url(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "store.not_found" in proc.stderr


@pytest.mark.slow
def test_scripts_kernel_demo_runs_the_kernel_story_end_to_end() -> None:
    proc = subprocess.run([str(ROOT / "scripts" / "kernel-demo")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "charges in the ledger: 1" in proc.stdout
    assert "receipts sent: 1" in proc.stdout
    assert "run: completed" in proc.stdout
    assert proc.stdout.rstrip().endswith("scripts/kernel-demo: OK")


def test_scripts_demo_runs_the_main_job_end_to_end(tmp_path: Path) -> None:
    """README's first command: `agentfold demo` on a temporary SQLite store, no services."""
    # The demo keeps its folder for the user to inspect: here it goes under tmp_path.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([str(ROOT / "scripts" / "demo")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "the process died with exit status 75; the outside world saw 1 booking(s)" in out
    assert "engine.dispatch.interrupted" in out
    assert "exit status 2: agentfold: error: engine.signal.schema" in out
    assert "the run is completed after 3 model calls" in out
    assert "the hotel was booked 1 time(s)" in out
    [folder] = [p for p in tmp_path.iterdir() if p.name.startswith("agentfold-demo-")]
    assert f"Inspect the history: agentfold --store sqlite:///{folder / 'demo.db'} show demo-trip" in out


def test_hostile_arguments_are_refused_with_exit_2_and_append_nothing(tmp_path: Path) -> None:
    """Bytes that are not UTF-8, integers beyond 64 bits (which JSON parsers turn into
    floats), JSON nested deeper than 128 levels, a reason above 4096 bytes, counts and
    positions beyond what a database holds: each once failed as cli.internal, or was stored
    changed (an integer as a float, a reason cut to 4096 bytes)."""
    store = sqlite_url(tmp_path)
    log = tmp_path / "log"
    start_crashing_run(store, log)
    ok(agentfold("recover", store=store))
    [unknown] = ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]
    tree_id, effect_id, process_id = unknown["tree_id"], unknown["effect_id"], unknown["process_id"]
    before = store_version(store, tree_id)

    def refused_with(code: str, *args: str) -> str:
        error = refused(agentfold(*args, "--json", store=store)).error()
        assert error["code"] == code, error
        return str(error["message"])

    assert "is not valid UTF-8" in refused_with("cli.argument_invalid", "show", "order\udcff")  # the byte 0xff
    assert "is not valid UTF-8" in refused_with("cli.argument_invalid", "resolve", effect_id, "--output", '"\udcff"')
    assert "exceeds 64 bits" in refused_with("payload.invalid", "resolve", effect_id, "--output",
                                             '{"charge_id": 100000000000000000000000000000}')
    assert "nested deeper than 128 levels" in refused_with("payload.invalid", "resolve", effect_id, "--output",
                                                           "[" * 1000 + "]" * 1000)
    assert "at most 4096 bytes" in refused_with("control.invalid", "cancel", process_id, "--reason", "r" * 4097)
    assert "1000000" in refused_with("cli.usage", "project", "--batch", "9" * 30)
    assert "beyond any position" in refused_with("cli.usage", "replay", tree_id, "--at", "9" * 30)
    assert store_version(store, tree_id) == before


def test_empty_or_misplaced_values_are_refused_not_guessed(tmp_path: Path) -> None:
    """An empty --store (an unset shell variable) once meant the default store in the current
    directory; an empty --signal-id a fresh one; an empty --crash-after no crash; a store URL
    naming a directory said "disk I/O error" (exit 1)."""
    store = sqlite_url(tmp_path)
    demo = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")
    assert refused(agentfold("run", demo, "--json", store="", cwd=tmp_path)).error()["code"] == "store.url_invalid"
    assert not (tmp_path / "agentfold.db").exists()
    # The same mistake in the environment (AGENTFOLD_STORE=$UNSET_VAR): it ran on ./agentfold.db.
    for empty, said in (("", "AGENTFOLD_STORE is set but empty"), (" ", "AGENTFOLD_STORE is set but blank")):
        error = refused(agentfold("run", demo, "--json", env={"AGENTFOLD_STORE": empty}, cwd=tmp_path)).error()
        assert error["code"] == "store.url_invalid" and error["message"] == said, error
    assert not (tmp_path / "agentfold.db").exists()
    assert refused(agentfold("run", demo, "--crash-after", "", "--json", store=store)).error()["code"] == (
        "crash.point_invalid")
    assert refused(agentfold("run", demo, "--crash-after", "after::1", "--json", store=store)).error()["code"] == (
        "crash.point_invalid")
    folder = tmp_path / "a-folder"
    folder.mkdir()
    error = refused(agentfold("trees", "--json", store=f"sqlite:///{folder}")).error()
    assert error["code"] == "store.url_invalid" and "names a directory" in error["message"]
    started = ok(agentfold("run", demo, "--start-id", "s-1", "--json", store=store)).json()
    before = store_version(store, started["tree_id"])
    assert refused(agentfold("steer", started["root_process_id"], "hi", "--signal-id", "", "--json",
                             store=store)).error()["code"] == "identity.invalid"
    # Empty or blank steering reached the model as an empty user message.
    for blank in ("", "   "):
        error = refused(agentfold("steer", started["root_process_id"], blank, "--json", store=store)).error()
        assert error["code"] == "interaction.signal.invalid" and "no text" in error["message"], error
    # A run's start id where a process id is wanted: the message names it as text, not a Python repr.
    error = refused(agentfold("steer", "s-1", "hi", "--json", store=store)).error()
    assert error["code"] == "engine.process.not_found", error
    assert error["message"].startswith("'s-1' names the run tree:"), error
    # A wait id the kernel cannot have made is refused as an invalid id, not looked up.
    error = refused(agentfold("answer", started["root_process_id"], "wait:abc", "{}", "--json", store=store)).error()
    assert error["code"] == "identity.invalid" and "wait:abc" in error["message"], error
    assert refused(agentfold("export", "s-1", "--out", "", store=store)).stderr.startswith("agentfold: error: cli.usage:")
    assert store_version(store, started["tree_id"]) == before


@pytest.mark.parametrize("argv", [
    ("trees",), ("trees", "--json"), ("audit", "verify", "--all", "--json"),
    # Found by a review: export gave export.unwritable "Broken pipe" (exit 2), and commands
    # that print as they go (the demo, project --follow, serve) cli.internal, then a traceback
    # and exit 120 under PYTHONUNBUFFERED.
    ("export", "pipe-1", "--out", "/dev/stdout"), ("project", "--follow"),
])
def test_a_reader_that_goes_away_stops_the_command_quietly_as_sigpipe_would(tmp_path: Path, argv: tuple[str, ...]) -> None:
    # Found by a security review: `agentfold audit verify --all --json | head` printed a
    # BrokenPipeError traceback (exit 1).
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    ok(agentfold("kernel-demo-run", "--start-id", "pipe-1", "--side-effect-log", str(tmp_path / "calls.jsonl"),
                 store=store))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
        env["PYTHONPATH"] = str(ROOT)
        ran = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", *argv, "--store", store],
                             stdout=write, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=120)
    finally:
        os.close(write)
    assert (ran.returncode, ran.stderr) == (141, "")


@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
@pytest.mark.parametrize("argv", [("export", "full-1"), ("audit", "verify", "--all", "--json"), ("trees",)])
def test_an_answer_that_cannot_be_written_to_stdout_is_one_classified_line(
    tmp_path: Path, argv: tuple[str, ...], unbuffered: bool
) -> None:
    """Found by an audit walkthrough: ``agentfold export T > FILE`` on a full disk (/dev/full
    here) printed a 15-line traceback and exited 120; now one line, cli.output_failed, exit 1."""
    if not Path("/dev/full").exists():
        pytest.fail("this test needs /dev/full (Linux)")
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    ok(agentfold("kernel-demo-run", "--start-id", "full-1", "--side-effect-log", str(tmp_path / "calls.jsonl"),
                 store=store))
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFOLD_STORE", "PYTHONUNBUFFERED")}
    env["PYTHONPATH"] = str(ROOT)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        ran = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", *argv, "--store", store],
                             stdout=full, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=120)
    [line] = ran.stderr.strip().splitlines()
    assert ran.returncode == 1, ran.stderr
    code = json.loads(line)["error"]["code"] if "--json" in argv else line.split(": ")[2]
    assert code == "cli.output_failed", line
    assert "No space left on device" in line


@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
def test_a_reader_that_leaves_mid_output_gets_exit_141_also_with_unbuffered_python(
    tmp_path: Path, unbuffered: bool
) -> None:
    # Found by the docs audit: with PYTHONUNBUFFERED=1 (common in containers) the text layer
    # dropped what a short write to the pipe did not take: `show --json | head` cut the output
    # silently and exited 0.
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    scenario = {
        "name": "big",
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [{"id": "a", "name": "t", "arguments": "{}"}]}},
            {"finish_reason": "stop", "message": {"content": "ok"}}]},
        "tools": [{"name": "t", "result": {"output": "x" * 600_000}}],
    }
    (tmp_path / "big.json").write_text(json.dumps(scenario))
    ok(agentfold("run", str(tmp_path / "big.json"), "--start-id", "big-1", store=store))
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFOLD_STORE", "PYTHONUNBUFFERED")}
    env["PYTHONPATH"] = str(ROOT)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "agentfold.adapters.cli", "show", "big-1", "--json", "--store", store],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b'{"classifi'
    proc.stdout.close()  # the reader leaves with more than a pipe's worth still to come
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""
    proc.stderr.close()


def test_refusals_found_by_the_error_code_audit_say_what_to_do(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "calls.jsonl"), "--start-id", "k", store=store))
    missing = refused(agentfold("show", "tree:" + "0" * 32, "--json", store=store)).error()
    assert missing["code"] == "engine.tree.not_found" and "agentfold trees" in missing["hint"], missing
    before = refused(agentfold("replay", "k", "--at", "0", "--json", store=store)).error()
    assert before["code"] == "audit.position_out_of_range" and before["hint"], before
    # "@" alone named the current folder: "cannot read : Is a directory".
    empty = refused(agentfold("answer", "process:" + "0" * 32, "wait:" + "0" * 64, "@", "--json", store=store)).error()
    assert empty["code"] == "cli.argument_invalid" and "names no file" in empty["message"], empty


def test_version_prints_the_installed_version_and_exits_0() -> None:
    from importlib.metadata import version

    ran = ok(agentfold("--version"))
    assert ran.stdout == f"agentfold {version('agentfold')}\n" and ran.stderr == ""
