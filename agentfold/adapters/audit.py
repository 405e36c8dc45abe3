"""Audit and replay over one store: verification, time travel, exact export/import, drift.

* :func:`verify` reads every event of a tree from position 1 (never a snapshot),
  recomputes the digest chain, folds with every rule (with the tree's Programs bound
  when the sources can bind them, so Interaction invariants are checked too), checks
  the tree index (version, head digest, root status, classification, unknown effects,
  process lookups) and, when the read models exist, that their rows equal the pure
  projections of the fold at the version they reflect.
* :func:`replay` folds a tree up to a position and returns its state: no Runtime, no
  dispatcher, nothing but reads of the store.
* :func:`export_lines` / :func:`import_history` move one tree's stored records, byte
  for byte, as JSON Lines (docs/audit.md "Export format"); an import verifies the whole
  file before it writes anything and writes in one append with the tree index.
* :func:`drift` re-runs the current ``decide`` over the recorded windows
  (``agentfold.domain.drift``).

What each check proves, and what it does not, is in docs/audit.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from eventsourcing.persistence import IntegrityError, PersistenceError, StoredEvent

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import STATE_COMPRESSOR, DecodeError, OrjsonTranscoder, PydanticMapper, stored_json
from agentfold.adapters.eventstore import CorruptStream, EventStore, decode_snapshot, read_failure
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.recorders import EVENTS_TABLE, MALFORMED_VERSION, PROCESSES_TABLE, IndexHeadMismatch, TreeHead
from agentfold.adapters.runtime import index_head
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.canonical import JSON, digest_of
from agentfold.domain.drift import DriftReport, find_drift, first_difference
from agentfold.domain.errors import AgentfoldError, InvalidInput, NotFound, Rejected, StoreFailure
from agentfold.domain.events import TreeEvent, TreeStarted, event_body, event_version
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.integrity import SealError, unseal
from agentfold.domain.program import ProgramResolver
from agentfold.domain.tree import FoldError, TreeState
from agentfold.projections.read_models import project_tree
from agentfold.projections.working_context import working_contexts

PROG = "agentfold"


# ---------------------------------------------------------------------------
# Findings


@dataclass(frozen=True, slots=True)
class Finding:
    """One broken rule: the tree, the position where it shows, the rule and why."""

    tree: str
    position: int
    rule: str
    detail: str

    def to_json(self) -> dict[str, JSON]:
        return {"tree": self.tree, "position": self.position, "rule": self.rule, "detail": self.detail}


@dataclass(slots=True)
class TreeCheck:
    """The verification of one tree."""

    tree_id: str
    events: int = 0
    programs_bound: bool = False
    read_model: str = "absent"
    """``equal``, ``mismatch``, ``not_projected`` (no row yet, the read models are behind) or
    ``absent`` (this store has no read models); ``skipped`` when the history itself is broken;
    ``unchecked`` when the rows differ from the kernel-only projection of a run whose Programs
    are not bound here (they were projected with them)."""
    problems: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree": self.tree_id,
            "ok": self.ok,
            "events": self.events,
            "programs_bound": self.programs_bound,
            "read_model": self.read_model,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass(slots=True)
class VerifyReport:
    """What ``verify`` found: ``checks`` holds every tree's check in order, unless ``verify``
    handed each to its ``on_check`` (then none is held: a store-wide run stays small)."""

    checks: list[TreeCheck] = field(default_factory=list)
    seconds: float = 0.0
    trees: int = 0
    events: int = 0
    first_error: Finding | None = None
    """The first problem of the first failing tree."""

    @property
    def ok(self) -> bool:
        return self.first_error is None

    def add(self, check: TreeCheck) -> None:
        self.trees += 1
        self.events += check.events
        if self.first_error is None and check.problems:
            self.first_error = check.problems[0]

    def to_json(self, results: JSON | None = None) -> dict[str, JSON]:
        """The report; ``results`` in place of the held checks' (see ``cli_audit``)."""
        first = self.first_error
        return {
            "ok": self.ok,
            "trees": self.trees,
            "events": self.events,
            "first_error": first.to_json() if first is not None else None,
            "results": [c.to_json() for c in self.checks] if results is None else results,
            "seconds": round(self.seconds, 6),
        }


# ---------------------------------------------------------------------------
# Which trees


def tree_of(store: EventStore, ref: str) -> TreeID:
    """A tree id, a process id or a start id, to a tree that has events or an index row."""
    candidates: list[TreeID] = []
    if ref.startswith("tree:"):
        candidates.append(TreeID(ref))  # identity.invalid when malformed, as every command says it
    else:
        found = store.tree_of_process(ref) if ref.startswith("process:") else None
        if found is not None:
            candidates.append(found)
        try:
            candidates.append(TreeID.for_start(StartID(ref)))
        except InvalidInput:
            if not candidates:
                raise  # neither a process of this store nor a valid start id: as ``show`` says it
        except ValueError:
            pass
    for tree_id in candidates:
        if store.head(tree_id) is not None or _raw(store, tree_id, limit=1):
            return tree_id
    raise NotFound(
        "engine.tree.not_found", f"no tree, start id or process {ref!r} in this store",
        hint=f"list trees with `{PROG} trees`",
    )


def all_trees(store: EventStore) -> list[TreeID | str]:
    """Every tree of the store: the index's, then any that has events but no index row. An
    index row whose tree id is no tree id (written by hand) is listed as its text: ``verify``
    reports it as a failing tree of its own and goes on with the others."""
    trees: list[TreeID | str] = []
    seen: set[str] = set()
    for text in store.index.select_tree_ids():
        try:
            tree: TreeID | str = TreeID(text)
        except InvalidInput:
            tree = text
        if tree not in seen:
            seen.add(tree)
            trees.append(tree)
    for tree_id in _event_trees(store):
        if tree_id not in seen:
            seen.add(tree_id)
            trees.append(tree_id)
    return trees


def _started_since(store: EventStore, text: str) -> TreeID | None:
    """The tree named ``text`` when the store has it now (an index row or any event): one
    started after ``all_trees`` listed the store; None when the store does not have it."""
    try:
        tree_id = TreeID(text)
    except InvalidInput:
        return None
    if store.head(tree_id) is not None or _raw(store, tree_id, limit=1):
        return tree_id
    return None


