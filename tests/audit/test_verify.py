"""`agentfold audit verify` on real SQLite files and PostgreSQL databases tampered with plain SQL.

Each test records a real run, changes the store's tables directly (the sqlite3 module or
psycopg, no agentfold code), and asserts what verification reports: the exit status,
the tree, the position and the rule of the first error.

The recorded chain run (3 dispatcher effects) has 15 events in four appends:
1 TreeStarted, 2 StepCommitted, 3 EffectDeclared, 4 EffectDispatched | 5 EffectSettled,
6 StepCommitted, 7 EffectDeclared, 8 EffectDispatched | 9-12 likewise | 13 EffectSettled,
14 StepCommitted (complete), 15 ProcessTerminated.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson
import pytest

from agentfold.adapters import audit
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.read_models import CORRUPT, RUNS
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import EffectSettled, event_body
from agentfold.domain.ids import StartID, TreeID, effect_id
from agentfold.domain.integrity import chain_digest, content_bytes, seal
from tests.audit.support import Sql, chain_sources, cli, digest_of_state, record_chain
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold, ok

LAST = 15


@pytest.fixture
def chain(durable_store_url: str) -> tuple[str, TreeID]:
    return durable_store_url, record_chain(durable_store_url)


def verify(capsys: pytest.CaptureFixture[str], store: str, *trees: str) -> tuple[int, dict[str, Any]]:
    ran = cli(capsys, "audit", "verify", *(trees or ("--all",)), "--json", "--store", store, sources=chain_sources())
    return ran.code, ran.json()


def first_error(report: dict[str, Any]) -> tuple[str, int, str]:
    error = report["first_error"]
    return error["tree"], error["position"], error["rule"]


def test_an_untouched_history_verifies_with_every_check(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    code, report = verify(capsys, store)
    assert code == 0
    assert report["ok"] is True and report["first_error"] is None
    assert (report["trees"], report["events"]) == (1, LAST)
    (result,) = report["results"]
    assert result == {
        "tree": str(tree_id), "ok": True, "events": LAST, "programs_bound": True, "read_model": "absent", "problems": []
    }


def test_one_changed_byte_of_a_payload_breaks_the_digest_chain_at_its_position(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree_id = chain
    sql = Sql(store)
    state = sql.state(tree_id, 9)
    assert state.count(b'"value":1') == 1
    sql.set_row(tree_id, 9, "domain.events:EffectSettled", state.replace(b'"value":1', b'"value":7'))
    code, report = verify(capsys, store)
    assert code == 1 and report["ok"] is False
    assert first_error(report) == (str(tree_id), 9, "integrity.digest_chain")


def test_a_changed_byte_inside_a_compressed_state_is_reported_at_its_position(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    """States of 384 bytes or more are stored deflated (0x01 + raw DEFLATE); a byte changed in
    the compressed bytes either no longer inflates or inflates to other JSON: either way the
    event at that position is reported, and nothing before it."""
    store, tree_id = chain
    sql = Sql(store)
    compressed = [(v, t, s) for v, t, s in sql.raw_rows(tree_id) if s[:1] == b"\x01"]
    assert compressed
    position, topic, state = compressed[len(compressed) // 2]
    assert len(state) < len(sql.state(tree_id, position))  # it is stored smaller than its JSON
    damaged = state[:-3] + bytes([state[-3] ^ 0x55]) + state[-2:]
    sql.set_row(tree_id, position, topic, damaged)
    code, report = verify(capsys, store)
    assert code == 1
    tree, at, rule = first_error(report)
    assert (tree, at) == (str(tree_id), position)
    assert rule in ("integrity.format", "integrity.digest_chain")


def test_a_deleted_event_is_reported_missing_at_its_position(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    Sql(store).delete(tree_id, 7)
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), 7, "integrity.missing_event")


def test_two_swapped_events_break_the_chain_at_the_first_of_them(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    sql = Sql(store)
    rows = {v: (t, s) for v, t, s in sql.rows(tree_id)}
    sql.set_row(tree_id, 6, *rows[7])
    sql.set_row(tree_id, 7, *rows[6])
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), 6, "integrity.digest_chain")


def test_a_truncated_tail_no_longer_reaches_the_indexed_head(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    Sql(store).delete(tree_id, 14, 15)  # a whole Step: what is left is a valid, shorter history
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), 14, "index.head_mismatch")
    assert "version 15" in report["first_error"]["detail"]


def test_a_truncation_that_also_rewrites_the_index_still_leaves_a_step_unfinished(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree_id = chain
    sql = Sql(store)
    sql.delete(tree_id, 15)  # the complete Step stays, its ProcessTerminated is gone
    sql.set_head(tree_id, 14, digest_of_state(sql.state(tree_id, 14)))
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), 15, "step.sequence")


def _forged_settlement(sql: Sql, tree_id: TreeID, position: int) -> bytes:
    """A second settlement of the first effect, chained with the documented digest formula."""

    first = orjson.loads(sql.state(tree_id, 1))
    root = first["event"]["process_id"]
    event = EffectSettled(
        process_id=root, effect_id=effect_id(root, 1, 0), status="succeeded", payload={"value": 1000},
        attempt_id=orjson.loads(sql.state(tree_id, 4))["event"]["attempt_id"],
    )
    content = content_bytes(event_body(event), "2030-01-01T00:00:00.000000Z")
    previous = digest_of_state(sql.state(tree_id, position - 1))
    return seal(content, chain_digest(previous, str(tree_id), position, "EffectSettled", content))


def test_a_forged_settlement_with_a_valid_chain_and_index_breaks_a_fold_rule(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree_id = chain
    sql = Sql(store)
    forged = _forged_settlement(sql, tree_id, LAST + 1)
    sql.insert(tree_id, LAST + 1, "domain.events:EffectSettled", forged)
    sql.set_head(tree_id, LAST + 1, digest_of_state(forged))  # the forger keeps the index consistent too
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), LAST + 1, "settlement.once")


def test_a_settlement_inserted_without_rechaining_breaks_the_chain(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    sql = Sql(store)
    sql.insert(tree_id, LAST + 1, "domain.events:EffectSettled", sql.state(tree_id, 5))  # a copied settlement
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), LAST + 1, "integrity.digest_chain")


def test_an_index_row_that_disagrees_with_the_fold_is_reported(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    Sql(store)._run("UPDATE agentfold_trees SET status = 'running' WHERE tree_id = ?", (str(tree_id),))
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), LAST, "index.row_mismatch")
    assert "status" in report["first_error"]["detail"]


def test_index_values_no_writer_stores_are_findings_not_a_failed_command(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    # Found by an audit review: values edited by hand into the index tables stopped the whole
    # verification (cli.internal: a ValueError or a JSONDecodeError; identity.invalid, exit 2,
    # as if the user had typed a bad id) instead of being reported, and `--all` then checked
    # no other tree.
    store, tree_id = chain
    other = record_chain(store, n=1, start_id="audit-chain-2")
    sql = Sql(store)
    root = sql._run("SELECT root_process_id FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),))[0][0]
    cases: list[tuple[str, tuple[Any, ...], str, int, str]] = [
        ("UPDATE agentfold_trees SET unknown_effect_ids = 'not json' WHERE tree_id = ?", (str(tree_id),),
         "index.row_mismatch", LAST, "unknown_effect_ids"),
        ("UPDATE agentfold_processes SET tree_id = 'tree:zz' WHERE process_id = ?", (root,),
         "index.process_mismatch", LAST, "indexed under tree:zz"),
    ]
    if sql.sqlite:  # PostgreSQL's bigint column holds integers only
        cases += [
            ("UPDATE agentfold_trees SET version = 'abc' WHERE tree_id = ?", (str(tree_id),),
             "index.head_mismatch", LAST, "not a number"),
            (f"UPDATE agentfold_trees SET version = {LAST}.5 WHERE tree_id = ?", (str(tree_id),),
             "index.head_mismatch", LAST, "not a number"),  # int() would have read 15
        ]
    for statement, params, rule, position, words in cases:
        before = sql._run("SELECT * FROM agentfold_trees ORDER BY tree_id")
        processes = sql._run("SELECT * FROM agentfold_processes ORDER BY process_id")
        sql._run(statement, params)
        code, report = verify(capsys, store)
        assert code == 1, statement
        assert first_error(report) == (str(tree_id), position, rule), statement
        assert words in report["first_error"]["detail"], statement
        expected = {str(tree_id): False, str(other): True}
        if rule == "index.process_mismatch":  # and the rows under a tree the store does not have, on their own
            expected["tree:zz"] = False
        assert {r["tree"]: r["ok"] for r in report["results"]} == expected, statement
        sql._run("DELETE FROM agentfold_trees")
        sql._run("DELETE FROM agentfold_processes")
        for row in before:
            sql._run(f"INSERT INTO agentfold_trees VALUES ({','.join('?' * len(row))})", tuple(row))
        for row in processes:
            sql._run("INSERT INTO agentfold_processes VALUES (?, ?)", tuple(row))
        assert verify(capsys, store)[0] == 0, statement

    # An index row whose tree id is no tree id: a failing entry of its own; every tree is verified.
    sql._run("INSERT INTO agentfold_trees (tree_id, start_id, root_process_id, program, status, classification, "
             "version, head_digest, unknown_effect_ids, created_at, updated_at) "
             "VALUES ('tree:zz', 's', 'process:00', 'p', 'running', 'progress', 1, 'd', '[]', '0', '0')")
    code, report = verify(capsys, store)
    assert code == 1
    results = {r["tree"]: r for r in report["results"]}
    assert set(results) == {str(tree_id), str(other), "tree:zz"}
    assert results[str(tree_id)]["ok"] is True and results[str(other)]["ok"] is True
    (problem,) = results["tree:zz"]["problems"]
    assert (problem["position"], problem["rule"]) == (1, "index.row_mismatch")
    assert "'tree:zz' is not a tree id" in problem["detail"]


def test_process_rows_under_a_tree_the_store_does_not_have_are_a_failing_entry(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    # Left by an audit walkthrough: `agentfold_processes` rows naming a tree with no event and
    # no index row (a history and its row deleted by hand, its process rows left) passed
    # `audit verify --all`, while `show` of such a process id named a tree that is not there.
    store, tree_id = chain
    sql = Sql(store)
    ghost = str(TreeID.for_start(StartID("deleted-run")))
    sql._run("INSERT INTO agentfold_processes VALUES (?, ?)", ("process:" + "ab" * 16, ghost))
    sql._run("INSERT INTO agentfold_processes VALUES (?, ?)", ("process:" + "cd" * 16, ghost))
    code, report = verify(capsys, store)
    assert code == 1
    results = {r["tree"]: r for r in report["results"]}
    assert results[str(tree_id)]["ok"] is True and results[ghost]["ok"] is False
    (problem,) = results[ghost]["problems"]
    assert (problem["position"], problem["rule"]) == (1, "index.process_mismatch")
    assert "holds 2 row(s) under tree" in problem["detail"] and "process:" + "ab" * 16 in problem["detail"]
    assert verify(capsys, store, str(tree_id))[0] == 0  # a tree named on its own is whole
    sql._run("DELETE FROM agentfold_processes WHERE tree_id = ?", (ghost,))
    assert verify(capsys, store)[0] == 0


def test_a_tree_without_its_first_event_and_index_row_is_verified_not_unknown(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    # Found by an audit review: with position 1 and the index row deleted, `verify TREE` said
    # the tree did not exist (engine.tree.not_found, exit 2) while `verify --all` reported it.
    store, tree_id = chain
    sql = Sql(store)
    sql.delete(tree_id, 1)
    sql._run("DELETE FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),))
    for trees in ((str(tree_id),), ()):
        code, report = verify(capsys, store, *trees)
        assert code == 1, trees
        assert first_error(report) == (str(tree_id), 1, "integrity.missing_event"), trees


def test_only_the_broken_tree_fails_and_the_first_error_names_it(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree_id = chain
    other = record_chain(store, n=2, start_id="audit-chain-2")
    Sql(store).delete(other, 3)
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(other), 3, "integrity.missing_event")
    by_tree = {r["tree"]: r for r in report["results"]}
    assert by_tree[str(tree_id)]["ok"] is True and by_tree[str(other)]["ok"] is False
    # Naming the intact tree alone (by its start id) verifies it alone.
    code, report = verify(capsys, store, "audit-chain")
    assert code == 0 and report["trees"] == 1


def test_materialized_read_models_must_equal_the_pure_projections(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree_id = chain
    ok(agentfold("project", store=store))
    code, report = verify(capsys, store)
    assert code == 0 and report["results"][0]["read_model"] == "equal"
    sql = Sql(store)
    body = sql.body(RUNS, tree_id)
    body["status"] = "failed"
    sql.update_body(RUNS, tree_id, body)
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), LAST, "read_model.mismatch")
    assert ".run.status" in report["first_error"]["detail"]


@pytest.mark.parametrize("originator", ["zzz", None, "dashed"])
def test_event_rows_under_an_originator_id_no_writer_stores_are_a_failing_entry(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, originator: str | None
) -> None:
    """SQLite stores a tree's events under its uuid's 32 lowercase hex digits. Found by an audit
    walkthrough: a row under 'zzz' (or NULL) made `audit verify --all` fail as a whole
    (cli.internal "badly formed hexadecimal UUID string", no tree checked); copies of a tree's
    rows under the dashed spelling verified OK while the followers counted them into the tree."""
    store = f"sqlite:///{tmp_path / 'store.db'}"
    tree_id = record_chain(store)
    sql = Sql(store)
    foreign = str(tree_id.uuid) if originator == "dashed" else originator
    sql._run("INSERT INTO agentfold_events SELECT ?, originator_version, topic, state FROM agentfold_events "
             "WHERE originator_id = ?", (foreign, tree_id.uuid.hex))
    code, report = verify(capsys, store)
    assert code == 1, report
    by_tree = {r["tree"]: r for r in report["results"]}
    assert by_tree[str(tree_id)]["ok"] is True  # the tree itself still verifies
    name = "NULL" if foreign is None else foreign
    assert first_error(report) == (name, 1, "integrity.format"), report["first_error"]
    assert "not a tree id as agentfold stores one" in report["first_error"]["detail"]
    if originator == "dashed":
        return  # counted into the tree by the followers (left: docs/audit.md)
    # The followers and the listings stop on such a row with one classified line (they
    # failed with cli.internal "ValueError: badly formed hexadecimal UUID string").
    for argv in (("project",), ("unknown",), ("pending",)):
        ran = agentfold(*argv, store=store)
        assert ran.code == 1, (argv, ran.stdout, ran.stderr)
        [line] = ran.stderr.strip().splitlines()
        assert line.startswith("agentfold: error: store.corrupt: "), line
        assert f"names no tree: its originator_id {foreign!r} is not a tree id" in line, line
        assert "audit verify --all" in line, line


def test_a_corrupt_tree_record_of_a_tree_that_has_rows_and_verifies_is_a_mismatch(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    """Found by an audit walkthrough: a row in agentfold_rm_corrupt_trees naming a healthy tree
    that still has its rows made `unknown`/`pending` leave the tree out as corrupt and point
    at `audit verify TREE`, which said OK, read models equal."""
    store, tree_id = chain
    ok(agentfold("project", store=store))
    Sql(store)._run(
        f"INSERT INTO {CORRUPT} (tree_id, start_id, created_position, position, rule, detail, found_at, body) "
        f"SELECT tree_id, start_id, created_position, 3, 'integrity.digest_chain', 'bogus', created_position, '{{}}' "
        f"FROM {RUNS} WHERE tree_id = ?", (str(tree_id),))
    code, report = verify(capsys, store, str(tree_id))
    assert code == 1 and first_error(report) == (str(tree_id), LAST, "read_model.mismatch"), report["first_error"]
    assert "also record it corrupt at position 3 (integrity.digest_chain)" in report["first_error"]["detail"]
    ok(agentfold("project", "--rebuild", store=store))
    code, report = verify(capsys, store, str(tree_id))
    assert code == 0, report["first_error"]


def test_a_tree_with_orphan_read_model_rows_and_process_rows_is_one_failing_entry(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    # Left by the last notes: a tree the store does not have, with rows in the read models AND
    # in the process index, was two failing entries (the trees counted twice, the tree listed
    # twice in the results). It is one entry holding both findings.
    store, tree_id = chain
    ok(agentfold("project", store=store))
    sql = Sql(store)
    ghost = str(TreeID.for_start(StartID("deleted-run")))
    columns = ("start_id, root_process_id, program, status, classification, version, events_projected, "
               "created_position, position, unknown_count, pending_count, body")
    sql._run(f"INSERT INTO {RUNS} (tree_id, {columns}) SELECT ?, {columns} FROM {RUNS} WHERE tree_id = ?",
             (ghost, str(tree_id)))
    sql._run("INSERT INTO agentfold_processes VALUES (?, ?)", ("process:" + "ab" * 16, ghost))
    code, report = verify(capsys, store)
    assert code == 1
    assert [r["tree"] for r in report["results"]] == [str(tree_id), ghost]
    assert report["trees"] == 2, report
    entry = report["results"][1]
    assert entry["ok"] is False and entry["read_model"] == "mismatch"
    assert sorted(p["rule"] for p in entry["problems"]) == ["index.process_mismatch", "read_model.mismatch"]

def test_a_run_started_while_the_whole_store_is_verified_is_verified_not_called_orphan_rows(
    capsys: pytest.CaptureFixture[str], chain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit walkthrough: with the read models kept current (``project --follow``,
    as ``serve`` runs it), a run started after ``verify --all`` listed the store had rows, and
    no place in the list: verify failed (exit 1) with read_model.mismatch "the read models hold
    rows of tree T, which the store does not have". It is verified as the others."""
    store, tree_id = chain
    ok(agentfold("project", store=store))
    real = audit.all_trees
    started: list[TreeID] = []

    def listed_then_a_run_starts(events: EventStore) -> list[TreeID | str]:
        trees = real(events)
        started.append(record_chain(store, start_id="started-during-verify"))
        ok(agentfold("project", store=store))  # the follower writes its rows
        return trees

    monkeypatch.setattr(audit, "all_trees", listed_then_a_run_starts)
    code, report = verify(capsys, store)
    assert code == 0, report["first_error"]
    assert [r["tree"] for r in report["results"]] == [str(tree_id), str(started[0])]
    assert all(r["read_model"] == "equal" for r in report["results"])
    # Rows of a tree the store really does not have are still a failing entry.
    sql = Sql(store)
    ghost = "tree:" + "ab" * 16
    columns = ("start_id, root_process_id, program, status, classification, version, events_projected, "
               "created_position, position, unknown_count, pending_count, body")
    sql._run(f"INSERT INTO {RUNS} (tree_id, {columns}) SELECT ?, {columns} FROM {RUNS} WHERE tree_id = ?",
             (ghost, str(tree_id)))
    code, report = verify(capsys, store)
    assert code == 1 and first_error(report) == (ghost, 1, "read_model.mismatch"), report["first_error"]


