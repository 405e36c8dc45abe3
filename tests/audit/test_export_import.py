"""`agentfold export` / `agentfold import`: exact JSON Lines histories between SQLite and PostgreSQL.

Histories are recorded with the CLI (the trip-planner scenario), exported, imported into
a store of the other backend, and exported again. Imports are idempotent, verify the
whole file before they write, and refuse a different history of the same tree.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters import audit
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import RandomIds, Runtime
from agentfold.adapters.sources import default_sources
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import ProcessID, StartID, TreeID
from agentfold.domain.integrity import chain_digest
from tests.audit.support import Sql, cli, digest_of_state, record_demo
from tests.conftest import make_store_url
from tests.kernel_programs import chain_program
from tests.test_cli import ROOT, Ran, agentfold, ok, refused


def sqlite_store(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path / name}"


@pytest.fixture(params=[("sqlite", "postgresql"), ("postgresql", "sqlite")], ids=["sqlite-to-pg", "pg-to-sqlite"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    source_backend, target_backend = request.param
    urls = []
    for backend, name in ((source_backend, "source"), (target_backend, "target")):
        if backend == "sqlite":
            urls.append(sqlite_store(tmp_path, f"{name}.db"))
        else:
            urls.append(make_store_url("postgresql", tmp_path, request))
    return urls[0], urls[1]


def export(store: str, tree_id: TreeID, out: Path) -> bytes:
    ran = ok(agentfold("export", str(tree_id), "--out", str(out), "--json", store=store))
    assert ran.json()["events"] == len(out.read_bytes().splitlines()) - 1  # then the end line
    return out.read_bytes()


def records(exported: bytes) -> list[bytes]:
    """The record lines of an export (every line but the end line)."""
    *lines, end = exported.splitlines(keepends=True)
    assert set(json.loads(end)) == {"end", "tree"}
    return lines


def import_file(path: Path, store: str) -> Ran:
    return agentfold("import", str(path), "--json", store=store)


def snapshot_of(store: str, tree_id: TreeID) -> tuple[Any, ...]:
    """Everything an import could change: the events, the index row, the process rows."""
    sql = Sql(store)
    trees = sql._run("SELECT * FROM agentfold_trees ORDER BY tree_id")
    processes = sql._run("SELECT * FROM agentfold_processes ORDER BY process_id")
    return sql.rows(tree_id), [tuple(map(str, r)) for r in trees], [tuple(map(str, r)) for r in processes], sql.count(
        "agentfold_events"
    )


def test_export_import_export_is_byte_identical_and_importing_twice_changes_nothing(
    stores: tuple[str, str], tmp_path: Path
) -> None:
    source, target = stores
    tree_id = record_demo(tmp_path / "run", source)
    first = export(source, tree_id, tmp_path / "first.jsonl")
    lines = [json.loads(line) for line in records(first)]
    # The end line names how many records the file holds and the digest of the last one: the
    # tree index's head digest.
    end = json.loads(first.splitlines()[-1])
    (head,) = ok(agentfold("trees", "--json", store=source)).json()["trees"]
    assert end == {"end": {"events": len(lines), "head_digest": head["head_digest"]}, "tree": str(tree_id)}
    assert [line["position"] for line in lines] == list(range(1, len(lines) + 1))
    assert {line["tree"] for line in lines} == {str(tree_id)}
    assert first.isascii()
    # Each line holds the stored record exactly: topic and state bytes as the source stores them.
    assert [(line["position"], line["topic"], line["state"].encode()) for line in lines] == Sql(source).rows(tree_id)

    imported = ok(import_file(tmp_path / "first.jsonl", target)).json()
    assert imported == {
        "tree_id": str(tree_id), "events": len(lines), "written": len(lines), "already_present": 0, "changed": True,
        "programs_bound": True,
    }
    second = export(target, tree_id, tmp_path / "second.jsonl")
    assert second == first

    before = snapshot_of(target, tree_id)
    again = ok(import_file(tmp_path / "first.jsonl", target))
    assert again.json()["changed"] is False and again.json()["written"] == 0
    assert snapshot_of(target, tree_id) == before
    text = ok(agentfold("import", str(tmp_path / "first.jsonl"), store=target)).stdout
    assert "nothing changed" in text

    # The imported tree is a first-class tree of the target: verified, indexed, shown alike.
    verified = ok(agentfold("audit", "verify", "--all", "--json", store=target)).json()
    assert verified["ok"] is True and verified["events"] == len(lines)
    shown = [ok(agentfold("show", str(tree_id), "--json", store=s)).json() for s in (source, target)]
    assert shown[0] == shown[1]
    heads = [ok(agentfold("trees", "--json", store=s)).json()["trees"][0] for s in (source, target)]
    for head in heads:
        head.pop("created_at"), head.pop("updated_at")
    assert heads[0] == heads[1]


def test_a_tampered_file_is_refused_before_anything_is_written(stores: tuple[str, str], tmp_path: Path) -> None:
    source, target = stores
    tree_id = record_demo(tmp_path / "run", source)
    lines = export(source, tree_id, tmp_path / "good.jsonl").decode().splitlines()
    position = next(i for i, line in enumerate(lines, start=1) if "sunny, 24 C" in line)
    bad = lines.copy()
    bad[position - 1] = bad[position - 1].replace("sunny, 24 C", "rainy, 14 C")
    (tmp_path / "bad.jsonl").write_text("\n".join(bad) + "\n")
    error = refused(import_file(tmp_path / "bad.jsonl", target)).error()
    assert error["code"] == "import.corrupt"
    assert error["detail"] == {"tree": str(tree_id), "position": position, "rule": "integrity.digest_chain"}
    # A dropped line is a missing position.
    (tmp_path / "gap.jsonl").write_text("\n".join(lines[:5] + lines[6:]) + "\n")
    error = refused(import_file(tmp_path / "gap.jsonl", target)).error()
    assert error["detail"] == {"tree": str(tree_id), "position": 6, "rule": "integrity.missing_event"}
    # Nothing was written: the SQLite file was never created, the PostgreSQL database holds no table.
    if target.startswith("sqlite:///"):
        assert not Path(target.removeprefix("sqlite:///")).exists()
    else:
        assert not {"agentfold_events", "agentfold_trees"} & Sql(target).tables()


def test_a_different_history_of_the_same_tree_is_refused(stores: tuple[str, str], tmp_path: Path) -> None:
    source, target = stores
    # The same start id gives the same tree id; two runs give two different histories.
    mine = record_demo(tmp_path / "mine", source, start_id="same-start")
    theirs = record_demo(tmp_path / "theirs", target, start_id="same-start")
    assert mine == theirs
    export(source, mine, tmp_path / "mine.jsonl")
    before = snapshot_of(target, theirs)
    error = refused(import_file(tmp_path / "mine.jsonl", target)).error()
    assert error["code"] == "import.conflict"
    assert error["detail"]["tree"] == str(mine)
    assert snapshot_of(target, theirs) == before


def test_importing_over_a_damaged_compressed_row_is_a_conflict_not_a_crash(tmp_path: Path) -> None:
    source, target = sqlite_store(tmp_path, "source.db"), sqlite_store(tmp_path, "target.db")
    tree_id = record_demo(tmp_path / "run", source)
    exported = tmp_path / "tree.jsonl"
    export(source, tree_id, exported)
    ok(import_file(exported, target))
    sql = Sql(target)
    position, topic, state = next((v, t, s) for v, t, s in sql.raw_rows(tree_id) if s[:1] == b"\x01")
    sql.set_row(tree_id, position, topic, state[:-5])  # no longer inflates
    before = sql.raw_rows(tree_id)
    error = refused(import_file(exported, target)).error()
    assert error["code"] == "import.conflict"
    assert error["detail"]["position"] == position
    assert sql.raw_rows(tree_id) == before


def test_an_import_continues_a_history_it_imported_before(tmp_path: Path) -> None:
    source, target = sqlite_store(tmp_path, "source.db"), sqlite_store(tmp_path, "target.db")
    tree_id = record_demo(tmp_path / "run", source, answer=False)  # parked on the human input
    parked = export(source, tree_id, tmp_path / "parked.jsonl")
    ok(import_file(tmp_path / "parked.jsonl", target))
    (pending,) = ok(agentfold("pending", "--json", store=source)).json()["pending"]
    ok(agentfold("answer", pending["process_id"], pending["wait_id"], '{"approved": true}', store=source))
    finished = export(source, tree_id, tmp_path / "finished.jsonl")
    assert records(finished)[: len(records(parked))] == records(parked)
    report = ok(import_file(tmp_path / "finished.jsonl", target)).json()
    already = len(records(parked))
    assert (report["already_present"], report["written"]) == (already, len(records(finished)) - already)
    assert export(target, tree_id, tmp_path / "again.jsonl") == finished
    assert ok(agentfold("trees", "--json", store=target)).json()["trees"][0]["status"] == "completed"


def test_an_import_of_a_live_trees_earlier_export_changes_nothing_and_is_no_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by a review of 7b58940: importing an earlier export of a tree a host still drives was
    # refused "its history was cut" (5 of 5 CLI imports): the events were read, the host appended,
    # and the index row read after them was ahead. The window, made certain: the import's read of
    # the events answers as it did before the last append.
    source = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", source, answer=False)
    export(source, tree_id, tmp_path / "parked.jsonl")
    (pending,) = ok(agentfold("pending", "--json", store=source)).json()["pending"]
    ok(agentfold("answer", pending["process_id"], pending["wait_id"], '{"approved": true}', store=source))
    parked_tree, parked_stored, parked_folded = audit.check_export((tmp_path / "parked.jsonl").read_bytes(),
                                                                   default_sources())
    store = EventStore(source)
    try:
        whole = len(store.read_raw(tree_id))
        assert whole > len(parked_stored)
        real_raw = audit._raw
        reads: list[int] = []

        def read_before_the_append(store_: EventStore, tree: TreeID, **kwargs: Any) -> Any:
            rows = real_raw(store_, tree, **kwargs)
            reads.append(len(rows))
            return rows[: len(parked_stored)] if len(reads) == 1 else rows

        monkeypatch.setattr(audit, "_raw", read_before_the_append)
        report = audit.import_history(store, parked_tree, parked_stored, parked_folded)
        assert (report.written, report.already) == (0, len(parked_stored))
        assert len(store.read_raw(tree_id)) == whole
    finally:
        store.close()


def test_an_import_beside_a_longer_import_of_the_same_history_is_no_conflict(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit walkthrough: two consistent exports of one tree (a prefix and the whole)
    imported at the same time. The whole one committed between the prefix import's compare and
    its read of the index row, which then anchored past the prefix file: refused
    import.conflict "the store recorded another history (cut or changed since)", although
    nothing conflicts (run again, "nothing changed"). It compares again."""
    source = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", source, answer=False)
    parked = export(source, tree_id, tmp_path / "parked.jsonl")
    (pending,) = ok(agentfold("pending", "--json", store=source)).json()["pending"]
    ok(agentfold("answer", pending["process_id"], pending["wait_id"], '{"approved": true}', store=source))
    finished = export(source, tree_id, tmp_path / "finished.jsonl")
    real = audit._anchor_on_the_file
    landed: list[Ran] = []

    def the_whole_one_commits_first(*args: Any) -> Any:
        if not landed:  # another process imports the whole history right now
            landed.append(ok(import_file(tmp_path / "finished.jsonl", durable_store_url)))
        return real(*args)

    monkeypatch.setattr(audit, "_anchor_on_the_file", the_whole_one_commits_first)
    ran = cli(capsys, "import", str(tmp_path / "parked.jsonl"), "--json", "--store", durable_store_url)
    assert ran.code == 0, ran.stderr
    assert landed and ran.json()["changed"] is False
    assert ran.json()["already_present"] == len(records(parked))
    assert export(durable_store_url, tree_id, tmp_path / "again.jsonl") == finished