def _event_trees(store: EventStore) -> list[TreeID | ForeignOriginator]:
    """Distinct trees of the events table (a tree whose index row is gone is still audited)."""
    if store.backend == "memory":
        return []
    with store.factory.datastore.transaction(commit=False) as c:
        c.execute(f"SELECT DISTINCT originator_id AS o FROM {EVENTS_TABLE}")
        rows = c.fetchall()
    out: list[TreeID | ForeignOriginator] = []
    for row in rows:
        value = row["o"]
        if isinstance(value, uuid.UUID):
            out.append(TreeID.from_uuid(value))
            continue
        text = str(value)
        try:
            parsed = uuid.UUID(text)
        except ValueError:
            parsed = None
        if parsed is None or parsed.hex != text:  # every SQLite writer stores uuid.hex
            out.append(ForeignOriginator(text if value is not None else "NULL"))
        else:
            out.append(TreeID.from_uuid(parsed))
    return out


class ForeignOriginator(str):
    """An events-table originator id no writer stores (SQLite: not 32 lowercase hex digits):
    rows written by hand. ``verify`` reports them as a failing entry of their own."""


def _raw(store: EventStore, tree_id: TreeID, *, upto: int | None = None, limit: int | None = None,
         after: int | None = None) -> list[StoredEvent]:
    try:
        return list(store.recorder.select_events(tree_id.uuid, gt=after, lte=upto, limit=limit))
    except PersistenceError as exc:
        raise read_failure(exc, f"reading tree {tree_id}") from exc


def consistent_read(store: EventStore, tree_id: TreeID, attempts: int = 20) -> tuple[TreeHead | None, list[StoredEvent]]:
    """The tree's index row and its stored events, as of one moment.

    The index row is read before and after the events: every append changes it, so
    equal rows mean no append committed in between (a live tree is read again).
    """
    for _ in range(attempts):
        before = store.head(tree_id)
        stored = _raw(store, tree_id)
        after = store.head(tree_id)
        if before == after:
            return before, stored
        time.sleep(0.01)
    raise StoreFailure(
        "audit.tree_busy", f"tree {tree_id} kept changing while it was read", hint="try again when it is idle"
    )


# ---------------------------------------------------------------------------
# The history: chain and fold, from position 1


def programs_for(catalog: Catalog, first: TreeEvent | None) -> ProgramResolver | None:
    """The tree's Programs when the catalog binds them (or rebuilds them from the stored configuration)."""
    if not isinstance(first, TreeStarted):
        return None
    try:
        program = catalog.load(first.program, first.configuration)
    except AgentfoldError:  # not bound here, or its stored configuration no longer loads
        return None
    return catalog.bound(program)  # the fold holds its Programs however many trees follow


Watcher = Callable[[TreeState, ProgramResolver | None, str | None], None]


@dataclass(slots=True)
class Folded:
    """A stream read and folded from position 1 until its end or its first broken rule."""

    state: TreeState
    programs: ProgramResolver | None
    digest: str | None = None
    events: list[tuple[int, TreeEvent]] = field(default_factory=list)
    timestamps: list[str] = field(default_factory=list)
    problem: Finding | None = None


def fold_stored(
    tree_id: TreeID,
    stored: Sequence[StoredEvent],
    mapper: PydanticMapper,
    catalog: Catalog,
    *,
    watch: Mapping[int, Sequence[Watcher]] | None = None,
    keep: bool = False,
) -> Folded:
    """Check positions, decode and verify the chain of, and fold ``stored`` (one tree, in order).

    ``watch`` maps positions to callbacks called with the folded tree, its Programs and
    the chain digest right after that position.
    ``keep`` keeps the decoded events and their timestamps (import, drift).
    """
    programs: ProgramResolver | None = None
    if stored and stored[0].originator_version == 1:
        try:
            programs = programs_for(catalog, mapper.decode(tree_id, stored[0], None).event)
        except DecodeError:
            programs = None  # position 1 itself is broken: the loop names the rule
    folded = Folded(TreeState(programs), programs)
    state = folded.state
    digest: str | None = None
    expected = 1
    name = str(tree_id)
    for record in stored:
        position = record.originator_version
        if position != expected:
            again = ", again: a record repeated or out of order" if position < expected else ""
            folded.problem = Finding(
                name, expected, "integrity.missing_event",
                f"position {expected} is missing (the next stored position is {position}{again})",
            )
            break
        try:
            decoded = mapper.decode(tree_id, record, digest, canonical=True)
            state.apply(decoded.event, position)
        except DecodeError as exc:
            folded.problem = Finding(name, exc.position, exc.rule, exc.detail)
            break
        except FoldError as exc:
            folded.problem = Finding(name, exc.position, exc.rule, exc.detail)
            break
        digest = decoded.digest
        if keep:
            folded.events.append((position, decoded.event))
            folded.timestamps.append(decoded.timestamp)
        if watch and position in watch:
            for watcher in watch[position]:
                watcher(state, programs, digest)
        expected += 1
    folded.digest = digest
    if folded.problem is None:
        folded.problem = _unfinished_step(name, state)
    return folded


def _unfinished_step(tree: str, state: TreeState) -> Finding | None:
    """A history ends between whole Steps: every append holds a Step with everything that follows it."""
    unfinished = state.unfinished_step()
    return None if unfinished is None else Finding(tree, *unfinished)


