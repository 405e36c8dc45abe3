"""Host queries: the answers the CLI and the HTTP API give, from the read models or by folding.

Each answer is the JSON a host reads (docs/cli.md, docs/http-api.md). It comes from
the materialized tables when they exist and reflect every committed event (or at
least ``min_position``, when the caller waits for its own write), else from folding
the tree with the pure projections. Both paths produce the same entries: the tables
store exactly what ``agentfold.projections.read_models`` computes.

A store-wide listing (runs, pending, unknown) that meets a tree whose history cannot be
read (``store.corrupt``) leaves it out and names it in ``Listing.corrupt``, on either
path: one damaged tree must not hide every other tree. On the tables' path these are the
trees the follower recorded corrupt (``agentfold_rm_corrupt_trees``: it has no other rows
of them) plus the lagging trees that fail to fold now. A question about that tree alone
still raises.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, overload

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import CorruptStream, EventStore, read_failure
from agentfold.adapters.read_models import GATES, PENDING, UNKNOWN, ReadModels
from agentfold.adapters.recorders import HeadFilter, TreeHead
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.errors import InvalidInput, NotFound, StoreFailure
from agentfold.domain.events import TreeStarted
from agentfold.domain.ids import TreeID
from agentfold.domain.program import ProgramResolver
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import gate_inputs
from agentfold.projections.read_models import Entry, TreeRows, project_tree

PROG = "agentfold"
OVERLAY_LIMIT = 2000  # trees the tables may lag behind before a query folds everything instead
#: A page of a store-wide listing read by folding (no read models) stops after folding this
#: many runs, with a ``next_after`` even when it found no entry: one request never folds
#: every live run of a large store.
FOLD_PAGE_RUNS = 1000
_FOLD_BATCH = 100  # index rows read at a time by a folding page
_LAST_ORD = 1 << 62  # above any row's ``ord``: (created, _LAST_ORD) is past every row of that run


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


class ListingPage(Listing):
    """One page of a store-wide listing (:meth:`HostQueries.pending_page`,
    :meth:`HostQueries.unknown_page`): ``next_after`` is the cursor to pass as ``after``
    for the next page (None: this page is the last). A run's entries are never split
    between pages."""

    def __init__(self, entries: Iterable[Entry] = (), corrupt: Iterable[Entry] = (),
                 next_after: str | None = None) -> None:
        super().__init__(entries, corrupt)
        self.next_after = next_after


def cursor_invalid(after: object, why: str = "is not a cursor this API returned", *,
                   hint: str = "pass the cursor or next_after of a previous page") -> InvalidInput:
    if isinstance(after, str) and len(after) > 80:  # a caller's value can be megabytes
        after = after[:80] + "..."
    return InvalidInput("http.cursor_invalid", f"after={after!r} {why}", hint=hint)


def cursor_number(text: str) -> int | None:
    """The number of an ``m``/``f`` cursor: a creation position or a count, which fits a
    signed 64-bit integer, spelled as this API spells it (no sign, no leading zero)."""
    if text.isascii() and text.isdigit() and len(text) <= 18 and str(int(text)) == text:
        return int(text)
    return None


def parse_runs_cursor(after: str | None) -> tuple[str | None, int]:
    """A runs page's cursor: its path (``m``/``f``; None for the first page) and number."""
    if after is None or after == "":
        return None, 0
    number = cursor_number(after[1:])
    if after[0] in "mf" and number is not None:
        return after[0], number
    raise cursor_invalid(after)


def tables_behind() -> StoreFailure:
    """An ``m`` cursor met read models too far behind the store to answer from (``OVERLAY_LIMIT``)."""
    return StoreFailure(
        "projection.behind",
        f"the read models are more than {OVERLAY_LIMIT} runs behind the store: a page after this cursor "
        "cannot be answered from them now",
        hint="retry in a moment (the follower is catching up), or list again without after",
    )


#: An index row's ``created_at`` as the runtime writes it (``utc_now``).
_CREATED_AT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z")