def test_export_to_standard_output_and_refusals(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path, "store.db")
    tree_id = record_demo(tmp_path / "run", store)
    printed = ok(agentfold("export", str(tree_id), store=store)).stdout
    assert printed.encode() == export(store, tree_id, tmp_path / "file.jsonl")
    nowhere = refused(agentfold("export", str(tree_id), "--out", str(tmp_path / "no" / "dir.jsonl"), "--json",
                                store=store)).error()
    assert nowhere["code"] == "export.unwritable" and "No such file or directory" in nowhere["message"]
    assert not (tmp_path / "no").exists()
    out = ["--out", str(tmp_path / "bad.jsonl")]
    for ref in ("has space", "tree:not-hex"):  # a malformed reference is named as every command names it
        for command in (["export", ref, *out], ["audit", "verify", ref]):
            assert refused(agentfold(*command, "--json", store=store)).error()["code"] == "identity.invalid"
    Sql(store).delete(tree_id, 10)
    ran = agentfold("export", str(tree_id), "--out", str(tmp_path / "broken.jsonl"), "--json", store=store)
    assert ran.code == 1 and ran.error()["code"] == "store.corrupt"
    assert not (tmp_path / "broken.jsonl").exists()
    (tmp_path / "junk.jsonl").write_text('{"tree": "x"}\n')
    assert refused(import_file(tmp_path / "junk.jsonl", store)).error()["code"] == "import.format"