def _index_findings(tree_id: TreeID, head: TreeHead | None, folded: Folded, store: EventStore) -> list[Finding]:
    """The tree index must name the end of the chain and agree with the fold at that end."""
    name = str(tree_id)
    last = folded.state.version
    if head is None:
        return [Finding(name, last, "index.head_mismatch", "the tree index has no row for this tree")]
    if head.version == MALFORMED_VERSION:
        return [
            Finding(
                name, max(last, 1), "index.head_mismatch",
                f"the tree index's version is not a number (head digest {head.head_digest}): it was changed by "
                f"hand; the stream ends at position {last}",
            )
        ]
    if head.version != last:
        return [
            Finding(
                name, min(head.version, last) + 1, "index.head_mismatch",
                f"the tree index says version {head.version} ({head.head_digest}) but the stream ends at "
                f"position {last}",
            )
        ]
    if head.head_digest != folded.digest:
        return [
            Finding(
                name, last, "index.head_mismatch",
                f"the tree index's head digest {head.head_digest} is not the digest {folded.digest} of position {last}",
            )
        ]
    expected = index_head(folded.state, tree_id, [], "")
    for column in ("start_id", "root_process_id", "program", "status", "classification", "unknown_effect_ids"):
        stored, folded_value = getattr(head, column), getattr(expected, column)
        if stored != folded_value:
            return [
                Finding(
                    name, last, "index.row_mismatch",
                    f"the tree index's {column} is {stored!r}; the fold at position {last} gives {folded_value!r}",
                )
            ]
    for pid in folded.state.processes:
        owner = store.index.tree_of_process(pid)  # the row's text, a tree id or not
        if owner != tree_id:
            return [
                Finding(
                    name, last, "index.process_mismatch",
                    f"process {pid} is indexed under {owner or 'no tree'}, not this tree",
                )
            ]
    # A row left by a history cut back before its Process was created (an append creating it
    # again is refused), or written by hand. Unless an append since the read created it.
    extra = [indexed for indexed in store.processes_of_tree(tree_id) if indexed not in folded.state.processes]
    if extra and store.head(tree_id) == head:
        return [
            Finding(
                name, last, "index.process_mismatch",
                f"process {extra[0]} is indexed under this tree, but the tree's history has no such Process",
            )
        ]
    return []


def _latest_snapshot(store: EventStore, tree_id: TreeID) -> tuple[int, bytes] | None:
    try:
        rows = store.snapshots.select_events(tree_id.uuid, desc=True, limit=1)
    except PersistenceError as exc:
        raise read_failure(exc, f"reading the snapshots of tree {tree_id}") from exc
    # A NULL state (edited by hand) is read as no bytes: the check reports the snapshot malformed.
    return (rows[0].originator_version, bytes(rows[0].state or b"")) if rows else None


def _without_state(tree: Any) -> Any:
    """A snapshot's tree without strategy states (a fold without Programs has none)."""
    return {**tree, "processes": [{k: v for k, v in p.items() if k != "state"} for p in tree.get("processes", [])]}


def _snapshot_findings(
    tree_id: TreeID, snapshot: tuple[int, bytes], seen: tuple[Any, str | None, bool, dict[str, str]] | None, last: int,
    programs: ProgramResolver | None, store: EventStore,
) -> list[Finding]:
    """The latest storage snapshot (what loads start from) must be the fold at its version, and
    read back (as a load reads it) rebuild the fold's inputs: ``seen`` is the fold's compact JSON
    there (as a snapshot holds it), its digest, whether Programs were bound, and the digests of the
    inputs it holds as changes (``_rebuilt_inputs``)."""
    version, body = snapshot
    name = str(tree_id)
    if seen is None or version > last:
        return [Finding(name, version, "snapshot.mismatch",
                        f"a snapshot claims version {version}; the stream ends at position {last}")]
    folded_tree, digest, bound, folded_inputs = seen
    try:
        stored = decode_snapshot(body)
    except (orjson.JSONDecodeError, KeyError, TypeError, SealError) as exc:
        return [Finding(name, version, "snapshot.mismatch", f"the snapshot at version {version} is malformed: {exc}")]
    if stored.format == -1:
        return [Finding(name, version, "snapshot.mismatch",
                        f"the snapshot at version {version} is malformed: its format is not a number")]
    if not store.reads_snapshot_format(tree_id, stored.format, version):
        return []  # another release's format: loads do not start from it (they fold the events)
    stored_tree, stored_digest = stored.tree, stored.digest
    if stored_digest != digest:
        return [Finding(name, version, "snapshot.mismatch",
                        f"the snapshot names digest {stored_digest}; position {version} has {digest}")]
    if not bound:
        stored_tree, folded_tree = _without_state(stored_tree), _without_state(folded_tree)
    path = first_difference(stored_tree, folded_tree)
    if path is not None:
        return [Finding(name, version, "snapshot.mismatch",
                        f"the snapshot at version {version} differs from the fold at {path}")]
    if not stored.sealed:
        return [Finding(name, version, "snapshot.mismatch",
                        f"the snapshot at version {version} does not match its seal (loads do not use it)")]
    # Equal to the fold, yet a load must also read it back (a Program's decode_state may refuse
    # the very state its fold reached: loads would then fold from the first event), and the
    # inputs it rebuilds (those stored as changes: the JSON holds the changes) must be the fold's.
    try:
        read = TreeState.from_json(stored.tree, programs)
    except Exception as exc:  # noqa: BLE001 - whatever a Program's decode_state raises
        return [Finding(name, version, "snapshot.mismatch",
                        f"the snapshot at version {version} equals the fold but cannot be read back "
                        f"({type(exc).__name__}: {exc}); loads fold from the first event instead")]
    rebuilt = _rebuilt_inputs(read)
    for pid in sorted(set(rebuilt) | set(folded_inputs)):
        if rebuilt.get(pid) != folded_inputs.get(pid):
            return [Finding(name, version, "snapshot.mismatch",
                            f"the snapshot at version {version} equals the fold but reads back as another tree "
                            f"(the input of {pid}, stored as changes, rebuilds differently): loads start from it")]
    return []


def _rebuilt_inputs(state: TreeState) -> dict[str, str]:
    """The digest of each input a tree holds as changes (``ProcessState.input_patch``), by Process:
    a digest each, not a copy (a team's Turns repeat each other: copies grew with the square)."""
    return {str(p.process_id): digest_of(p.input) for p in state.processes.values() if p.input_patch is not None}


def _normalized(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value))


