"""Host queries: the answers the CLI and the HTTP API give, from the read models or by folding.

Each answer is the JSON a host reads (docs/cli.md, docs/http-api.md). It comes from
the materialized tables when they exist and reflect every committed event (or at
least ``min_position``, when the caller waits for its own write), else from folding
the tree with the pure projections. Both paths produce the same entries: the tables
store exactly what ``projections.read_models`` computes.
"""

from __future__ import annotations

from typing import Any

from adapters.catalog import Catalog
from adapters.eventstore import CorruptStream, EventStore
from adapters.read_models import ReadModels
from adapters.sources import ProgramSources
from domain.errors import NotFound, StoreFailure
from domain.events import TreeStarted
from domain.ids import ProcessID, StartID, TreeID
from domain.program import ProgramResolver
from domain.tree import TreeState
from projections.host_views import delegate_attributions
from projections.read_models import Entry, project_tree

PROG = "agentfold"


class HostQueries:
    """Read-only questions about one store's runs."""

    def __init__(self, store: EventStore, sources: ProgramSources, *, read_models: ReadModels | None = None,
                 use_read_models: bool = True) -> None:
        self.store = store
        self.sources = sources
        self._read_models = read_models
        self._use_read_models = use_read_models and store.backend in ("sqlite", "postgresql")

    # -- which path ------------------------------------------------------------

    def read_models(self) -> ReadModels | None:
        """The store's read models, if a follower ever wrote them (opening never creates them)."""
        if not self._use_read_models:
            return None
        if self._read_models is None:
            if not ReadModels.exist(self.store):
                return None
            self._read_models = ReadModels(self.store)
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
        if ref.startswith("tree:"):
            tree_id = TreeID(ref)
            if self.store.head(tree_id) is None:
                raise NotFound("engine.tree.not_found", f"tree {ref} does not exist")
            return tree_id
        found = self.store.tree_of_process(ref)
        if found is not None:
            return found
        tree_id = TreeID.for_start(StartID(ref))
        if self.store.head(tree_id) is None:
            raise NotFound(
                "engine.tree.not_found", f"no tree, start id or process {ref!r} in this store",
                hint=f"list trees with `{PROG} trees`",
            )
        return tree_id

    def tree_of_process(self, process_id: str) -> TreeID:
        found = self.store.tree_of_process(ProcessID(process_id))
        if found is None:
            raise NotFound("engine.process.not_found", f"process {process_id} is not in this store")
        return found

    # -- questions -------------------------------------------------------------

    def runs(self, *, status: str | None = None, classification: str | None = None, limit: int = 100,
             after: int = 0, min_position: int | None = None) -> list[Entry]:
        """Runs in creation order (``cursor`` of the last entry pages on)."""
        models = self.current(min_position)
        if models is not None:
            return models.runs(status=status, classification=classification, limit=limit, after=after)
        out: list[Entry] = []
        for n, head in enumerate(self.store.heads(), start=1):
            if n <= after or (status is not None and head.status != status):
                continue
            if classification is not None and head.classification != classification:
                continue
            tree, _ = self.fold(TreeID(head.tree_id))
            out.append({**project_tree(tree).run, "cursor": n})
            if len(out) >= limit:
                break
        return out

    def run(self, tree_id: TreeID, *, min_position: int | None = None) -> Entry:
        models = self.current(min_position)
        if models is not None:
            found = models.run(str(tree_id))
            if found is not None:
                return found
        tree, programs = self.fold(tree_id)
        return project_tree(tree, programs).run

    def results(self, tree_id: TreeID, *, min_position: int | None = None) -> Entry:
        """SettledResults of every open round of the tree."""
        models = self.current(min_position)
        run = models.run(str(tree_id)) if models is not None else None
        if models is not None and run is not None:
            rounds = models.rounds(str(tree_id))
        else:
            tree, programs = self.fold(tree_id)
            rows = project_tree(tree, programs)
            run, rounds = rows.run, rows.rounds
        if not any(p.get("interaction") for p in run["processes"]):
            raise NotFound(
                "engine.program.unavailable",
                f"tree {tree_id} runs no Interaction this store's Programs can bind",
                hint="results exist for Interaction runs (scenarios, compiled Interactions)",
            )
        return {"tree_id": tree_id, "rounds": rounds}

    def delegates(self, process_id: str, *, min_position: int | None = None) -> Entry:
        """Delegate attributions of one Interaction; ``found`` says whether it is one."""
        tree_id = self.tree_of_process(process_id)
        models = self.current(min_position)
        if models is not None:
            run = models.run(str(tree_id))
            if run is not None:
                found = any(p["process_id"] == process_id and p.get("interaction") for p in run["processes"])
                return {"process_id": process_id, "found": found, "delegates": models.delegates(process_id)}
        tree, _ = self.fold(tree_id)
        attributions, found = delegate_attributions(tree, ProcessID(process_id))
        entries = [{"tree_id": tree.tree_id, **a.to_json()} for a in attributions]
        return {"process_id": process_id, "found": found, "delegates": entries}

    def pending(self, tree_id: TreeID | None = None, *, min_position: int | None = None) -> list[Entry]:
        """Current tool input waits: of one tree, or of every run in creation order."""
        models = self.current(min_position)
        if models is not None:
            return models.pending(str(tree_id) if tree_id is not None else None)
        if tree_id is not None:
            tree, programs = self.fold(tree_id)
            return project_tree(tree, programs).pending
        entries: list[Entry] = []
        for head in self.store.heads(live_only=True):
            if head.classification == "parked":  # a tool waiting for input parks its tree
                tree, programs = self.fold(TreeID(head.tree_id))
                entries.extend(project_tree(tree, programs).pending)
        return entries

    def unknown(self, tree_id: TreeID | None = None, *, min_position: int | None = None) -> list[Entry]:
        """Unknown effects of live Processes: of one tree, or of every run in creation order."""
        models = self.current(min_position)
        if models is not None:
            return models.unknown(str(tree_id) if tree_id is not None else None)
        if tree_id is not None:
            tree, programs = self.fold(tree_id)
            return project_tree(tree, programs).unknown
        entries: list[Entry] = []
        for head in self.store.heads(live_only=True):
            if head.unknown_effect_ids:  # the index is written with every append
                tree, programs = self.fold(TreeID(head.tree_id))
                entries.extend(project_tree(tree, programs).unknown)
        return entries

    def position(self) -> dict[str, Any]:
        """The store's last notification id and the read models' tracking position."""
        try:
            head = self.store.max_notification_id()
        except Exception as exc:
            raise StoreFailure("store.read_failed", f"cannot read the notification log: {exc}") from exc
        models = self.read_models()
        return {"store": head, "read_models": models.position() if models is not None else None}