def test_a_file_cut_short_is_refused_and_a_whole_file_of_an_earlier_release_imports_when_asked(tmp_path: Path) -> None:
    # Found by a tamper audit: a file cut after any line is a whole, verifiable history up to
    # there; it imported, `audit verify` said OK, and `recover` called the cut-off tool again.
    source, target = sqlite_store(tmp_path, "source.db"), sqlite_store(tmp_path, "target.db")
    tree_id = record_demo(tmp_path / "run", source)
    exported = export(source, tree_id, tmp_path / "whole.jsonl")
    kept, end = records(exported), exported.splitlines(keepends=True)[-1]

    (tmp_path / "cut.jsonl").write_bytes(b"".join(kept[:27]))  # as `head -n 27` leaves it
    error = refused(import_file(tmp_path / "cut.jsonl", target)).error()
    assert error["code"] == "import.format" and "no end line after its 27 record(s)" in error["message"]
    assert "--without-end" in error["hint"]
    # Wherever the cut falls (between Steps or in the middle of one), it is the same refusal:
    # found by a regression audit, a cut inside a Step was reported as a broken history
    # (import.corrupt effect.declaration) since the fold ran before the end line was looked for.
    sources = default_sources()
    for n in range(1, len(kept)):
        with pytest.raises(InvalidInput) as cut:
            audit.check_export(b"".join(kept[:n]), sources)
        assert cut.value.code == "import.format", (n, cut.value.code, cut.value.message)
        assert f"no end line after its {n} record(s)" in cut.value.message
    (tmp_path / "cut-end.jsonl").write_bytes(b"".join(kept[:27]) + end)  # records dropped, end line kept
    error = refused(import_file(tmp_path / "cut-end.jsonl", target)).error()
    assert error["code"] == "import.corrupt"
    assert error["detail"] == {"tree": str(tree_id), "position": 28, "rule": "integrity.end"}
    forged = json.loads(end)
    forged["end"]["head_digest"] = "sha256:" + "0" * 64
    (tmp_path / "forged-end.jsonl").write_bytes(b"".join(kept) + json.dumps(forged).encode() + b"\n")
    error = refused(import_file(tmp_path / "forged-end.jsonl", target)).error()
    assert error["code"] == "import.corrupt" and error["detail"]["rule"] == "integrity.end"
    (tmp_path / "end-first.jsonl").write_bytes(end + b"".join(kept))
    assert refused(import_file(tmp_path / "end-first.jsonl", target)).error()["code"] == "import.format"
    assert not Path(target.removeprefix("sqlite:///")).exists()  # nothing was even opened

    # An export of an earlier release has no end line: imported on purpose, it is the whole history.
    (tmp_path / "earlier.jsonl").write_bytes(b"".join(kept))
    report = ok(agentfold("import", str(tmp_path / "earlier.jsonl"), "--without-end", "--json", store=target)).json()
    assert report["written"] == len(kept)
    assert export(target, tree_id, tmp_path / "again.jsonl") == exported
    # --without-end only drops the need for an end line: one that is there is still checked.
    cut = refused(agentfold("import", str(tmp_path / "cut-end.jsonl"), "--without-end", "--json", store=target))
    assert cut.error()["detail"]["rule"] == "integrity.end"