def verify_tree(
    store: EventStore, tree_id: TreeID, catalog: Catalog, read_models: ReadModels | None = None,
    *, models_current: bool = False, check_index: bool = True, check_snapshot: bool = True,
) -> tuple[TreeCheck, Folded, list[StoredEvent]]:
    """Verify one tree (see the module docstring); also returns the fold and the stored records."""
    check = TreeCheck(str(tree_id))
    rows: dict[str, Any] | None = None
    seen: dict[str, Any] = {}
    watch: dict[int, list[Watcher]] = {}
    # Rows and snapshot first, events after: a live tree only grows, so the events read
    # reach every version these reflect.
    counted: tuple[int, int] | None = None
    faults: list[str] = []
    if read_models is not None:
        first = store.tree_notifications(tree_id, 1, 1)  # where the run row must say the tree was created
        rows, counted, faults = read_models.tree_rows_counted(  # as of one moment
            str(tree_id), first[0].id if first and first[0].originator_version == 1 else None)
        check.read_model = "not_projected" if rows["run"] is None else "pending"
    snapshot = _latest_snapshot(store, tree_id) if check_snapshot else None
    head, stored = consistent_read(store, tree_id)

    def capture_rows(state: TreeState, programs: ProgramResolver | None, digest: str | None) -> None:
        seen["rows"] = _normalized(project_tree(state, programs).to_json())

    at = int(rows["version"]) if rows is not None and rows["run"] is not None else 0
    if at:
        watch.setdefault(at, []).append(capture_rows)
    if snapshot is not None:

        def capture_snapshot(state: TreeState, programs: ProgramResolver | None, digest: str | None) -> None:
            seen["snapshot"] = (_normalized(state.to_json(compact=True)), digest, programs is not None,
                                _rebuilt_inputs(state))

        watch.setdefault(snapshot[0], []).append(capture_snapshot)
    folded = fold_stored(tree_id, stored, store.mapper, catalog, watch=watch)
    check.events = folded.state.version
    check.programs_bound = folded.programs is not None
    if not stored and head is not None:
        folded.problem = Finding(
            str(tree_id), 1, "integrity.missing_event",
            f"the tree index names version {head.version} but no event of the tree is stored",
        )
    if folded.problem is not None:
        check.problems.append(folded.problem)
        if read_models is not None:
            check.read_model = "skipped"
        return check, folded, stored
    if check_index:
        check.problems.extend(_index_findings(tree_id, head, folded, store))
    if snapshot is not None:
        check.problems.extend(
            _snapshot_findings(tree_id, snapshot, seen.get("snapshot"), folded.state.version, folded.programs, store)
        )
    if rows is not None:
        last = folded.state.version
        if rows["run"] is None:
            if models_current:
                check.read_model = "mismatch"
                recorded = next((c for c in read_models.corrupt_trees() if c.tree_id == str(tree_id)), None) \
                    if read_models is not None else None
                check.problems.append(
                    Finding(str(tree_id), last, "read_model.mismatch",
                            "the read models are current but hold no row for this tree" if recorded is None else
                            f"the read models recorded this tree corrupt at position {recorded.position} "
                            f"({recorded.rule}) and hold no row of it, but it verifies now (repaired?): "
                            "`agentfold project --rebuild` projects it again")
                )
        elif at > last:
            check.read_model = "mismatch"
            check.problems.append(
                Finding(str(tree_id), last, "read_model.mismatch",
                        f"the read models reflect version {at}, beyond the stream's end at {last}")
            )
        else:
            expected = seen["rows"]
            if rows.get("gates", ()) is None:
                # Tables an older follower wrote, without the InputGates table (the next follower
                # to open them creates and fills it): nothing of it to compare.
                rows = {k: v for k, v in rows.items() if k != "gates"}
                expected = {k: v for k, v in expected.items() if k != "gates"}
            path = first_difference(_normalized(rows), expected)
            unchecked = False
            if path is not None and folded.programs is None:
                # Rows a deployment projected with its Programs bound (an Interaction's rounds,
                # delegates, tool inputs, its unknown calls' requests) may differ from the
                # kernel-only projection this run can compute there: not damage it can see. Said,
                # not failed (verify with the deployment's console script, which binds them); the
                # run entry, the unknown Effects and the rows' own columns are still checked.
                path = first_difference(_kernel_view(rows), _kernel_view(expected))
                unchecked = path is None
            if unchecked:
                check.read_model = "unchecked"
            elif path is None:
                check.read_model = "equal"
            else:
                check.read_model = "mismatch"
                check.problems.append(
                    Finding(str(tree_id), at, "read_model.mismatch",
                            f"the stored rows differ from the projection of the fold at position {at} at {path}")
                )
            if faults:
                check.read_model = "mismatch"
                check.problems.extend(
                    Finding(str(tree_id), at, "read_model.mismatch", f"a stored row's columns are damaged: {fault}")
                    for fault in faults
                )
            # The follower's count of the events it applied to the tree must be its version
            # (read in the rows' own transaction).
            if counted is not None and counted[0] == at and counted[1] != at:
                check.read_model = "mismatch"
                check.problems.append(
                    Finding(str(tree_id), at, "read_model.mismatch",
                            f"the read models counted {counted[1]} events applied to this tree for version {at} "
                            "(events_projected must equal version: events applied twice or skipped)")
                )
            recorded = next((c for c in read_models.corrupt_trees() if c.tree_id == str(tree_id)), None) \
                if read_models is not None else None
            if recorded is not None:
                # The follower drops a tree's rows when it records it corrupt: both at once is damage,
                # and the listings leave the tree out as corrupt while it verifies.
                check.read_model = "mismatch"
                check.problems.append(
                    Finding(str(tree_id), at, "read_model.mismatch",
                            f"the read models hold rows of this tree but also record it corrupt at position "
                            f"{recorded.position} ({recorded.rule}), so the listings leave it out as corrupt; it "
                            "verifies: `agentfold project --rebuild` projects it again")
                )
    return check, folded, stored


def _kernel_view(rows: Any) -> dict[str, Any]:
    """What of a tree's read-model rows the kernel alone projects, whatever Programs projected
    them: the tree, its version, the run entry, which Effects are unknown and the InputGates (an Interaction's
    rounds, delegates, tool inputs and its unknown calls' requests need its Program)."""
    if not isinstance(rows, dict):
        return {"rows": rows}
    unknown, run = rows.get("unknown"), rows.get("run")
    if isinstance(run, dict) and isinstance(run.get("processes"), list):
        # Whether a Process is an Interaction is known from its Program only.
        run = {**run, "processes": [{k: v for k, v in p.items() if k != "interaction"} if isinstance(p, dict) else p
                                    for p in run["processes"]]}
    return {
        "tree_id": rows.get("tree_id"), "version": rows.get("version"), "run": run,
        "unknown": [u.get("effect_id") if isinstance(u, dict) else u for u in unknown]
        if isinstance(unknown, list) else unknown,
        "gates": rows.get("gates"),  # told by their waits: the kernel's fold has them
    }


