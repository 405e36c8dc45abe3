"""Host queries: the answers the CLI and the HTTP API give, from the read models or by folding.

Each answer is the JSON a host reads (docs/cli.md, docs/http-api.md). It comes from
the materialized tables when they exist and reflect every committed event (or at
least ``min_position``, when the caller waits for its own write), else from folding
the tree with the pure projections. Both paths produce the same entries: the tables
store exactly what ``projections.read_models`` computes.

A store-wide listing (runs, pending, unknown) that meets a tree whose history cannot be
read (``store.corrupt``) leaves it out and names it in ``Listing.corrupt``, on either
path: one damaged tree must not hide every other tree. On the tables' path these are the
trees the follower recorded corrupt (``agentfold_rm_corrupt_trees``: it has no other rows
of them) plus the lagging trees that fail to fold now. A question about that tree alone
still raises.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, overload

from adapters.catalog import Catalog
from adapters.eventstore import CorruptStream, EventStore, read_failure
from adapters.read_models import PENDING, UNKNOWN, ReadModels
from adapters.recorders import HeadFilter, TreeHead
from adapters.sources import ProgramSources
from domain.errors import NotFound, StoreFailure
from domain.events import TreeStarted
from domain.ids import TreeID
from domain.program import ProgramResolver
from domain.tree import TreeState
from projections.read_models import Entry, TreeRows, project_tree

PROG = "agentfold"
OVERLAY_LIMIT = 2000  # trees the tables may lag behind before a query folds everything instead


class Listing(list[Entry]):
    """A store-wide listing: the entries of every tree that could be read, in order, and
    ``corrupt``, one entry per tree whose stored history could not be read (see
    :func:`corrupt_tree_entry`): its entries are missing, so the answer is incomplete.

    A list, so callers that only want the entries keep working; ``corrupt`` is empty when
    every tree was read. (Slicing or copying gives a plain list: read ``corrupt`` first.)
    """

    def __init__(self, entries: Iterable[Entry] = (), corrupt: Iterable[Entry] = ()) -> None:
        super().__init__(entries)
        self.corrupt: list[Entry] = list(corrupt)


def corrupt_tree_entry(exc: CorruptStream, head: TreeHead | None) -> Entry:
    """How a listing names a tree it could not read: the fold's or decoder's position and rule."""
    return {
        "tree_id": str(exc.tree_id),
        "start_id": head.start_id if head is not None else None,
        "code": exc.code,
        "position": exc.position,
        "rule": exc.rule,
        "detail": exc.detail,
    }


def corrupt_tree_error(entry: Entry, consequence: str = "its entries are missing from this answer") -> StoreFailure:
    """One named corrupt tree as an error, for front ends that report it (CLI stderr, logs);
    ``consequence`` says what it means for the command that met it."""
    tree = entry["tree_id"]
    start = f" (start {entry['start_id']})" if entry.get("start_id") else ""
    return StoreFailure(
        str(entry["code"]),
        f"tree {tree}{start} is corrupt at position {entry['position']}: {entry['rule']}: {entry['detail']}; "
        f"{consequence}",
        hint=f"see what is wrong with `{PROG} audit verify {tree}`",
        tree_id=tree, start_id=entry.get("start_id"), position=entry["position"], rule=entry["rule"],
    )


@dataclass(slots=True)
class Fresh:
    """Rows of the trees the read models have not caught up with, folded at query time.

    ``corrupt``: the trees the follower recorded corrupt, and the lagging trees whose
    history could not be folded (their rows in the tables, if any, are stale too):
    listings leave them out and name the tree; ``created`` holds their creation positions too.
    """

    rows: dict[str, TreeRows] = field(default_factory=dict)
    created: dict[str, int] = field(default_factory=dict)
    corrupt: dict[str, CorruptStream] = field(default_factory=dict)

    def skipped(self, tree_id: str) -> bool:
        """Whether the tables' rows of this tree must not be used (refolded, or corrupt)."""
        return tree_id in self.rows or tree_id in self.corrupt