def test_export_out_gives_the_file_the_mode_a_plain_write_would(tmp_path: Path) -> None:
    # Found by a crash audit: every export file was created 0600 (the temporary file's mode),
    # whatever the umask, unlike a file written with `> file` (or `export` to stdout).
    store = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", store)
    out = tmp_path / "tree.jsonl"
    old = os.umask(0o022)
    try:
        export(store, tree_id, out)
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        out.chmod(0o600)  # an operator who restricted the file keeps it restricted
        export(store, tree_id, out)
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        os.umask(0o077)
        export(store, tree_id, tmp_path / "private.jsonl")
        assert stat.S_IMODE((tmp_path / "private.jsonl").stat().st_mode) == 0o600
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_export_out_through_a_symbolic_link_writes_the_file_it_names(tmp_path: Path) -> None:
    # Found by a security review: the link was replaced by a regular file (a shell's `>`
    # writes through it), and the temporary file went to the link target's folder, so a link
    # to another file system failed with "Invalid cross-device link".
    store = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", store)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "tree.jsonl").write_text("old\n")
    (kept / "tree.jsonl").chmod(0o640)
    link = tmp_path / "latest.jsonl"
    link.symlink_to(kept / "tree.jsonl")
    exported = export(store, tree_id, link)
    assert link.is_symlink() and (kept / "tree.jsonl").read_bytes() == exported
    assert stat.S_IMODE((kept / "tree.jsonl").stat().st_mode) == 0o640
    dangling = tmp_path / "next.jsonl"
    dangling.symlink_to(kept / "new.jsonl")
    assert export(store, tree_id, dangling) == exported and dangling.is_symlink()
    assert (kept / "new.jsonl").read_bytes() == exported
    assert sorted(p.name for d in (tmp_path, kept) for p in d.iterdir() if p.name.startswith(".")) == []
    piped = ok(agentfold("export", str(tree_id), "--out", "/dev/stdout", store=store))
    # The export is the output; its report goes to stderr (after the end line it made
    # `export --out /dev/stdout | import -` fail: found by the docs audit).
    assert piped.stdout.encode() == exported
    events = len(exported.splitlines()) - 1  # then the end line
    assert piped.stderr.strip() == f"exported {events} event(s) of {tree_id} to /dev/stdout"
    reported = ok(agentfold("export", str(tree_id), "--out", "/dev/stdout", "--json", store=store))
    assert reported.stdout.encode() == exported and json.loads(reported.stderr)["out"] == "/dev/stdout"