def verify(
    store: EventStore, tree_ids: Sequence[TreeID | str], sources: ProgramSources,
    progress: Callable[[int, int], None] | None = None, on_check: Callable[[TreeCheck], None] | None = None,
    *, whole_store: bool = False,
) -> VerifyReport:
    """Verify each tree; the first problem of the first failing tree is the report's first error.
    ``whole_store`` (``tree_ids`` are ``all_trees``): rows of the read models that name no tree of
    the store are failing entries too.

    ``progress(trees, events)`` is called after each tree with the trees and events verified so far.
    With ``on_check``, each tree's check goes to it as soon as it is made, and the report holds none."""
    started = time.perf_counter()
    catalog = sources.catalog()
    read_models: ReadModels | None = None
    current = False
    if ReadModels.exist(store):
        read_models = ReadModels(store, create=False)
        current = read_models.is_current()
    report = VerifyReport()

    def emit(check: TreeCheck) -> None:
        report.add(check)
        if on_check is None:
            report.checks.append(check)
        else:
            on_check(check)

    for tree_id in tree_ids:
        if isinstance(tree_id, TreeID):
            check = verify_tree(store, tree_id, catalog, read_models, models_current=current)[0]
        elif isinstance(tree_id, ForeignOriginator):  # event rows under an id no writer stores (``all_trees``)
            check = TreeCheck(tree_id, read_model="skipped" if read_models is not None else "absent", problems=[
                Finding(tree_id, 1, "integrity.format",
                        f"the events table holds rows under originator id {str(tree_id)!r}, which is not a tree id "
                        "as agentfold stores one (32 lowercase hex digits): they were written by hand; the read-model "
                        "followers and the store-wide listings fail on them or count them into a tree: delete them "
                        "(or restore the store)")])
        else:  # an index row whose tree id is no tree id (``all_trees``)
            check = TreeCheck(tree_id, read_model="skipped" if read_models is not None else "absent", problems=[
                Finding(tree_id, 1, "index.row_mismatch",
                        f"the tree index holds a row whose tree id {tree_id!r} is not a tree id: it was written by "
                        "hand; no tree's history is read under it")])
        emit(check)
        if progress is not None:
            progress(report.trees, report.events)
    known = {str(t) for t in tree_ids}
    # Rows under a tree the store does not have, by tree: one failing entry per tree, with a
    # finding for each index that holds some.
    orphans: dict[str, list[Finding]] = {}
    orphan_read_models: set[str] = set()
    if whole_store and read_models is not None:
        # Rows of a tree the store does not have (written by hand, or left by a deleted history):
        # the listings would show them, a delegate attribution twice.
        for orphan in sorted(read_models.tree_ids_with_rows() - known):
            orphan_read_models.add(orphan)
            orphans.setdefault(orphan, []).append(
                Finding(orphan, 1, "read_model.mismatch",
                        f"the read models hold rows of tree {orphan!r}, which the store does not have (no event, "
                        "no index row): `agentfold project --rebuild` rebuilds the tables from the store"))
    if whole_store:
        # Process rows under a tree the store does not have (written by hand, or left when a
        # history and its index row were deleted): a process id of theirs names a tree that is
        # not there (`show`, `cancel`, the HTTP API).
        for tree_text, first, count in _process_row_trees(store):
            if tree_text in known:
                continue
            orphans.setdefault(tree_text, []).append(
                Finding(tree_text, 1, "index.process_mismatch",
                        f"the process index holds {count} row(s) under tree {tree_text!r} (process {first} first), "
                        "which the store does not have (no event, no index row): written by hand, or left when the "
                        "tree's history and index row were deleted; such a process id names a tree that is not "
                        "there: delete the rows (or restore the store)"))
    for orphan in sorted(orphans):
        started_since = _started_since(store, orphan)
        if started_since is not None:
            # A run started while the others were verified (a live store's followers wrote
            # its rows meanwhile): verified now, as the trees listed at the start were.
            emit(verify_tree(store, started_since, catalog, read_models, models_current=current)[0])
            continue
        if orphan in orphan_read_models:
            verdict = "mismatch"
        else:
            verdict = "skipped" if read_models is not None else "absent"
        emit(TreeCheck(orphan, read_model=verdict, problems=orphans[orphan]))
    report.seconds = time.perf_counter() - started
    return report


def _process_row_trees(store: EventStore) -> list[tuple[str, str, int]]:
    """Each tree id of the process index with its first Process id and its number of rows."""
    if store.backend == "memory":
        return []  # written only by appends
    try:
        with store.factory.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT tree_id AS t, MIN(process_id) AS p, COUNT(*) AS n FROM {PROCESSES_TABLE} GROUP BY tree_id")
            rows = c.fetchall()
    except PersistenceError as exc:
        raise read_failure(exc, "reading the process index") from exc
    return [("NULL" if row["t"] is None else str(row["t"]), str(row["p"]), int(row["n"])) for row in rows]


# ---------------------------------------------------------------------------
# Replay


@dataclass(frozen=True, slots=True)
class Replay:
    tree: TreeState
    programs: ProgramResolver | None
    position: int
    last: int
    event: dict[str, JSON]

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree_id": self.tree.tree_id,
            "position": self.position,
            "version": self.last,
            "programs_bound": self.programs is not None,
            "event": self.event,
            "tree": self.tree.to_json(shown=True),
            "working_context": working_contexts(self.tree, self.programs),
        }


def replay(store: EventStore, tree_id: TreeID, position: int, sources: ProgramSources) -> Replay:
    """The folded state of a tree right after ``position``: reads only, nothing is dispatched."""
    if position < 1:
        raise InvalidInput("audit.position_out_of_range", f"position {position} is before the first event (1)",
                           hint="positions start at 1")
    records = store.read(tree_id, upto=position)  # verifies the chain up to the position
    if not records:
        if store.first_event(tree_id) is None:  # store.corrupt when later events or its index row remain
            raise NotFound("engine.tree.not_found", f"tree {tree_id} has no events")
    head = store.head(tree_id)
    if len(records) < position:
        if head is not None and head.version >= position:
            # The index row proves the position was written: the tail was cut (as a load says it).
            raise CorruptStream(
                tree_id, len(records) + 1, "index.head_mismatch",
                f"the tree index says version {head.version} ({head.head_digest}) but the stream ends at "
                f"position {len(records)}",
            )
        raise InvalidInput(
            "audit.position_out_of_range",
            f"tree {tree_id} has positions 1..{len(records)}; there is no position {position}",
            hint=f"pick a position between 1 and {len(records)}",
        )
    if head is None or head.version < position:
        # Past the end the row anchors (the row was read after the events: a live tree's only
        # grows), or no row: damage every load refuses; the state is not shown as the tree's.
        _check_end(store, tree_id, head, position, records[position - 1].digest)
    last = max(head.version if head is not None else 0, position)
    programs = programs_for(sources.catalog(), records[0].event)
    tree = _fold_records(tree_id, records, programs)
    if tree is None:  # the current Programs do not fold this history: show the kernel's view
        programs = None
        tree = _fold_records(tree_id, records, None)
        assert tree is not None
    record = records[-1]
    event = {
        "position": record.position,
        "type": record.type,
        "schema_version": event_version(record.event),
        "process_id": record.event.process_id,
        "timestamp": record.timestamp,
        "digest": record.digest,
        "body": _normalized(event_body(record.event)),
    }
    return Replay(tree, programs, position, last, event)