class HostQueries:
    """Read-only questions about one store's runs."""

    def __init__(self, store: EventStore, sources: ProgramSources, *, read_models: ReadModels | None = None,
                 use_read_models: bool = True) -> None:
        self.store = store
        self.sources = sources
        self._read_models = read_models
        self._use_read_models = use_read_models and store.backend in ("sqlite", "postgresql")
        # Trees folded while the tables lagged behind them: a long-lived reader (a server) that
        # answers many requests during a follower's catch-up reuses them (two requests that
        # miss at once may both fold). Dropped once the tables catch up with the tree. Readers
        # share these rows: callers must not change what a query returns.
        self._folded_rows: collections.OrderedDict[str, TreeRows] = collections.OrderedDict()
        self._folded_lock = threading.Lock()

    # -- which path ------------------------------------------------------------

    def read_models(self) -> ReadModels | None:
        """The store's read models, if a follower ever wrote them (opening never creates them)."""
        if not self._use_read_models:
            return None
        if self._read_models is None:
            if not ReadModels.exist(self.store):
                return None
            self._read_models = ReadModels(self.store, create=False)
        return self._read_models

    def current(self, min_position: int | None = None, wait: float = 0.0) -> ReadModels | None:
        """The read models if they reflect every committed event (or ``min_position``)."""
        models = self.read_models()
        if models is None:
            return None
        target = self.store.max_notification_id() if min_position is None else min_position
        if models.position() >= target:
            return models
        if wait > 0 and models.wait_for(target, wait):
            return models
        return None

    def fold(self, tree_id: TreeID) -> tuple[TreeState, ProgramResolver | None]:
        """Fold a tree with its Programs when they can be bound, else the kernel's view."""
        catalog: Catalog = self.sources.catalog()
        first = self.store.read(tree_id, upto=1)
        if not first:
            raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")
        started = first[0].event
        if isinstance(started, TreeStarted):
            try:
                catalog.load(started.program, started.configuration)
                return self.store.load(tree_id, catalog.resolve).state, catalog.resolve
            except (NotFound, CorruptStream):
                pass
        return self.store.load(tree_id).state, None

    # -- lookups ---------------------------------------------------------------

    def tree_of(self, ref: str) -> TreeID:
        """A tree id, a start id or a process id, to its tree id."""
        return self.store.find_tree(ref)

    def tree_of_process(self, process_id: str) -> TreeID:
        return self.store.find_process_tree(process_id)

    # -- the tables, brought up to the store's head ----------------------------

    def view(self, min_position: int | None = None) -> tuple[ReadModels, Fresh] | None:
        """The read models plus fresh rows for every tree they have not caught up with.

        The tables answer for every tree the follower has projected up to the store's
        head; the trees with events after the tables' position (usually a handful: the
        follower is milliseconds behind) are folded now. So an answer is never stale, and
        its cost is the tables' plus the lag's, not a fold of every tree (which trees changed
        is read without the events' states, and this object keeps what it folded, so a
        lagging tree is folded again only when it has changed). None when there are no
        tables, or when they lag so far behind that folding everything is cheaper.
        """
        models = self.read_models()
        if models is None:
            return None
        position = models.position()
        head = self.store.max_notification_id()
        if min_position is not None:
            head = max(head, min_position)
        fresh = Fresh()
        for found in models.corrupt_trees():
            # Recorded by the follower, which skips the tree from then on: named by listings,
            # raised by a question about it, never folded again here.
            fresh.corrupt[found.tree_id] = CorruptStream(found.tree_id, found.position, found.rule, found.detail)
            fresh.created[found.tree_id] = found.created_position
        if position >= head:
            self._forget_folded(())  # caught up: nothing kept is needed any more
            return models, fresh
        # tree -> [the notification that created it (0: created before the tables' position),
        # its last position up to ``head``]; read without the events' states
        changed: dict[TreeID, list[int]] = {}
        after = position
        while after < head:
            batch = self.store.changes(after, head)
            if not batch:
                break
            for change in batch:
                seen = changed.get(change.tree_id)
                if seen is not None:
                    seen[1] = max(seen[1], change.high)
                elif str(change.tree_id) not in fresh.corrupt:
                    changed[change.tree_id] = [change.first if change.low == 1 else 0, change.high]
                    if len(changed) > OVERLAY_LIMIT:
                        return None
            after = max(change.last for change in batch)
        self._forget_folded(str(tree_id) for tree_id in changed)
        for tree_id, (first, version) in changed.items():
            key = str(tree_id)
            fresh.created[key] = first or models.created_position(key)
            rows = self._folded(key, version)
            if rows is None:
                try:
                    tree, programs = self.fold(tree_id)
                except CorruptStream as exc:
                    # One damaged tree must not take every other tree's answer down with it:
                    # listings name it, a question about this tree alone raises it.
                    fresh.corrupt[key] = exc
                    continue
                rows = project_tree(tree, programs)
                self._keep_folded(key, rows)
            fresh.rows[key] = rows
        return models, fresh

    def _folded(self, tree_id: str, version: int) -> TreeRows | None:
        """Rows this object folded earlier for a lagging tree, if they reach ``version``."""
        with self._folded_lock:
            rows = self._folded_rows.get(tree_id)
            if rows is None or rows.version < version:
                return None
            self._folded_rows.move_to_end(tree_id)
            return rows

    def _keep_folded(self, tree_id: str, rows: TreeRows) -> None:
        with self._folded_lock:
            kept = self._folded_rows.get(tree_id)
            if kept is not None and kept.version > rows.version:
                return  # a request that folded later finished first: keep the newer rows
            self._folded_rows[tree_id] = rows
            self._folded_rows.move_to_end(tree_id)
            while len(self._folded_rows) > OVERLAY_LIMIT:
                self._folded_rows.popitem(last=False)

    def _forget_folded(self, lagging: Iterable[str]) -> None:
        """Drop what was kept for the trees the tables have caught up with (not in ``lagging``)."""
        keep = set(lagging)
        with self._folded_lock:
            if not self._folded_rows:
                return
            for tree_id in [t for t in self._folded_rows if t not in keep]:
                del self._folded_rows[tree_id]

    def _corrupt(self, fresh: Fresh, relevant: Callable[[TreeHead | None], bool],
                 within: Callable[[int], bool] = lambda created: True) -> list[tuple[int, Entry]]:
        """The lagging corrupt trees a listing names, with their creation positions.

        ``relevant`` applies the fold path's own choice of trees (by index row), so both
        paths name the same trees.
        """
        named: list[tuple[int, Entry]] = []
        for tree_id, exc in fresh.corrupt.items():
            created = fresh.created[tree_id]
            if not within(created):
                continue
            head = self.store.head(TreeID(tree_id))
            if relevant(head):
                named.append((created, corrupt_tree_entry(exc, head)))
        named.sort(key=lambda pair: pair[0])
        return named

    # -- questions -------------------------------------------------------------

    def runs(self, *, status: str | None = None, classification: str | None = None, limit: int = 100,
             after: int = 0, min_position: int | None = None,
             view: tuple[ReadModels, Fresh] | bool | None = True) -> Listing:
        """Runs in creation order (``cursor`` of the last entry pages on).

        Cursors from the tables are the runs' ``created_position``; from folding (no
        tables) they count the runs that match the filters, in index order. ``view`` lets a
        caller that already chose the path pass it (False: fold). A tree whose history cannot be read is left
        out and named in ``corrupt`` by the page whose range holds it (matching the
        filters by its index row).
        """
        if view is True:
            view = self.view(min_position)

        wanted = HeadFilter(status=status, classification=classification)

        def matches(head: TreeHead | None) -> bool:
            if head is None:
                return status is None and classification is None
            return wanted.keeps(head)

        if isinstance(view, tuple):
            models, fresh = view
            # Rows of refolded or corrupt trees are replaced or dropped; ask for enough rows
            # to fill the page anyway.
            stored = models.runs(status=status, classification=classification,
                                 limit=limit + len(fresh.rows) + len(fresh.corrupt), after=after)
            entries = [e for e in stored if not fresh.skipped(e["tree_id"])]
            for tree_id, rows in fresh.rows.items():
                run = rows.run
                created = fresh.created[tree_id]
                if created <= after or (status is not None and run["status"] != status):
                    continue
                if classification is not None and run["classification"] != classification:
                    continue
                entries.append({**run, "cursor": created})
            entries.sort(key=lambda e: int(e["cursor"]))
            page = entries[:limit]
            # A full page ends at its last run: a corrupt tree after it belongs to a later page.
            last = int(page[-1]["cursor"]) if len(page) == limit else None
            corrupt = self._corrupt(fresh, matches, lambda created: created > after and (last is None or created <= last))
            return Listing(page, (e for _, e in corrupt))
        # A page of the index, filtered and paged in the database (the cursor counts the runs
        # that match the filters); a tree that cannot be read is named and another takes its place.
        out = Listing()
        position = after
        while len(out) < limit:
            heads = self.store.heads(only=dataclasses.replace(wanted, offset=position, limit=limit - len(out)))
            for head in heads:
                position += 1
                try:
                    tree, _ = self.fold(TreeID(head.tree_id))
                except CorruptStream as exc:
                    out.corrupt.append(corrupt_tree_entry(exc, head))
                    continue
                out.append({**project_tree(tree).run, "cursor": position})
            if not heads:
                break
        return out

    def _rows(self, tree_id: TreeID, min_position: int | None) -> tuple[Entry, TreeRows | None, ReadModels | None]:
        """One tree's run entry, and either its fresh rows or the tables to read them from.

        The tables answer when their row of this tree is as recent as the tree's index row
        (read first: a tree only grows, and its index row is written with its events), else
        this tree alone is folded: a question about one run never pays for the rest of the
        tables' lag (``min_position`` is then met too: the answer reflects the tree's head).
        """
        models = self.read_models()
        if models is not None:
            for found in models.corrupt_trees():
                if found.tree_id == str(tree_id):
                    # Recorded by the follower, which has no other rows of it: a question
                    # about this tree alone fails, as a fold would.
                    raise CorruptStream(found.tree_id, found.position, found.rule, found.detail)
            head = self.store.head(tree_id)
            run = models.run(str(tree_id))
            if run is not None and head is not None and int(run["version"]) >= head.version:
                return run, None, models
            kept = self._folded(str(tree_id), head.version) if head is not None else None
            if kept is not None:
                return kept.run, kept, None
        tree, programs = self.fold(tree_id)
        rows = project_tree(tree, programs)
        if models is not None:
            self._keep_folded(str(tree_id), rows)
        return rows.run, rows, None

    def run(self, tree_id: TreeID, *, min_position: int | None = None) -> Entry:
        return self._rows(tree_id, min_position)[0]

    def results(self, tree_id: TreeID, *, min_position: int | None = None) -> Entry:
        """SettledResults of every open round of the tree."""
        run, rows, models = self._rows(tree_id, min_position)
        if not any(p.get("interaction") for p in run["processes"]):
            raise NotFound(
                "engine.program.unavailable",
                f"tree {tree_id} runs no Interaction this store's Programs can bind",
                hint="results exist for Interaction runs (scenarios, compiled Interactions)",
            )
        rounds = rows.rounds if rows is not None else models.rounds(str(tree_id))  # type: ignore[union-attr]
        return {"tree_id": tree_id, "rounds": rounds}

    def delegates(self, process_id: str, *, min_position: int | None = None) -> Entry:
        """Delegate attributions of one Interaction; ``found`` says whether it is one."""
        tree_id = self.tree_of_process(process_id)
        run, rows, models = self._rows(tree_id, min_position)
        if not any(p["process_id"] == process_id for p in run["processes"]):
            raise NotFound("engine.process.not_found", f"process {process_id} is not in tree {tree_id}")
        found = any(p["process_id"] == process_id and p.get("interaction") for p in run["processes"])
        if rows is not None:
            entries = [d for d in rows.delegates if d["process_id"] == process_id]
        else:
            entries = models.delegates(process_id)  # type: ignore[union-attr]
        return {"process_id": process_id, "found": found, "delegates": entries}

    @overload
    def pending(self, tree_id: None = None, *, min_position: int | None = None) -> Listing: ...
    @overload
    def pending(self, tree_id: TreeID, *, min_position: int | None = None) -> list[Entry]: ...

    def pending(self, tree_id: TreeID | None = None, *, min_position: int | None = None) -> list[Entry]:
        """Current tool input waits: of one tree, or of every run in creation order.

        Of every run: a :class:`Listing`, whose ``corrupt`` names the live trees that could
        not be read (one tree raises ``store.corrupt`` instead).
        """
        if tree_id is not None:
            _, rows, models = self._rows(tree_id, min_position)
            return rows.pending if rows is not None else models.pending(str(tree_id))  # type: ignore[union-attr]
        return self._listing("pending", PENDING, min_position)

    @overload
    def unknown(self, tree_id: None = None, *, min_position: int | None = None) -> Listing: ...
    @overload
    def unknown(self, tree_id: TreeID, *, min_position: int | None = None) -> list[Entry]: ...

    def unknown(self, tree_id: TreeID | None = None, *, min_position: int | None = None) -> list[Entry]:
        """Unknown effects of live Processes: of one tree, or of every run in creation order.

        Of every run: a :class:`Listing`, whose ``corrupt`` names the trees with unknown
        effects (by their index rows) that could not be read.
        """
        if tree_id is not None:
            _, rows, models = self._rows(tree_id, min_position)
            return rows.unknown if rows is not None else models.unknown(str(tree_id))  # type: ignore[union-attr]
        return self._listing("unknown", UNKNOWN, min_position)

    def _listing(self, member: str, table: str, min_position: int | None) -> Listing:
        """Every run's entries of one kind, runs in creation order; corrupt trees named."""

        def relevant(head: TreeHead | None) -> bool:
            # Only a tree with an unknown effect (per its index row) can list one; a tool
            # input wait can exist in any live tree (a sibling call may still be running).
            # Both paths pick the trees they read (and so the corrupt trees they name) so.
            if head is None:
                return True  # no index row to judge by: name it rather than hide it
            if head.classification == "terminal":
                return False
            return member != "unknown" or bool(head.unknown_effect_ids)

        view = self.view(min_position)
        if view is not None:
            models, fresh = view
            listed = [(created, e) for created, tree, e in models.ordered(table) if not fresh.skipped(tree)]
            for tree, rows in fresh.rows.items():
                listed.extend((fresh.created[tree], e) for e in getattr(rows, member))
            listed.sort(key=lambda pair: pair[0])  # stable: a tree's entries keep their order
            return Listing((e for _, e in listed), (e for _, e in self._corrupt(fresh, relevant)))
        entries = Listing()
        for head in self.store.heads(live_only=True):
            if not relevant(head):
                continue
            try:
                state, programs = self.fold(TreeID(head.tree_id))
            except CorruptStream as exc:
                entries.corrupt.append(corrupt_tree_entry(exc, head))
                continue
            entries.extend(getattr(project_tree(state, programs), member))
        return entries

    def position(self) -> dict[str, Any]:
        """The store's last notification id and the read models' tracking position."""
        try:
            head = self.store.max_notification_id()
        except Exception as exc:
            raise read_failure(exc, "reading the notification log") from exc
        models = self.read_models()
        return {"store": head, "read_models": models.position() if models is not None else None}
