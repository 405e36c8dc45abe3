"""CLI commands: `audit verify`, `audit drift`, `replay`, `export`, `import` (docs/audit.md), `snapshot`.

Exit status: 0 when the history is intact (no drift; the export or import succeeded),
1 when a check found something wrong (the report says what, where and which rule) or the
export could not be written (a full disk: ``export.write_failed``),
2 when the input was refused (an unknown tree, a position out of range, a corrupt or
conflicting import file).
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import stat
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, TextIO

from eventsourcing.persistence import PersistenceError

from agentfold.adapters import audit
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.cli import PROG, Context, Outcome, Ticker, _short, _show_text, _UsageError, json_text
from agentfold.adapters.codec import MAX_SNAPSHOT_BYTES
from agentfold.adapters.eventstore import CorruptStream, EventStore, redact
from agentfold.adapters.runtime import DEFAULT_SNAPSHOT_EVERY
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import AgentfoldError, InvalidInput, NotFound, StoreFailure, recorded_text
from agentfold.domain.events import TreeStarted
from agentfold.domain.ids import TreeID


def _add_common(parser: argparse.ArgumentParser) -> None:
    # A nested command parses its own options: repeat the shared ones (unset unless given).
    parser.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,
                        help="event store URL (default: $AGENTFOLD_STORE, else sqlite:///./agentfold.db)")
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON (docs/audit.md)")


# ---------------------------------------------------------------------------
# audit verify


#: Bytes of per-tree results ``audit verify`` keeps in memory before it spools them to a
#: temporary file (the report prints them after its summary, which only the end knows).
SPOOL_BYTES = 8 << 20


def cmd_audit_verify(ctx: Context, args: argparse.Namespace) -> Outcome:
    if bool(args.trees) == bool(args.all):
        raise _UsageError("cli.usage", "name the trees to verify, or pass --all (not both)",
                          f"see `{PROG} audit verify --help`")
    as_json = bool(getattr(args, "json", False))
    # Each tree's result is written out as it is made, not held: a store of a million runs.
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, mode="w+", encoding="utf-8")
    separator = ""

    def keep(check: audit.TreeCheck) -> None:
        nonlocal separator
        if as_json:
            spool.write(separator + json_text(check.to_json()))
            separator = ", "
            return
        notes = ["programs bound" if check.programs_bound else "kernel rules only (programs not bound)"]
        if check.read_model != "absent":
            notes.append(f"read models {check.read_model.replace('_', ' ')}")
        state = "ok" if check.ok else "FAILED"
        spool.write(f"{check.tree_id}  {check.events} event(s)  {state}  ({'; '.join(notes)})\n")
        for problem in check.problems:
            spool.write(f"  position {problem.position}: {problem.rule}: {problem.detail}\n")

    store = ctx.open_store()
    try:
        tree_ids = audit.all_trees(store) if args.all else _unique(audit.tree_of(store, ref) for ref in args.trees)
        report = audit.verify(store, tree_ids, ctx.sources, progress=_ProgressLine(len(tree_ids)), on_check=keep,
                              whole_store=bool(args.all))
    except BaseException:
        spool.close()
        raise
    finally:
        store.close()
    status = 0 if report.ok else 1
    rate = report.events / report.seconds if report.seconds > 0 else 0.0
    summary = (f"verified {report.trees} tree(s), {report.events} event(s) in {report.seconds:.2f} s "
               f"({rate:,.0f} events/s): {'OK' if report.ok else 'FAILED'}")
    if not report.trees:
        summary = f"no trees in {redact(ctx.store_url)}"
    marker = uuid.uuid4().hex

    def write(out: TextIO) -> None:
        with spool:
            spool.seek(0)
            if as_json:
                before, after = json_text(report.to_json(results=marker)).split(json_text(marker), 1)
                out.write(before + "[")
                shutil.copyfileobj(spool, out, 1 << 20)
                out.write("]" + after + "\n")
            else:
                out.write(summary + "\n")
                shutil.copyfileobj(spool, out, 1 << 20)

    return Outcome(report.to_json(results=[]), summary, status, body=write)


class _ProgressLine:
    """Says on stderr how far a long store-wide command is (every ``PROGRESS_EVERY`` seconds):
    ``audit verify`` counts events (and their rate), ``snapshot`` the snapshots it wrote (and
    the trees' rate)."""

    def __init__(self, total: int, command: str = "audit verify", counted: str = "events") -> None:
        self.total = total
        self.command = command
        self.counted = counted
        self.ticker = Ticker()

    def __call__(self, trees: int, count: int) -> None:
        if trees == self.total or not self.ticker.due():
            return
        rated, unit = (count, "events") if self.counted == "events" else (trees, "trees")
        print(f"{PROG}: {self.command}: {trees:,} of {self.total:,} trees, {count:,} {self.counted} "
              f"({self.ticker.rate(rated):,.0f} {unit}/s)", file=sys.stderr, flush=True)


def _unique(tree_ids: Any) -> list[TreeID]:
    seen: dict[TreeID, None] = {}
    for tree_id in tree_ids:
        seen.setdefault(tree_id, None)
    return list(seen)


# ---------------------------------------------------------------------------
# audit drift


def cmd_audit_drift(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        tree_id = audit.tree_of(store, args.tree)
        report = audit.drift(store, tree_id, ctx.sources)
    finally:
        store.close()
    data = report.to_json()
    if report.drift is not None:
        d = report.drift
        lines = [
            f"DRIFT in {tree_id}: process {d.process_id} step {d.step} (position {d.position}) decides differently "
            f"with the current code",
            f"  first difference at position {d.differs_at}: {d.path}",
            "  recorded:",
            *[f"    {e['type']} {_short(e['body'], 300)}" for e in d.recorded],
            "  current code:",
            *[f"    {e['type']} {_short(e['body'], 300)}" for e in d.current],
        ]
        return Outcome(data, "\n".join(lines), 1)
    if report.error is not None:
        e = report.error
        text = (
            f"the current code cannot fold {tree_id}: position {e.position}: {e.rule}: {e.detail} "
            f"(after {report.decisions} matching decision(s))"
        )
        return Outcome(data, text, 1)
    return Outcome(
        data, f"no drift: the current code makes the same {report.decisions} decision(s) over {report.events} event(s)"
    )


# ---------------------------------------------------------------------------
# replay


def cmd_replay(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        tree_id = audit.tree_of(store, args.tree)
        replayed = audit.replay(store, tree_id, args.at, ctx.sources)
    finally:
        store.close()
    data = replayed.to_json()
    event = replayed.event
    lines = [
        f"{tree_id} at position {replayed.position} of {replayed.last}: {event['type']} of {event['process_id']} "
        f"({event['timestamp']})",
        f"  {_short(event['body'], 400)}",
        "",
        _show_text(replayed.tree),
    ]
    contexts = data["working_context"]
    assert isinstance(contexts, dict)
    for pid, context in contexts.items():
        lines += ["", f"working context of {pid}: {context['phase']}"]
        if context.get("messages") is not None:
            for message in context["messages"]:
                lines.append(f"  {message.get('role')}: {_short(message.get('content') or message, 200)}")
        request = context.get("model_request")
        if request:
            lines.append(
                f"  model call {request['model_call_sequence']} ({request['phase']}) sends {len(request['messages'])} "
                "message(s)"
            )
        upcoming = context.get("next_model_request")
        if upcoming:
            lines.append(f"  the next model request would contain {len(upcoming['messages'])} message(s)")
    if replayed.programs is None:
        lines += ["", "(the tree's programs are not bound here: kernel view, no strategy state)"]
    return Outcome(data, "\n".join(lines))


# ---------------------------------------------------------------------------
# export and import


def _position(text: str) -> int:
    """A position: an integer of at most 63 bits (a larger one cannot be stored anywhere);
    one past the tree's end is ``audit.position_out_of_range``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -(1 << 63) <= value < (1 << 63):
        raise argparse.ArgumentTypeError(f"{text} is beyond any position")
    return value


def _min_events(text: str) -> int:
    """``snapshot --min-events``: a whole number of events, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of events") from None
    if not 1 <= value < (1 << 63):
        raise argparse.ArgumentTypeError(f"{text} is not a number of events from 1")
    return value


def cmd_export(ctx: Context, args: argparse.Namespace) -> Outcome:
    as_json = bool(getattr(args, "json", False))
    if args.out is None and as_json:
        raise _UsageError("cli.usage", "without --out the export itself is printed; --json needs --out FILE")
    if args.out is not None and not args.out.strip():
        raise _UsageError("cli.usage", "--out is empty", "name the file to write, or leave --out out to print")
    store = ctx.open_store()
    try:
        tree_id = audit.tree_of(store, args.tree)
        lines = audit.export_lines(store, tree_id, ctx.sources)
    finally:
        store.close()
    text = "".join(lines)
    if args.out is None:
        return Outcome(None, text[:-1])  # the CLI ends the output with the last newline
    to_stdout = _names_stdout(Path(args.out))
    try:
        _write_atomically(Path(args.out), text.encode("ascii"))
    except BrokenPipeError:
        raise  # ``--out /dev/stdout`` and the reader went away: exit 141, as for any output
    except OSError as exc:
        if exc.errno in _WRITE_FAILURES:
            # Not the input: the file system could not take the file (a full disk). Exit 1, as
            # the same export written with ``> FILE`` fails (``cli.output_failed``).
            raise AgentfoldError(
                "export.write_failed", f"cannot write {args.out}: {exc.strerror or exc}; nothing was written "
                f"({args.out} is as it was)",
                "free space on that file system (or write elsewhere) and run the export again",
            ) from exc
        raise InvalidInput(
            "export.unwritable", f"cannot write {args.out}: {exc.strerror or exc}",
            "write to an existing directory you may write to; nothing was written",
        ) from exc
    events = len(lines) - 1  # the last line is the end line
    data: dict[str, JSON] = {"tree_id": tree_id, "events": events, "out": str(args.out)}
    report = f"exported {events} event(s) of {tree_id} to {args.out}"
    if to_stdout:
        # ``--out /dev/stdout``: the export is this command's output; its report on the same
        # stream would follow the end line (``export ... | import -`` refused it).
        def to_stderr(_: TextIO) -> None:
            sys.stderr.write((json_text(data) if as_json else report) + "\n")

        return Outcome(data, report, body=to_stderr)
    return Outcome(data, report)


#: Errors of the file system, not of the path ``--out`` names: the export fails with exit 1
#: (``export.write_failed``), as the same export redirected to a file does (``cli.output_failed``).
_WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def _names_stdout(path: Path) -> bool:
    """Whether ``path`` names this process's standard output (``/dev/stdout``, ``/proc/self/fd/1``,
    or the file or pipe it is)."""
    try:
        target, out = path.stat(), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):  # no such file yet, or no standard output
        return False
    return (target.st_dev, target.st_ino) == (out.st_dev, out.st_ino)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write the whole file or nothing (a reader never sees half an export), where a shell's
    ``>`` would write: through a symbolic link, to the file it names.

    The file gets the mode a plain write would give it (the mode of the file it replaces,
    else 0666 less the umask), not the temporary file's 0600. A device or a pipe
    (``--out /dev/stdout``) is written as it is: it cannot be replaced."""
    try:
        found: os.stat_result | None = path.stat()  # through the links
    except FileNotFoundError:
        found = None
    if found is not None and not stat.S_ISREG(found.st_mode):
        with open(path, "wb") as handle:
            handle.write(data)
        return
    target = path.resolve()
    if found is not None:
        mode = stat.S_IMODE(found.st_mode) & 0o777  # not its setuid/setgid/sticky bits
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def cmd_import(ctx: Context, args: argparse.Namespace) -> Outcome:
    try:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as exc:
        raise InvalidInput("import.unreadable", f"cannot read {args.file}: {exc.strerror}") from exc
    # Everything is verified before the store is even opened: a refused file writes nothing.
    tree_id, stored, folded = audit.check_export(data, ctx.sources, without_end=bool(args.without_end))
    store = ctx.open_store(create=True)
    try:
        report = audit.import_history(store, tree_id, stored, folded)
    finally:
        store.close()
    if report.written == 0:
        text = f"{tree_id}: the store already holds these {report.events} event(s); nothing changed"
    elif report.already:
        text = f"{tree_id}: appended {report.written} event(s) after the {report.already} already stored"
    else:
        text = f"imported {tree_id}: {report.written} event(s) into {redact(ctx.store_url)}"
    if not report.programs_bound:
        text += " (verified with the kernel rules only: its programs are not bound here)"
    return Outcome(report.to_json(), text)


# ---------------------------------------------------------------------------
# snapshot


def cmd_snapshot(ctx: Context, args: argparse.Namespace) -> Outcome:
    """Write a current snapshot of each tree whose loads fold ``--min-events`` events or more."""
    if bool(args.trees) == bool(args.all):
        raise _UsageError("cli.usage", "name the trees to snapshot, or pass --all (not both)",
                          f"see `{PROG} snapshot --help`")
    store = ctx.open_store()
    entries: list[dict[str, JSON]] = []
    try:
        store.check_writable()  # a read-only store: refused before any tree is folded
        tree_ids = audit.all_trees(store) if args.all else _unique(audit.tree_of(store, ref) for ref in args.trees)
        catalog = ctx.sources.catalog()
        progress = _ProgressLine(len(tree_ids), "snapshot", "snapshot(s) written")
        written = 0
        for tree_id in tree_ids:
            try:
                entries.append(_snapshot_tree(store, catalog, tree_id, args.min_events))
            except (StoreFailure, PersistenceError) as exc:
                # The store itself failed (an outage, the write lock held): every other tree
                # would wait as long, so it stops; what it wrote stays (a run again says current).
                raise _snapshot_stopped(exc, entries, len(tree_ids)) from exc
            written += entries[-1]["outcome"] == "written"
            progress(len(entries), written)
    finally:
        store.close()
    counts = {o: sum(1 for e in entries if e["outcome"] == o) for o in ("written", "current", "skipped", "failed")}
    summary = f"wrote {counts['written']} snapshot(s) of {len(entries)} tree(s)" + "".join(
        f"; {counts[o]} {o}" for o in ("current", "skipped", "failed") if counts[o])
    if not entries:
        summary = f"no trees in {redact(ctx.store_url)}"
    lines = [summary] + [f"{e['tree_id']}  {e['outcome']}: {e['reason']}" for e in entries]
    data: dict[str, JSON] = {"trees": list(entries), **counts}
    return Outcome(data, "\n".join(lines), 1 if counts["failed"] else 0)


def _snapshot_stopped(exc: StoreFailure | PersistenceError, entries: list[dict[str, JSON]], total: int) -> StoreFailure:
    """The store failed under ``agentfold snapshot``: stop, saying how far it got."""
    written = sum(1 for e in entries if e["outcome"] == "written")
    done = (f"stopped after {len(entries)} of {total} tree(s), {written} snapshot(s) written (they stay; run it "
            "again to go on: those trees are then current)")
    if isinstance(exc, StoreFailure):
        return StoreFailure(exc.code, f"{exc.message}; {done}", hint=exc.hint)
    if "database is locked" in str(exc):
        return StoreFailure(
            "store.unavailable", f"the store failed: {exc} (another process held the store's write lock for the whole "
            f"lock wait); {done}",
            hint="run it again once the process holding the lock has finished (a stopped or hung agentfold process, "
            "an open sqlite3 shell)",
        )
    return StoreFailure("store.unavailable", f"the store failed: {type(exc).__name__}: {recorded_text(exc)}; {done}",
                        hint="check that the store is reachable and writable, then run it again")


def _snapshot_tree(store: EventStore, catalog: Catalog, tree_id: TreeID | str, min_events: int) -> dict[str, JSON]:
    """One tree of ``agentfold snapshot``: its entry (``outcome`` written, current, skipped or failed)."""
    if not isinstance(tree_id, TreeID):
        return {"tree_id": tree_id, "outcome": "failed",
                "reason": "this is no tree id: rows of the tree index or of the events written by hand"}
    entry: dict[str, JSON] = {"tree_id": str(tree_id)}
    try:
        first = store.first_event(tree_id)
        started = first.event if first is not None else None
        if not isinstance(started, TreeStarted):
            return {**entry, "outcome": "failed", "reason": "it has no TreeStarted event at position 1"}
        try:
            programs = catalog.bound(catalog.load(started.program, started.configuration))
        except NotFound as exc:
            return {**entry, "outcome": "skipped", "reason": f"{exc.message}: a snapshot is written where the "
                    "tree's Programs are bound (their states are part of it)"}
        loaded = store.load(tree_id, programs)
        state = loaded.state
        folded = state.version - loaded.snapshot_version
        # Every child's Program is bound with the root's: the fold refuses a child outside its
        # parent's bindings, and the catalog binds all the root's, so every state is encoded.
        entry.update(version=state.version, snapshot_version=loaded.snapshot_version or None, folded=folded)
        if folded < min_events:
            since = f"its snapshot at version {loaded.snapshot_version}" if loaded.snapshot_version else "position 1"
            return {**entry, "outcome": "current", "reason": f"a load folds {folded} event(s) from {since}, fewer "
                    f"than --min-events {min_events}"}
        newest = store.snapshots.select_events(tree_id.uuid, desc=True, limit=1)
        if newest and newest[0].originator_version > state.version:
            # Loads read only the newest row: one written meanwhile by the tree's owner (a live
            # tree), or one beyond the tree's end (a history cut or restored by hand) that no
            # load can use and that would hide the one written here.
            return {**entry, "outcome": "skipped", "reason": f"a snapshot at version "
                    f"{newest[0].originator_version}, after the {state.version} folded, is the one loads read: "
                    "written meanwhile by the tree's owner, or beyond its end (`agentfold audit verify` says which)"}
        body = store.encode_snapshot(state, loaded.digest or "")
        if not store.write_snapshot(tree_id, state.version, body, replace=True):
            return {**entry, "outcome": "skipped", "reason": f"its snapshot would be {len(body)} bytes, above the "
                    f"{MAX_SNAPSHOT_BYTES} a reader takes (loads go on from the last one under the bound)"}
    except StoreFailure as exc:
        if not isinstance(exc, CorruptStream):
            raise  # the store itself failed: every other tree would too (cmd_snapshot stops)
        return {**entry, "outcome": "failed", "reason": f"{exc.code}: {exc.message}"}
    except AgentfoldError as exc:  # an unknown tree, a Program that refuses its history: the others go on
        return {**entry, "outcome": "failed", "reason": f"{exc.code}: {exc.message}"}
    except PersistenceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a Program's encode_state, say: that tree only
        return {**entry, "outcome": "failed", "reason": f"building its snapshot failed: {type(exc).__name__}: "
                f"{recorded_text(exc)}"}
    before = (f"the last usable one was at version {loaded.snapshot_version}" if loaded.snapshot_version
              else "there was no usable one")
    return {**entry, "outcome": "written", "reason": f"at version {state.version} ({before}; loads folded {folded} "
            "event(s))"}


# ---------------------------------------------------------------------------
# Registration


def register(command: Any) -> None:
    """Add this module's commands with ``command(name, handler, help, timeout=False)`` (agentfold.adapters.cli)."""
    audit_parser = command("audit", cmd_audit_verify, "verify histories and check new code against them (docs/audit.md)")
    actions = audit_parser.add_subparsers(
        dest="audit_command", metavar="ACTION", required=True, parser_class=type(audit_parser)
    )
    verify = actions.add_parser(
        "verify", help="recompute digest chains, check every fold rule, the tree index and the read models",
        description="Recompute each tree's digest chain from position 1, fold it with every rule, check the tree "
        "index and the read models; exit 1 if anything is wrong.",
    )
    _add_common(verify)
    verify.add_argument("trees", metavar="TREE", nargs="*", help="a tree id, a start id or a process id")
    verify.add_argument("--all", action="store_true", help="every tree of the store")
    verify.set_defaults(handler=cmd_audit_verify)
    drift = actions.add_parser(
        "drift", help="re-run decide over the recorded windows with the current code",
        description="Re-decide every recorded Step with the current Programs and report the first that differs.",
    )
    _add_common(drift)
    drift.add_argument("tree", metavar="TREE", help="a tree id, a start id or a process id")
    drift.set_defaults(handler=cmd_audit_drift)

    replay = command("replay", cmd_replay, "show the folded state of a tree at a position (no call of anything)")
    replay.add_argument("tree", metavar="TREE", help="a tree id, a start id or a process id")
    replay.add_argument("--at", type=_position, required=True, metavar="POSITION", help="the position (1 = TreeStarted)")

    export = command("export", cmd_export, "write a tree's stored events as JSON Lines (docs/audit.md)")
    export.add_argument("tree", metavar="TREE", help="a tree id, a start id or a process id")
    export.add_argument("--out", metavar="FILE", default=None, help="write to FILE (default: standard output)")

    snapshot = command(
        "snapshot", cmd_snapshot,
        "write a current snapshot of trees whose loads fold many events (after an upgrade, an import)",
    )
    snapshot.add_argument("trees", metavar="TREE", nargs="*", help="a tree id, a start id or a process id")
    snapshot.add_argument("--all", action="store_true", help="every tree of the store")
    snapshot.add_argument(
        "--min-events", type=_min_events, default=DEFAULT_SNAPSHOT_EVERY, metavar="N",
        help="only trees whose loads fold at least N events after their last usable snapshot (default "
        f"{DEFAULT_SNAPSHOT_EVERY}, a runtime's snapshot interval)",
    )

    imported = command("import", cmd_import, "verify an export file, then write it into --store in one append")
    imported.add_argument("file", metavar="FILE", help="a file written by `agentfold export` (- reads stdin)")
    imported.add_argument(
        "--without-end", action="store_true",
        help="accept a file without an end line (exports before 2026-12-01): nothing then shows it was not cut short",
    )


__all__ = ["register"]