def _fold_records(tree_id: TreeID, records: Sequence[Any], programs: ProgramResolver | None) -> TreeState | None:
    tree = TreeState(programs)
    for record in records:
        try:
            tree.apply(record.event, record.position)
        except FoldError as exc:
            if programs is not None:
                return None
            raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
    return tree


# ---------------------------------------------------------------------------
# Export and import


EXPORT_MEMBERS = frozenset({"tree", "position", "topic", "state"})
#: The last line of an export: how many records the file holds and the digest of the last,
#: so that a file cut after any line (a whole history up to there, which verifies) is refused.
END_MEMBERS = frozenset({"tree", "end"})


def end_line(tree_id: TreeID, records: Sequence[StoredEvent]) -> str:
    """The end line of an export of ``records`` (verified: the last one's recorded digest)."""
    digest = unseal(stored_json(records[-1].state)).digest
    body = {"end": {"events": len(records), "head_digest": digest}, "tree": str(tree_id)}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"


def export_line(tree_id: TreeID, record: StoredEvent) -> str:
    """One stored record as one JSON Lines line (ASCII; ``state`` is the record's sealed JSON
    text, inflated when it is stored compressed)."""
    state = stored_json(record.state)
    try:
        text = state.decode("utf-8")
    except UnicodeDecodeError as exc:  # a verified history is canonical JSON, hence UTF-8
        raise StoreFailure("audit.export_invalid", f"position {record.originator_version} is not UTF-8") from exc
    body = {"position": record.originator_version, "state": text, "topic": record.topic, "tree": str(tree_id)}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"


def export_lines(store: EventStore, tree_id: TreeID, sources: ProgramSources) -> list[str]:
    """A verified tree's records as JSON Lines; a history that fails verification is refused.

    The snapshot is not exported (it is a cache), so its check does not stand in the way.
    """
    check, _, stored = verify_tree(store, tree_id, sources.catalog(), check_snapshot=False)
    if check.problems:
        problem = check.problems[0]
        raise CorruptStream(str(tree_id), problem.position, problem.rule, problem.detail)
    return [*(export_line(tree_id, record) for record in stored), end_line(tree_id, stored)]


def parse_export(data: bytes) -> tuple[TreeID, list[StoredEvent], dict[str, Any] | None]:
    """Parse an export file (one tree's records, positions in order, then its end line); the
    format only. Returns the tree, its records and the end line's ``end`` (None: no end line,
    as in files of releases before 2026-12-01)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput("import.format", f"the file is not UTF-8 text: {exc}") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise InvalidInput("import.format", "the file holds no records", hint="export a tree with `agentfold export`")
    tree_id: TreeID | None = None
    stored: list[StoredEvent] = []
    end: dict[str, Any] | None = None
    for number, line in enumerate(lines, start=1):
        try:
            body = json.loads(line, object_pairs_hook=_distinct_members)
        except _RepeatedMember as exc:
            raise InvalidInput("import.format", f"line {number} has the member {exc.key!r} twice in one object",
                               hint="a JSON parser keeps the last one without a word: export the tree again",
                               line=number) from exc
        except (ValueError, RecursionError) as exc:  # also a number of more than 4,300 digits, or deep nesting
            reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise InvalidInput("import.format", f"line {number} is not JSON: {reason}", line=number) from exc
        if isinstance(body, dict) and set(body) == END_MEMBERS:
            if number != len(lines):
                what = "empty lines follow it" if not "".join(lines[number:]).strip() else "more lines follow"
                raise InvalidInput("import.format", f"line {number} is an end line, but {what}", line=number)
            end = _end_of(body, number)
            break
        if not isinstance(body, dict) or set(body) != EXPORT_MEMBERS:
            raise InvalidInput(
                "import.format", f"line {number} must be an object with exactly {sorted(EXPORT_MEMBERS)}", line=number
            )
        position, topic, state, tree = body["position"], body["topic"], body["state"], body["tree"]
        if not isinstance(position, int) or isinstance(position, bool) or position < 1:
            raise InvalidInput("import.format", f"line {number}: position must be a positive integer", line=number)
        if not isinstance(topic, str) or not isinstance(state, str) or not isinstance(tree, str):
            raise InvalidInput("import.format", f"line {number}: tree, topic and state must be text", line=number)
        try:
            this_tree = TreeID(tree)
            state_bytes = state.encode("utf-8")
        except (ValueError, UnicodeEncodeError, InvalidInput) as exc:
            raise InvalidInput("import.format", f"line {number}: {exc}", line=number) from exc
        if tree_id is None:
            tree_id = this_tree
        elif this_tree != tree_id:
            raise InvalidInput(
                "import.format", f"line {number} belongs to {this_tree}, the file started with {tree_id}",
                hint="an export file holds one tree", line=number,
            )
        # Stored as the store's own writer stores it (compressed when that pays).
        stored.append(StoredEvent(tree_id.uuid, position, topic, STATE_COMPRESSOR.compress(state_bytes)))
    if tree_id is None:
        raise InvalidInput("import.format", "the file holds no records", hint="export a tree with `agentfold export`")
    if end is not None and end["tree"] != str(tree_id):
        raise InvalidInput("import.format", f"the end line names {end['tree']}, the records {tree_id}")
    return tree_id, stored, end


class _RepeatedMember(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _distinct_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of an export line (a record's members, an end line's): each member once."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedMember(key)
            seen.add(key)
    return value


def _end_of(body: dict[str, Any], number: int) -> dict[str, Any]:
    """The end line's members, checked for shape: ``{"tree", "events", "head_digest"}``."""
    spec = body["end"]
    count = spec.get("events") if isinstance(spec, dict) else None
    digest = spec.get("head_digest") if isinstance(spec, dict) else None
    if (not isinstance(spec, dict) or set(spec) != {"events", "head_digest"} or not isinstance(count, int)
            or isinstance(count, bool) or count < 1 or not isinstance(digest, str) or not isinstance(body["tree"], str)):
        raise InvalidInput(
            "import.format",
            f'line {number}: an end line is {{"end": {{"events": N, "head_digest": D}}, "tree": T}}, N the number '
            "of records (at least 1)",
            line=number,
        )
    return {"tree": body["tree"], "events": count, "head_digest": digest}