def test_a_snapshot_that_differs_from_the_fold_is_reported_at_its_version(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree_id = chain
    events = EventStore(store)
    try:  # a snapshot at position 8, written as a runtime writes one
        loaded = events.load(tree_id, Catalog([chain_program()]).resolve, use_snapshot=False, upto=8)
        assert loaded.digest is not None
        events.save_snapshot(tree_id, loaded.state, loaded.digest)
    finally:
        events.close()
    code, report = verify(capsys, store)
    assert code == 0, report["first_error"]
    sql = Sql(store)
    ((body,),) = sql._run("SELECT state FROM agentfold_snapshots WHERE originator_id = ?", (sql._id(tree_id),))
    body = bytes(body)
    snapshot = orjson.loads(zlib.decompress(body[1:], -15) if body[:1] == b"\x01" else body)
    snapshot["tree"]["processes"][0]["committed_steps"] += 1  # what the next load would start from
    sql._run(
        "UPDATE agentfold_snapshots SET state = ? WHERE originator_id = ?", (orjson.dumps(snapshot), sql._id(tree_id))
    )
    code, report = verify(capsys, store)
    assert code == 1
    assert first_error(report) == (str(tree_id), 8, "snapshot.mismatch")
    assert "committed_steps" in report["first_error"]["detail"]


def test_verify_refuses_an_unknown_tree_and_needs_trees_or_all(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, _ = chain
    ran = cli(capsys, "audit", "verify", "no-such-start", "--json", "--store", store)
    assert ran.code == 2 and ran.error()["code"] == "engine.tree.not_found" and ran.stdout == ""
    ran = cli(capsys, "audit", "verify", "--json", "--store", store)
    assert ran.code == 2 and ran.error()["code"] == "cli.usage"


def test_verify_as_a_subprocess_prints_the_rule_and_position(chain: Any) -> None:
    store, tree_id = chain
    Sql(store).delete(tree_id, 7)
    ran = agentfold("audit", "verify", str(tree_id), store=store)
    assert ran.code == 1
    assert "FAILED" in ran.stdout
    assert "position 7: integrity.missing_event" in ran.stdout



def test_a_long_verification_says_how_far_it_is_on_stderr(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by a scale audit: `audit verify --all` ran 52 s on 50,000 runs and said nothing
    # until it ended. A progress line goes to stderr (every 5 s; every tree here), never to
    # stdout, which keeps the report (JSON stays parseable), and none after the last tree.
    import agentfold.adapters.cli

    for start in ("one", "two", "three"):
        record_chain(durable_store_url, start_id=start)
    quiet = cli(capsys, "audit", "verify", "--all", "--json", "--store", durable_store_url, sources=chain_sources())
    assert quiet.code == 0 and quiet.stderr == ""  # a short verification says nothing more
    monkeypatch.setattr(agentfold.adapters.cli, "PROGRESS_EVERY", 0.0)
    ran = cli(capsys, "audit", "verify", "--all", "--json", "--store", durable_store_url, sources=chain_sources())
    assert ran.code == 0 and ran.json() == quiet.json() | {"seconds": ran.json()["seconds"]}
    lines = ran.stderr.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        f"agentfold: audit verify: 1 of 3 trees, {LAST} events",
        f"agentfold: audit verify: 2 of 3 trees, {2 * LAST} events",
    ]
    assert all(line.endswith(" events/s)") for line in lines)


class _Weather:
    name = "weather"
    description = "The weather."
    parameters = {"type": "object"}

    def call(self, invocation: Any, arguments: Any) -> Any:
        from agentfold.adapters.tools import ToolOutput

        return ToolOutput.text("sunny")


def test_rows_a_deployment_projected_with_its_programs_are_unchecked_not_a_mismatch_where_they_are_unbound(
    capsys: pytest.CaptureFixture[str], durable_store_url: str
) -> None:
    # Found by an app-builder review: docs/python.md says `audit verify` works on any run, but the
    # plain `agentfold audit verify` of a deployment's Interaction run (read models projected by the
    # deployment's own console script, as the docs say to) failed: read_model.mismatch at
    # .rounds[0], exit 1, for intact rows; the repair it pointed at would have degraded them.
    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.models import ScriptedModel
    from agentfold.adapters.sources import ProgramSources, default_sources

    agent = compile_interaction(InteractionConfig(name="deployment.agent", tools=[_Weather()], model=ScriptedModel([
        {"message": {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "w1", "name": "weather", "arguments": "{}"}]}, "finish_reason": "tool_calls"},
        {"message": {"role": "assistant", "content": "It is sunny."}, "finish_reason": "stop"},
    ])))
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([agent])) as runtime:
            handle = runtime.start(agent, {"messages": [{"role": "user", "content": "weather?"}]}, start_id="dep-1")
            assert handle.result(timeout=60).status == "completed"
    finally:
        store.close()
    deployment = default_sources().plus(ProgramSources(programs=(agent,)))
    assert cli(capsys, "project", "--store", durable_store_url, sources=deployment).code == 0
    bound = cli(capsys, "audit", "verify", "--all", "--json", "--store", durable_store_url, sources=deployment)
    assert bound.code == 0 and bound.json()["results"][0]["read_model"] == "equal", bound.stdout
    plain = cli(capsys, "audit", "verify", "--all", "--json", "--store", durable_store_url, sources=default_sources())
    assert plain.code == 0, plain.stdout
    (result,) = plain.json()["results"]
    assert (result["ok"], result["programs_bound"], result["read_model"]) == (True, False, "unchecked"), result
    text = cli(capsys, "audit", "verify", "--all", "--store", durable_store_url, sources=default_sources())
    assert text.code == 0 and "read models unchecked" in text.stdout, text.stdout
    # Damage the plain script can see is still a finding: the run row's count of applied events.
    Sql(durable_store_url)._run("UPDATE agentfold_rm_runs SET events_projected = events_projected + 1")
    damaged = cli(capsys, "audit", "verify", "--all", "--json", "--store", durable_store_url, sources=default_sources())
    assert damaged.code == 1 and damaged.json()["results"][0]["read_model"] == "mismatch", damaged.stdout
    Sql(durable_store_url)._run("UPDATE agentfold_rm_runs SET events_projected = events_projected - 1")
    assert cli(capsys, "audit", "verify", "--all", "--store", durable_store_url, sources=default_sources()).code == 0
    # And so is a run entry that says something else than the kernel's fold (found by the review
    # of this test's fix: damage to the run's output or status passed as 'unchecked').
    Sql(durable_store_url)._run("UPDATE agentfold_rm_runs SET body = replace(body, 'It is sunny.', 'It is raining.')")
    damaged = cli(capsys, "audit", "verify", "--all", "--json", "--store", durable_store_url, sources=default_sources())
    (result,) = damaged.json()["results"]
    assert damaged.code == 1 and result["read_model"] == "mismatch", damaged.stdout
    assert ".run.output" in result["problems"][0]["detail"], result