@dataclass(frozen=True, slots=True)
class PageCursor:
    """Where a listing page starts: after the run created at ``created`` (``m``: the read
    models' creation positions), or after the index key ``key`` (``f``: folding, in the
    index's (created_at, tree_id) order); ``path`` None: the first page."""

    path: str | None = None
    created: int = 0
    key: tuple[str, str] | None = None

    # A cursor is checked twice: its spelling here, and (``f``) that it names a run of this
    # store at its place in the index (``HostQueries._page``), so that a forged one is refused
    # rather than taken for the end of the listing.

    @staticmethod
    def of_key(key: tuple[str, str]) -> str:
        return "f" + base64.urlsafe_b64encode(f"{key[0]}\n{key[1]}".encode()).decode("ascii").rstrip("=")

    @classmethod
    def parse(cls, after: str | None) -> PageCursor:
        if after is None or after == "":
            return cls()
        if not isinstance(after, str):
            raise cursor_invalid(after, "is not a cursor: cursors are strings")
        # A creation position fits a signed 64-bit integer, spelled as this API spells it.
        number = after[1:]
        if after[0] == "m" and (created := cursor_number(number)) is not None:
            return cls("m", created)
        if after[0] == "f" and len(after) <= 200:
            try:
                text = base64.urlsafe_b64decode(number + "=" * (-len(number) % 4)).decode("ascii")
                created_at, tree_id = text.split("\n")
                TreeID(tree_id)
            except (binascii.Error, UnicodeDecodeError, ValueError, InvalidInput):
                raise cursor_invalid(after) from None
            if _CREATED_AT.fullmatch(created_at) and cls.of_key((created_at, tree_id)) == after:
                return cls("f", key=(created_at, tree_id))
        raise cursor_invalid(after)