def _end_problem(end: dict[str, Any] | None, folded: Folded) -> Finding | None:
    """Whether the verified records are the whole history the file's end line names (a file
    without one was refused before its records were folded, unless ``without_end``)."""
    state, name = folded.state, str(folded.state.tree_id)
    if end is None:
        return None
    if end["events"] != state.version:
        return Finding(
            name, min(end["events"], state.version) + 1, "integrity.end",
            f"the end line says {end['events']} record(s), the file holds {state.version}: it was cut or extended",
        )
    if end["head_digest"] != folded.digest:
        return Finding(
            name, state.version, "integrity.end",
            f"the end line's head digest {end['head_digest']} is not the last record's {folded.digest}",
        )
    return None


@dataclass(frozen=True, slots=True)
class ImportReport:
    tree_id: TreeID
    events: int
    written: int
    already: int
    programs_bound: bool

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree_id": self.tree_id,
            "events": self.events,
            "written": self.written,
            "already_present": self.already,
            "changed": self.written > 0,
            "programs_bound": self.programs_bound,
        }


def check_export(
    data: bytes, sources: ProgramSources, *, without_end: bool = False
) -> tuple[TreeID, list[StoredEvent], Folded]:
    """Parse and verify a whole export file (chain and every fold rule) without any store."""
    tree_id, stored, end = parse_export(data)
    if end is None and not without_end:
        # Before the fold: a file cut short is a file cut short wherever the cut fell (in the
        # middle of a Step, its fold would otherwise report the half Step first).
        raise InvalidInput(
            "import.format",
            f"the file has no end line after its {len(stored)} record(s): it was cut short, or written by an "
            "export before 2026-12-01",
            hint="export the tree again; a whole file of an earlier release imports with --without-end",
        )
    mapper = PydanticMapper(transcoder=OrjsonTranscoder())  # the store's own decoding and checks
    folded = fold_stored(tree_id, stored, mapper, sources.catalog(), keep=True)
    if folded.problem is None and stored[0].originator_version != 1:
        folded.problem = Finding(str(tree_id), 1, "integrity.missing_event", "the file does not start at position 1")
    if folded.problem is None:  # a sound history: is it all of the one exported?
        folded.problem = _end_problem(end, folded)
    if folded.problem is not None:
        p = folded.problem
        raise InvalidInput(
            "import.corrupt",
            f"the file's history of {tree_id} breaks {p.rule} at position {p.position}: {p.detail}; nothing was written",
            tree=p.tree, position=p.position, rule=p.rule,
        )
    return tree_id, stored, folded


def import_history(store: EventStore, tree_id: TreeID, stored: Sequence[StoredEvent], folded: Folded) -> ImportReport:
    """Write a verified history into ``store`` in one append (with its index row); idempotent.

    Records the store already holds identically are skipped; a store whose history of
    the tree differs anywhere is refused (``import.conflict``) and nothing is written.
    The tree's index row must anchor a point of the file's history (its version and head
    digest): a history cut under its row is restored only by the history the row proves
    (the row and the Process rows the cut left are kept), never by another continuation;
    the row is written only while it still holds what was read (another writer meanwhile:
    compare again).
    """
    bound = folded.programs is not None
    for _ in range(3):
        existing = _raw(store, tree_id)
        for mine, theirs in zip(stored, existing, strict=False):
            if theirs.originator_version != mine.originator_version:
                # The store's history skips a position (a row deleted by hand): named as the gap it
                # is, not as the next record differing from the file's.
                raise Rejected(
                    "import.conflict",
                    f"the store's history of {tree_id} has no event at position {mine.originator_version} (its next "
                    f"is position {theirs.originator_version}): it was cut; nothing was written",
                    hint="see what the store holds with `agentfold audit verify`; restore the store from a backup, "
                    "or import into another store",
                    tree=str(tree_id), position=mine.originator_version,
                )
            try:
                theirs_json = stored_json(theirs.state)
            except SealError:
                theirs_json = None  # a damaged row in the store: it is not what the file holds
            if (mine.originator_version, mine.topic, stored_json(mine.state)) != (
                theirs.originator_version, theirs.topic, theirs_json
            ):
                raise Rejected(
                    "import.conflict",
                    f"the store holds a different history of {tree_id}: position {theirs.originator_version} differs; "
                    "nothing was written",
                    hint="import into another store, or verify both histories with `agentfold audit verify`",
                    tree=str(tree_id), position=theirs.originator_version,
                )
        if len(existing) >= len(stored):
            _refuse_short_of_a_cut(store, tree_id, len(existing), len(stored))
            return ImportReport(tree_id, len(stored), 0, len(stored), bound)
        try:
            expect = _anchor_on_the_file(store, tree_id, stored)
        except Rejected:
            if _raw(store, tree_id, after=len(existing), limit=1):
                # Appended since the compare (another import of this history, a longer one, ran
                # beside this one): the row moved with it; compare again.
                continue
            raise
        new = list(stored[len(existing):])
        new_events = [event for _, event in folded.events[len(existing):]]
        head = index_head(folded.state, tree_id, new_events, folded.timestamps[-1])
        indexed = set(store.processes_of_tree(tree_id))  # also when the cut left no event
        head = dataclasses.replace(
            head, head_digest=folded.digest or "", created_at=folded.timestamps[0], updated_at=folded.timestamps[-1],
            # The Processes of a cut history are indexed already, under this tree: those rows stay.
            new_processes=tuple(pid for pid in head.new_processes if pid not in indexed),
            expect=None if store.backend == "memory" else expect or (0, ""),
        )
        try:
            store.recorder.insert_events(new, head=head)
        except IndexHeadMismatch:
            continue  # the row changed since it was read: compare again
        except IntegrityError:
            for pid in head.new_processes:  # a Process of the file that another tree has already
                owner = store.index.tree_of_process(pid)  # the row's text, a tree id or not
                if owner is not None and owner != tree_id:
                    raise Rejected(
                        "import.conflict",
                        f"process {pid} of {tree_id} is a process of another tree in this store ({owner}); "
                        "nothing was written",
                        hint="import into another store, or verify both histories with `agentfold audit verify`",
                        tree=str(tree_id), process_id=pid,
                    ) from None
            continue  # another writer appended meanwhile: compare again
        except PersistenceError as exc:
            raise StoreFailure("store.append_failed", f"importing tree {tree_id} failed: {exc}") from exc
        return ImportReport(tree_id, len(stored), len(new), len(existing), bound)
    raise StoreFailure("audit.import_contended", f"tree {tree_id} kept changing while it was imported")