def test_export_to_stdout_piped_into_import_round_trips(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", store)
    target = sqlite_store(tmp_path, "target.db")
    command = [sys.executable, "-m", "agentfold.adapters.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    exporting = subprocess.Popen([*command, "export", str(tree_id), "--out", "/dev/stdout", "--store", store],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    importing = subprocess.run([*command, "import", "-", "--store", target], stdin=exporting.stdout,
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert exporting.stdout is not None
    exporting.stdout.close()
    assert exporting.wait(timeout=120) == 0
    assert importing.returncode == 0, importing.stderr
    assert export(target, tree_id, tmp_path / "again.jsonl") == export(store, tree_id, tmp_path / "first.jsonl")


def test_a_file_whose_process_belongs_to_another_tree_of_the_store_is_a_conflict(
    stores: tuple[str, str], tmp_path: Path
) -> None:
    # Found by a security review: a crafted export whose root Process id is a Process of
    # another tree in the target store was reported as "kept changing while it was imported"
    # (audit.import_contended, exit 1), after three retries.
    source, target = stores
    victim = record_demo(tmp_path / "victim", target, start_id="victim")
    victims = EventStore(target)
    try:
        head = victims.head(victim)
        assert head is not None
        taken = head.root_process_id
    finally:
        victims.close()

    class SameRoot(RandomIds):
        def root_process_id(self) -> ProcessID:
            return ProcessID(taken)

    program = chain_program(name="import.collide")
    store = EventStore(source)
    try:
        with Runtime(store, Catalog([program]), ids=SameRoot()) as runtime:
            done = runtime.start(program, {"n": 1}, start_id="crafted").result(timeout=30)
            assert done.status == "completed"
    finally:
        store.close()
    export(source, TreeID.for_start(StartID("crafted")), tmp_path / "crafted.jsonl")
    before = snapshot_of(target, victim)
    error = refused(import_file(tmp_path / "crafted.jsonl", target)).error()
    assert error["code"] == "import.conflict", error
    assert error["detail"]["process_id"] == taken and str(victim) in error["message"]
    assert snapshot_of(target, victim) == before
    assert refused(agentfold("show", "crafted", "--json", store=target)).error()["code"] == "engine.tree.not_found"


def test_a_record_with_a_member_twice_is_an_import_format_error(tmp_path: Path) -> None:
    # Found by a security review: {"position": 1, ..., "position": 2} was read as position 2
    # (the parser keeps the last) and reported as "position 1 is missing".
    source = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", source)
    first, *rest = export(source, tree_id, tmp_path / "tree.jsonl").splitlines(keepends=True)
    doubled = first.replace(b'"position":1', b'"position":1,"position":2', 1)
    assert doubled != first
    (tmp_path / "doubled.jsonl").write_bytes(doubled + b"".join(rest))
    target = sqlite_store(tmp_path, "target.db")
    error = refused(import_file(tmp_path / "doubled.jsonl", target)).error()
    assert error["code"] == "import.format", error
    assert error["message"] == "line 1 has the member 'position' twice in one object", error
    assert not Path(target.removeprefix("sqlite:///")).exists()


@pytest.mark.parametrize("line", ["[" * 200_000 + "]" * 200_000, '{"position": ' + "9" * 100_000 + "}"],
                         ids=["nested-200k-deep", "100k-digit-number"])
def test_a_line_python_cannot_parse_is_an_import_format_error(tmp_path: Path, line: str) -> None:
    # Found by a security review: RecursionError / ValueError (the 4,300-digit limit) ended as
    # cli.internal, exit 1.
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    target = sqlite_store(tmp_path, "target.db")
    error = refused(import_file(path, target)).error()
    assert error["code"] == "import.format" and error["message"].startswith("line 1 is not JSON"), error
    assert not Path(target.removeprefix("sqlite:///")).exists()


@pytest.mark.parametrize("edit", [
    (b'"event":{', b'"event": {'),  # a space
    (b'"timestamp":', b'"event":{},"timestamp":'),  # a member twice (the parser keeps the last)
], ids=["space", "member-twice"])
def test_a_history_chained_over_content_that_is_not_canonical_json_is_refused(
    tmp_path: Path, edit: tuple[bytes, bytes]
) -> None:
    # Found by a review: such a file (its chain recomputed) was imported and verified, and the
    # publisher published it; the transcript consumer, which rebuilds the content from the
    # envelope's values, then stopped the whole topic with feed.chain_broken.
    source = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", source)
    lines = [json.loads(line) for line in records(export(source, tree_id, tmp_path / "tree.jsonl"))]
    previous = None
    out = []
    for record in lines:
        state = record["state"].encode()
        content = b"{" + state[len(b'{"digest":"sha256:') + 64 + 2:]
        if record["position"] == 2:
            content = content.replace(*edit, 1)
            json.loads(content)  # still valid JSON
        previous = chain_digest(previous, str(tree_id), record["position"], record["topic"].split(":", 1)[1], content)
        out.append(json.dumps({**record, "state": '{"digest":"' + previous + '",' + content[1:].decode()},
                              separators=(",", ":")))
    out.append(json.dumps({"end": {"events": len(lines), "head_digest": previous}, "tree": str(tree_id)},
                          separators=(",", ":")))
    crafted = tmp_path / "crafted.jsonl"
    crafted.write_text("\n".join(out) + "\n")
    target = sqlite_store(tmp_path, "target.db")
    error = refused(import_file(crafted, target)).error()
    assert error["code"] == "import.corrupt", error
    assert (error["detail"]["position"], error["detail"]["rule"]) == (2, "integrity.format"), error
    assert "not canonical JSON" in error["message"]
    assert not Path(target.removeprefix("sqlite:///")).exists()


def cut_after(store: str, tree_id: TreeID, position: int) -> None:
    """Delete the tree's events after ``position`` by hand, leaving the index row (which still
    anchors the end it proves) and the Process rows alone."""
    sql = Sql(store)
    sql.delete(tree_id, *[v for v, _, _ in sql.raw_rows(tree_id) if v > position])


def two_endings(tmp_path: Path) -> tuple[TreeID, Path, Path, int]:
    """One tree recorded twice from the same beginning: parked on the human input, then
    approved in one SQLite store and refused in a copy of it. Both exports, and the position
    of the last record they share."""
    waiting = sqlite_store(tmp_path, "waiting.db")
    tree_id = record_demo(tmp_path / "run", waiting, start_id="two-endings", answer=False)
    files: list[Path] = []
    for approved in (True, False):
        name = "approved" if approved else "refused"
        for suffix in ("", "-wal", "-shm"):
            if (tmp_path / f"waiting.db{suffix}").exists():
                shutil.copy(tmp_path / f"waiting.db{suffix}", tmp_path / f"{name}.db{suffix}")
        store = sqlite_store(tmp_path, f"{name}.db")
        (pending,) = ok(agentfold("pending", "--json", store=store)).json()["pending"]
        ok(agentfold("answer", pending["process_id"], pending["wait_id"], json.dumps({"approved": approved}),
                     store=store))
        export(store, tree_id, tmp_path / f"{name}.jsonl")
        files.append(tmp_path / f"{name}.jsonl")
    approved_lines, refused_lines = (records(f.read_bytes()) for f in files)
    shared = next(i for i, (a, b) in enumerate(zip(approved_lines, refused_lines, strict=False)) if a != b)
    assert shared > 0
    return tree_id, files[0], files[1], shared


def test_a_history_cut_under_its_index_row_is_restored_only_by_the_history_the_row_proves(
    durable_store_url: str, tmp_path: Path
) -> None:
    # Found by an audit review: a tree whose tail was cut (its index row still anchoring the
    # end) took an import of ANOTHER continuation of the kept prefix: the import wrote it and
    # overwrote the row that proved the cut, and `audit verify` then said OK.
    target = durable_store_url
    tree_id, approved, refused_file, shared = two_endings(tmp_path)
    ok(import_file(approved, target))
    original = snapshot_of(target, tree_id)
    anchor = Sql(target).head(tree_id)
    cut_after(target, tree_id, shared)
    verified = agentfold("audit", "verify", str(tree_id), "--json", store=target)
    assert verified.code == 1 and verified.json()["ok"] is False
    cut = snapshot_of(target, tree_id)

    error = refused(import_file(refused_file, target)).error()
    assert error["code"] == "import.conflict"
    assert error["detail"] == {"tree": str(tree_id), "position": anchor[0]}
    assert anchor[1] in error["message"] and "nothing was written" in error["message"]
    assert snapshot_of(target, tree_id) == cut  # the row that proves the cut is still there

    # The history the row proves restores it: the tree is whole again, as before the cut.
    restored = ok(import_file(approved, target)).json()
    assert (restored["written"], restored["already_present"], restored["changed"]) == (
        anchor[0] - shared, shared, True
    )
    assert snapshot_of(target, tree_id) == original
    assert ok(agentfold("audit", "verify", str(tree_id), "--json", store=target)).json()["ok"] is True


def test_a_file_no_longer_than_what_a_cut_store_keeps_is_refused_not_nothing_changed(tmp_path: Path) -> None:
    # Found by an audit walkthrough: a tree cut under its index row took an import of an export
    # no longer than what the cut kept as "the store already holds these events; nothing
    # changed" (exit 0): the operator believed the tree mended, and it stayed corrupt.
    tree_id, approved, _refused, shared = two_endings(tmp_path)
    parked = export(sqlite_store(tmp_path, "waiting.db"), tree_id, tmp_path / "parked.jsonl")
    assert len(records(parked)) <= shared
    target = sqlite_store(tmp_path, "target.db")
    ok(import_file(approved, target))
    anchor = Sql(target).head(tree_id)
    cut_after(target, tree_id, shared)
    before = snapshot_of(target, tree_id)
    error = refused(import_file(tmp_path / "parked.jsonl", target)).error()
    assert error["code"] == "import.conflict", error
    assert error["detail"] == {"tree": str(tree_id), "position": anchor[0]}
    assert f"keeps only {shared} event(s)" in error["message"] and "nothing was written" in error["message"]
    assert snapshot_of(target, tree_id) == before
    # The export the row proves still mends it.
    assert ok(import_file(approved, target)).json()["changed"] is True
    assert ok(agentfold("audit", "verify", str(tree_id), "--json", store=target)).json()["ok"] is True
    # A store whose history lacks a middle position: the import names the gap.
    Sql(target).delete(tree_id, 3)
    before = snapshot_of(target, tree_id)
    error = refused(import_file(approved, target)).error()
    assert error["code"] == "import.conflict" and error["detail"]["position"] == 3, error
    assert "has no event at position 3 (its next is position 4)" in error["message"]
    assert snapshot_of(target, tree_id) == before


def test_a_cut_that_removed_a_process_start_is_restored_by_importing_the_tree_again(
    stores: tuple[str, str], tmp_path: Path
) -> None:
    # Found by an audit review: the cut left the Process rows of the Processes it removed
    # (the process index is written once, when a Process is created); re-importing the tree's
    # own export ran into them and failed as "kept changing while it was imported"
    # (audit.import_contended, exit 1) however often it was retried.
    source, target = stores
    tree_id = record_demo(tmp_path / "run", source)
    exported = export(source, tree_id, tmp_path / "tree.jsonl")
    starts = [json.loads(line)["position"] for line in records(exported)
              if json.loads(line)["topic"].endswith(":ProcessStarted")]
    ok(import_file(tmp_path / "tree.jsonl", target))
    original = snapshot_of(target, tree_id)
    sql = Sql(target)
    for how in ("row left as it was", "row rewritten to the cut", "every event cut", "every event and the row"):
        kept = 0 if how.startswith("every event") else starts[-1] - 1  # the last Process start and what follows
        cut_after(target, tree_id, kept)
        if how == "row rewritten to the cut":
            rows = sql.raw_rows(tree_id)
            sql.set_head(tree_id, rows[-1][0], digest_of_state(sql.state(tree_id, rows[-1][0])))
        if how == "every event and the row":
            sql._run("DELETE FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),))
        assert snapshot_of(target, tree_id)[2] == original[2], how  # the Process rows stay
        restored = ok(import_file(tmp_path / "tree.jsonl", target)).json()
        assert restored["written"] == len(original[0]) - kept, how
        assert snapshot_of(target, tree_id) == original, how
        assert ok(agentfold("audit", "verify", str(tree_id), "--json", store=target)).json()["ok"] is True, how


def test_an_index_row_that_no_file_position_explains_refuses_the_import(tmp_path: Path) -> None:
    source, target = sqlite_store(tmp_path, "source.db"), sqlite_store(tmp_path, "target.db")
    tree_id = record_demo(tmp_path / "run", source)
    exported = export(source, tree_id, tmp_path / "tree.jsonl")
    n = len(records(exported))
    ok(import_file(tmp_path / "tree.jsonl", target))
    sql = Sql(target)
    cut_after(target, tree_id, 5)
    for version, why in ((n + 3, f"past the file's {n} record(s)"), (7, "which is not the file's record there")):
        sql.set_head(tree_id, version, "sha256:" + "0" * 64)
        before = snapshot_of(target, tree_id)
        error = refused(import_file(tmp_path / "tree.jsonl", target)).error()
        assert error["code"] == "import.conflict" and error["detail"]["position"] == version
        assert why in error["message"]
        assert snapshot_of(target, tree_id) == before
    sql._run("UPDATE agentfold_trees SET version = 'x' WHERE tree_id = ?", (str(tree_id),))
    error = refused(import_file(tmp_path / "tree.jsonl", target)).error()
    assert error["code"] == "import.conflict" and "not a number" in error["message"]


def test_refusals_of_a_repeated_record_a_trailing_empty_line_and_a_negative_end_count_say_so(tmp_path: Path) -> None:
    # Found by an audit review: these files were refused with the right code but misleading words
    # ("position 6 is missing (the next stored position is 5)", "more lines follow", position -4).
    source = sqlite_store(tmp_path, "source.db")
    tree_id = record_demo(tmp_path / "run", source)
    *lines, end = export(source, tree_id, tmp_path / "tree.jsonl").decode().splitlines()
    target = sqlite_store(tmp_path, "target.db")
    bad_end = json.dumps({"end": {"events": -5, "head_digest": json.loads(end)["end"]["head_digest"]},
                          "tree": str(tree_id)}, separators=(",", ":"), sort_keys=True)
    for name, text, code, words in (
        ("repeated", "\n".join([*lines[:5], lines[4], *lines[5:], end]) + "\n", "import.corrupt",
         "position 6 is missing (the next stored position is 5, again: a record repeated or out of order)"),
        ("trailing", "\n".join([*lines, end]) + "\n\n", "import.format", "but empty lines follow it"),
        ("negative", "\n".join([*lines, bad_end]) + "\n", "import.format", "N the number of records (at least 1)"),
    ):
        (tmp_path / f"{name}.jsonl").write_text(text)
        error = refused(import_file(tmp_path / f"{name}.jsonl", target)).error()
        assert error["code"] == code and words in error["message"], (name, error)
    assert not Path(target.removeprefix("sqlite:///")).exists()