def _relevant_to(member: str) -> Callable[[TreeHead | None], bool]:
    """Which trees a store-wide listing of ``member`` reads, by their index rows: only a tree
    with an unknown effect can list one; a tool input wait can exist in any live tree (a
    sibling call may still be running). Both paths pick the trees they read (and so the
    corrupt trees they name) so."""

    def relevant(head: TreeHead | None) -> bool:
        if head is None:
            return True  # no index row to judge by: name it rather than hide it
        if head.classification == "terminal":
            return False
        return member != "unknown" or bool(head.unknown_effect_ids)

    return relevant


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
                 use_read_models: bool = True, catalog: Catalog | None = None) -> None:
        """``catalog``: where folds bind a run's Programs (a server passes its runtime's); else
        one of its own, built from ``sources`` at the first fold and kept for this object's life."""
        self.store = store
        self.sources = sources
        self._catalog = catalog
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

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:  # a read the tables answer binds no Program: none is built
            self._catalog = self.sources.catalog()
        return self._catalog

    def fold(self, tree_id: TreeID) -> tuple[TreeState, ProgramResolver | None]:
        """Fold a tree with its Programs when they can be bound, else the kernel's view."""
        catalog = self.catalog
        first = self.store.first_event(tree_id)
        if first is None:
            raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")
        started = first.event
        if isinstance(started, TreeStarted):
            try:
                programs = catalog.bound(catalog.load(started.program, started.configuration))
                return self.store.load(tree_id, programs).state, programs
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
            root = run["processes"][0]["program"] if run["processes"] else "?"
            raise NotFound(
                "engine.program.unavailable",
                f"tree {tree_id} (root Program {root}) has no Interaction whose Program is bound here: results are "
                "the settled tool results of an Interaction's rounds",
                hint=f"a team, race, transform or kernel run has none: look at the run itself (`agentfold show "
                f"{tree_id}`, GET /runs/{tree_id}); for an Interaction run, bind its Program (docs/python.md)",
            )
        rounds = rows.rounds if rows is not None else models.rounds(str(tree_id))  # type: ignore[union-attr]
        return {"tree_id": tree_id, "rounds": rounds}

    @overload
    def gates(self, tree_id: None = None, *, min_position: int | None = None) -> Listing: ...
    @overload
    def gates(self, tree_id: TreeID, *, min_position: int | None = None) -> list[Entry]: ...

    def gates(self, tree_id: TreeID | None = None, *, min_position: int | None = None) -> list[Entry]:
        """The InputGates that wait for an answer (docs/team.md): of one tree, or of every run in
        creation order (a :class:`Listing`, as :meth:`pending`). A gate is told by its wait's key:
        no Program needs to be bound."""
        if tree_id is None:
            return self._listing("gates", GATES, min_position)
        _, rows, models = self._rows(tree_id, min_position)
        if rows is not None:
            return rows.gates
        assert models is not None
        if models.has_gates():
            return models.gates(str(tree_id))
        folded, _ = self.fold(tree_id)  # tables of an older follower: no InputGates table yet
        return [gate.to_json() for gate in gate_inputs(folded)]

    def delegates(self, process_id: str, *, min_position: int | None = None) -> Entry:
        """Delegate attributions of one Interaction; ``found`` says whether it is one."""
        tree_id = self.tree_of_process(process_id)
        run, rows, models = self._rows(tree_id, min_position)
        if not any(p["process_id"] == process_id for p in run["processes"]):
            raise NotFound("engine.process.not_found", f"process {process_id} is not in tree {tree_id}")
        found = any(p["process_id"] == process_id and p.get("interaction") for p in run["processes"])
        if not found and self.fold(tree_id)[1] is None:
            # Its Programs are not bound here: whether it is an Interaction cannot be told (it
            # answered "not an Interaction", found false, for an Interaction run; as `results`).
            root = run["processes"][0]["program"] if run["processes"] else "?"
            raise NotFound(
                "engine.program.unavailable",
                f"tree {tree_id} (root Program {root}) is not bound here: whether process {process_id} is an "
                "Interaction, and its delegates, cannot be told",
                hint="bind the run's Programs (docs/python.md: a deployment's own console script or server)",
            )
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

    def runs_page(self, *, status: str | None = None, classification: str | None = None, limit: int = 100,
                  after: str | None = None, min_position: int | None = None) -> ListingPage:
        """A page of runs in creation order (``GET /runs``, ``Host.runs``); each entry's
        ``cursor`` (and ``next_after``) names the path that produced it (``m`` read models,
        ``f`` fold): the two number runs differently, and a listing must not skip or repeat
        runs when one page came from the tables and the next from folding."""
        path, number = parse_runs_cursor(after)
        view: tuple[ReadModels, Fresh] | bool = False
        if path in (None, "m"):
            # The tables plus a fold of the trees they have not caught up with (never stale).
            found = self.view(min_position)
            if found is None and path == "m":
                if self.read_models() is None:
                    raise cursor_invalid(after, "names read models this store lacks", hint="list again without after")
                raise tables_behind()
            view = found if found is not None else False
        entries = self.runs(status=status, classification=classification, limit=limit, after=number, view=view)
        tag = "m" if view else "f"
        runs = [{**e, "cursor": f"{tag}{e['cursor']}"} for e in entries]
        return ListingPage(runs, entries.corrupt, runs[-1]["cursor"] if len(runs) == limit else None)

    def pending_page(self, *, limit: int = 100, after: str | None = None,
                     min_position: int | None = None) -> ListingPage:
        """A page of every run's tool input waits (``GET /pending-inputs``): at most ``limit``
        entries unless one run alone has more; page on with ``next_after``."""
        return self._page("pending", PENDING, limit, after, min_position)

    def gates_page(self, *, limit: int = 100, after: str | None = None,
                   min_position: int | None = None) -> ListingPage:
        """A page of every run's InputGates that wait for an answer (``GET /gates``), as :meth:`pending_page`."""
        return self._page("gates", GATES, limit, after, min_position)

    def unknown_page(self, *, limit: int = 100, after: str | None = None,
                     min_position: int | None = None) -> ListingPage:
        """A page of every run's unknown effects (``GET /unknown-effects``), as :meth:`pending_page`."""
        return self._page("unknown", UNKNOWN, limit, after, min_position)

    def _listing(self, member: str, table: str, min_position: int | None) -> Listing:
        """Every run's entries of one kind, runs in creation order; corrupt trees named."""
        return self._page(member, table, None, None, min_position)

    def _page(self, member: str, table: str, limit: int | None, after: str | None,
              min_position: int | None) -> ListingPage:
        """Entries of runs after the cursor ``after``, runs in creation order, whole runs:
        ``limit`` entries at most unless the first run alone has more (None: every entry).
        A cursor names the path that produced it (``m`` the tables, ``f``
        folding): the two order runs differently, and pages must not skip or repeat runs."""
        cursor = PageCursor.parse(after)
        relevant = _relevant_to(member)
        if cursor.path in (None, "m"):
            view = self.view(min_position)
            if view is not None and table == GATES and not view[0].has_gates():
                view = None  # tables of an older follower, without this one: fold
            if view is not None:
                # the first page starts before every run (a lagging tree's creation may read 0)
                return self._table_page(member, table, view, relevant, limit, cursor.created if cursor.path else -1)
            if cursor.path == "m":
                if self.read_models() is None:
                    raise cursor_invalid(after, "names read models this store lacks", hint="list again without after")
                raise tables_behind()
        if cursor.key is not None:
            head = self.store.head(TreeID(cursor.key[1]))
            if head is None or head.created_at != cursor.key[0]:
                raise cursor_invalid(after, "names no run of this store")
        return self._fold_page(member, relevant, limit, cursor.key)

    @staticmethod
    def _table_rows(models: ReadModels, table: str, fresh: Fresh, key: tuple[int, int],
                    want: int | None) -> tuple[list[tuple[int, Entry]], bool]:
        """The first ``want`` rows (None: all) after ``key`` of trees the fresh rows do not
        replace, as (created_position, entry); and whether no other row follows them."""
        rows: list[tuple[int, Entry]] = []
        while True:
            ask = None if want is None else want - len(rows)
            batch = models.ordered(table, after=key, limit=ask)
            rows.extend((created, entry) for created, _, tree, entry in batch if not fresh.skipped(tree))
            if ask is None or len(batch) < ask:
                return rows, True
            if want is not None and len(rows) >= want:
                return rows, False
            key = (batch[-1][0], batch[-1][1])

    def _table_page(self, member: str, table: str, view: tuple[ReadModels, Fresh],
                    relevant: Callable[[TreeHead | None], bool], limit: int | None, after: int) -> ListingPage:
        models, fresh = view
        # One row more than a page: whether another run follows is then known without a query.
        rows, complete = self._table_rows(models, table, fresh, (after, _LAST_ORD), None if limit is None else limit + 1)
        listed = list(rows)
        for tree, tree_rows in fresh.rows.items():
            if fresh.created[tree] > after:
                listed.extend((fresh.created[tree], e) for e in getattr(tree_rows, member))
        listed.sort(key=lambda pair: pair[0])  # stable: a tree's entries keep their order
        runs: list[tuple[int, list[Entry]]] = []
        for created, entry in listed:
            if runs and runs[-1][0] == created:
                runs[-1][1].append(entry)
            else:
                runs.append((created, [entry]))
        cut = rows[-1][0] if rows and not complete else None  # its rows may go on past the ones read
        page = ListingPage()
        last, more = after, False
        for created, entries in runs:
            if limit is not None and page and len(page) + len(entries) > limit:
                more = True
                break
            if created == cut:  # only ever the page's first run: every row read before it is in the page
                entries = [e for _, _, _, e in models.ordered(table, created=created)]
            page.extend(entries)
            last = created
        else:
            more = cut is not None and bool(self._table_rows(models, table, fresh, (last, _LAST_ORD), 1)[0])
        page.next_after = f"m{last}" if more else None
        # A page that is not the last ends at its last run: a corrupt tree after it belongs to a later page.
        named = self._corrupt(fresh, relevant, lambda created: created > after and (not more or created <= last))
        page.corrupt.extend(e for _, e in named)
        return page

    def _fold_page(self, member: str, relevant: Callable[[TreeHead | None], bool], limit: int | None,
                   key: tuple[str, str] | None) -> ListingPage:
        """A page by folding the live runs after the index key ``key`` (see ``FOLD_PAGE_RUNS``)."""
        page = ListingPage()
        folded = 0
        while True:
            heads = self.store.heads(only=HeadFilter(live_only=True, after=key,
                                                     limit=None if limit is None else _FOLD_BATCH))
            for head in heads:
                here = (head.created_at, head.tree_id)
                if not relevant(head):
                    key = here
                    continue
                # A full page ends before the next run it would read (so None means: no more).
                if limit is not None and (len(page) >= limit or folded >= FOLD_PAGE_RUNS) and key is not None:
                    page.next_after = PageCursor.of_key(key)
                    return page
                folded += 1
                try:
                    state, programs = self.fold(TreeID(head.tree_id))
                except CorruptStream as exc:
                    page.corrupt.append(corrupt_tree_entry(exc, head))
                    key = here
                    continue
                entries = getattr(project_tree(state, programs), member)
                if limit is not None and page and len(page) + len(entries) > limit and key is not None:
                    page.next_after = PageCursor.of_key(key)
                    return page
                page.extend(entries)
                key = here
            if limit is None or len(heads) < _FOLD_BATCH:
                return page

    def position(self) -> dict[str, Any]:
        """The store's last notification id and the read models' tracking position.

        The tables' position is read first: the follower commits while this runs, and read
        the other way round it could come out ahead of the store (a soak audit saw a lag of
        -12 under load); so ``store - read_models`` is never negative."""
        try:
            models = self.read_models()
            tables = models.position() if models is not None else None
            head = self.store.max_notification_id()
        except Exception as exc:
            raise read_failure(exc, "reading the notification log") from exc
        return {"store": head, "read_models": tables}