def _malformed_anchor(digest: str) -> str:
    return f"a version that is not a number (head digest {digest}): it was changed by hand"


def _refuse_short_of_a_cut(store: EventStore, tree_id: TreeID, kept: int, records: int) -> None:
    """A file no longer than what the store keeps of a tree whose index row anchors a later
    end (a history cut under its row) restores nothing: refused, where "nothing changed"
    would leave the operator believing the tree whole."""
    try:
        anchor = store.anchors([tree_id]).get(tree_id)
    except PersistenceError as exc:
        raise read_failure(exc, f"reading the index row of tree {tree_id}") from exc
    if anchor is None or (anchor[0] != MALFORMED_VERSION and anchor[0] <= kept):
        return
    version, digest = anchor
    if version != MALFORMED_VERSION and _raw(store, tree_id, after=version - 1, limit=1):
        return  # appended since the events were read (a live tree): its row and events commit together
    if version == MALFORMED_VERSION:
        what = _malformed_anchor(digest)
    else:
        what = (f"position {version} with head digest {digest}, but the store keeps only {kept} event(s) of it: "
                "its history was cut")
    raise Rejected(
        "import.conflict",
        f"the store's index row of {tree_id} anchors {what}; the file's {records} record(s) do not mend it; "
        "nothing was written",
        hint="import the tree's export taken before the cut (it passes through the row's end), or see what the "
        "store holds with `agentfold audit verify`",
        tree=str(tree_id), position=max(version, 1),
    )


def _anchor_on_the_file(store: EventStore, tree_id: TreeID, stored: Sequence[StoredEvent]) -> tuple[int, str] | None:
    """The end (version, head digest) the tree's index row anchors, when it is a point of the
    file's history; None without a row. A row anchoring anything else (a position the file
    does not reach, another digest there, a version that is no number) proves a history the
    file is not: refused (``import.conflict``), nothing written."""
    try:
        anchor = store.anchors([tree_id]).get(tree_id)
    except PersistenceError as exc:
        raise read_failure(exc, f"reading the index row of tree {tree_id}") from exc
    if anchor is None:
        return None
    version, digest = anchor
    if 1 <= version <= len(stored):
        try:
            if unseal(stored_json(stored[version - 1].state)).digest == digest:
                return version, digest
        except SealError:  # pragma: no cover - the file was verified before
            pass
        where = f"position {version} with head digest {digest}, which is not the file's record there"
    elif version == MALFORMED_VERSION:
        where = _malformed_anchor(digest)
    else:
        where = f"position {version} with head digest {digest}, past the file's {len(stored)} record(s)"
    raise Rejected(
        "import.conflict",
        f"the store's index row of {tree_id} anchors {where}: the store recorded another history (cut or "
        "changed since); nothing was written",
        hint="import into another store, or see what the store holds with `agentfold audit verify`",
        tree=str(tree_id), position=max(version, 1),
    )


# ---------------------------------------------------------------------------
# Drift


def drift(store: EventStore, tree_id: TreeID, sources: ProgramSources) -> DriftReport:
    """Re-decide every recorded Step of a tree with the sources' current Programs.

    The history's chain is verified first (a broken chain is a corrupt stream, not
    drift); a fold rule the current code breaks is the report's ``error``.
    """
    head, stored = consistent_read(store, tree_id)
    if not stored:
        if store.first_event(tree_id) is None:  # store.corrupt when its index row remains
            raise NotFound("engine.tree.not_found", f"tree {tree_id} has no events")
    decoded = _decode_all(store, tree_id, stored)
    _check_end(store, tree_id, head, len(stored), unseal(stored_json(stored[-1].state)).digest)
    catalog = sources.catalog()
    programs = programs_for(catalog, decoded[0][1])
    if programs is None:
        first = decoded[0][1]
        name = first.program.name if isinstance(first, TreeStarted) else "?"
        raise NotFound(
            "engine.program.unavailable",
            f"the current code binds no program for tree {tree_id} ({name}): there is nothing to compare",
            hint="run the command with the sources (catalog) that hold the new version of the program",
        )
    return find_drift(decoded, programs, tree_id=str(tree_id))


def _check_end(store: EventStore, tree_id: TreeID, head: TreeHead | None, version: int, digest: str | None) -> None:
    """The history read ends where the tree's index row anchors (as every load checks it): a
    history cut between Steps, or events past the row, is ``store.corrupt`` (index.head_mismatch),
    not drift of the code or a state to show."""
    if head is None or head.version != version or head.head_digest != digest:
        raise store._head_mismatch(tree_id, None if head is None else (head.version, head.head_digest), version, digest)


def _decode_all(store: EventStore, tree_id: TreeID, stored: Sequence[StoredEvent]) -> list[tuple[int, TreeEvent]]:
    out: list[tuple[int, TreeEvent]] = []
    digest: str | None = None
    for record in stored:
        try:
            decoded = store.mapper.decode(tree_id, record, digest)
        except DecodeError as exc:
            raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
        out.append((decoded.position, decoded.event))
        digest = decoded.digest
    return out


__all__ = [
    "Finding",
    "ImportReport",
    "Replay",
    "TreeCheck",
    "VerifyReport",
    "all_trees",
    "check_export",
    "consistent_read",
    "drift",
    "end_line",
    "export_line",
    "export_lines",
    "fold_stored",
    "import_history",
    "parse_export",
    "replay",
    "tree_of",
    "verify",
    "verify_tree",
]

