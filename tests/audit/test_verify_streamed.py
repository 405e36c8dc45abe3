"""`audit verify --all` does not hold every tree's result: a store-wide run stays small.

A scale audit measured 124 MB for 50,000 runs, growing with the store: the command kept each
tree's check, then the whole report as JSON, then as text. Each result is now written out as it
is made (to a temporary file past ``SPOOL_BYTES``) and printed after the summary, so the output
is byte for byte what it was.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentfold.adapters import audit, cli_audit
from agentfold.adapters.eventstore import EventStore
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql, chain_sources, cli, record_chain


def _store_with_a_broken_tree(tmp_path: Path) -> tuple[str, list[TreeID]]:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    trees = [record_chain(url, n=2, start_id=f"run-{i}") for i in range(6)]
    sql = Sql(url)
    state = sql.state(trees[3], 5)
    sql.set_row(trees[3], 5, "domain.events:EffectSettled", state.replace(b'"value":1', b'"value":9'))
    return url, trees


def test_verify_hands_each_check_over_and_holds_none(tmp_path: Path) -> None:
    url, trees = _store_with_a_broken_tree(tmp_path)
    store = EventStore(url, create=False)
    try:
        held = audit.verify(store, audit.all_trees(store), chain_sources())
        handed: list[audit.TreeCheck] = []
        streamed = audit.verify(store, audit.all_trees(store), chain_sources(), on_check=handed.append)
    finally:
        store.close()
    assert streamed.checks == []
    assert [c.to_json() for c in handed] == [c.to_json() for c in held.checks]
    assert sorted(c.tree_id for c in handed) == sorted(trees)
    assert (streamed.trees, streamed.events, streamed.ok) == (held.trees, held.events, False) == (6, held.events, False)
    assert streamed.first_error == held.first_error and streamed.first_error is not None
    assert streamed.first_error.tree == trees[3] and streamed.first_error.rule == "integrity.digest_chain"


@pytest.mark.parametrize("spool_bytes", [cli_audit.SPOOL_BYTES, 64])
def test_the_report_prints_as_before_in_memory_or_spooled_to_disk(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, spool_bytes: int
) -> None:
    url, trees = _store_with_a_broken_tree(tmp_path)
    monkeypatch.setattr(cli_audit, "SPOOL_BYTES", spool_bytes)
    ran = cli(capsys, "audit", "verify", "--all", "--json", "--store", url, sources=chain_sources())
    assert ran.code == 1
    report = json.loads(ran.stdout)
    store = EventStore(url, create=False)
    try:
        expected = audit.verify(store, audit.all_trees(store), chain_sources()).to_json()
    finally:
        store.close()
    assert report["seconds"] >= 0
    del report["seconds"], expected["seconds"]
    assert report == expected
    # One line, keys sorted: the layout every --json output has.
    assert ran.stdout.count("\n") == 1 and list(report) == sorted(report)

    text = cli(capsys, "audit", "verify", "--all", "--store", url, sources=chain_sources())
    assert text.code == 1
    lines = text.stdout.splitlines()
    assert re.fullmatch(r"verified 6 tree\(s\), \d+ event\(s\) in [0-9.]+ s \([0-9,]+ events/s\): FAILED", lines[0])
    by_tree = [line for line in lines[1:] if line.startswith("tree:")]
    assert [line.split()[0] for line in by_tree] == [r["tree"] for r in expected["results"]]
    failed = [line for line in by_tree if "FAILED" in line]
    assert len(failed) == 1 and failed[0].startswith(str(trees[3]))
    assert lines[lines.index(failed[0]) + 1].startswith("  position 5: integrity.digest_chain: ")


def test_an_empty_store_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    EventStore(url).close()
    text = cli(capsys, "audit", "verify", "--all", "--store", url, sources=chain_sources())
    assert (text.code, text.stdout) == (0, f"no trees in {url}\n")
    as_json = cli(capsys, "audit", "verify", "--all", "--json", "--store", url, sources=chain_sources())
    report = json.loads(as_json.stdout)
    assert as_json.code == 0 and (report["trees"], report["results"], report["ok"]) == (0, [], True)
