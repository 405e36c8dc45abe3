"""The catalog of bound Programs a runtime can drive.

A runtime resolves every Process's exact ProgramRef through its catalog. Programs
are registered explicitly (with every child binding they reach); a *loader* can also
rebuild a Program from the configuration document a tree stored in its
``TreeStarted`` (for example a scenario), so later commands work without the file.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import InvalidInput, NotFound, recorded_text
from agentfold.domain.ids import Digest
from agentfold.domain.program import Program, ProgramRef

Loader = Callable[[JSON], Program]

#: Programs rebuilt (or started) recently, kept even when no tree holds them: a request
#: that checks a run and the owner that then drives it do not rebuild its Program twice.
RECENT_PROGRAMS = 64


def _report_dead(dead: collections.deque[tuple[Digest, weakref.ref[Program]]], digest: Digest,
                 ref: weakref.ref[Program]) -> None:
    dead.append((digest, ref))  # a deque's append is atomic: safe in any thread, lock-free


class Bound:
    """A tree's Program resolver: the catalog's, holding the tree's root Program (and so
    every child binding it reaches) for as long as the tree is held (a ``TreeState`` keeps
    its resolver). The catalog itself keeps a Program it can rebuild only while something
    holds it, so a long-lived server's catalog does not grow with every run it starts."""

    __slots__ = ("catalog", "program")

    def __init__(self, catalog: Catalog, program: Program) -> None:
        self.catalog = catalog
        self.program = program

    def __call__(self, ref: ProgramRef) -> Program | None:
        return self.catalog.resolve(ref)


class Catalog:
    """The Programs a runtime resolves, by exact ProgramRef digest.

    Programs given to the constructor or to :meth:`add` are kept for the catalog's life,
    except those its loaders can rebuild from their stored configuration (scenarios, a
    loader's own Programs): those, and what :meth:`load` rebuilds, are kept while a tree
    holds them (:class:`Bound`) plus the ``RECENT_PROGRAMS`` most recently used, and rebuilt
    when needed again.
    """

    def __init__(
        self, programs: Iterable[Program] = (), loaders: Mapping[str, Loader | Sequence[Loader]] | None = None
    ) -> None:
        self._pinned: dict[Digest, Program] = {}
        # Several objects may carry one digest (each rebuild makes new ones; a child binding
        # is reached from several roots): any live one answers.
        self._held: dict[Digest, list[weakref.ref[Program]]] = {}
        self._dead: collections.deque[tuple[Digest, weakref.ref[Program]]] = collections.deque()
        self._recent: collections.OrderedDict[Digest, Program] = collections.OrderedDict()
        self._loaders = dict(loaders or {})
        self._lock = threading.Lock()
        for program in programs:
            self.add(program)

    def add(self, program: Program) -> Program:
        """Register a Program and every Program reachable through its child bindings."""
        if not isinstance(program, Program):
            raise InvalidInput("program.invalid", f"a catalog holds Programs, not {type(program).__name__}",
                               hint="pass Catalog([program, ...]) with Program objects (agentfold.domain.program)")
        with self._lock:
            if self._rebuildable(program):
                self._hold(program)
            else:
                for bound in program.walk():
                    self._pinned.setdefault(bound.ref.digest, bound)
        return program

    def _rebuildable(self, program: Program) -> bool:
        return program.ref.name in self._loaders and program.configuration is not None

    def _hold(self, program: Program) -> None:
        while self._dead:  # forget what the garbage collector reported dead (not in its callback)
            digest, dead = self._dead.popleft()
            refs = self._held.get(digest)
            if refs is not None and dead in refs:
                refs.remove(dead)
                if not refs:
                    del self._held[digest]
        for bound in program.walk():
            digest = bound.ref.digest
            if digest in self._pinned:
                continue
            refs = self._held.setdefault(digest, [])
            if not any(r() is bound for r in refs):
                refs.append(weakref.ref(bound, functools.partial(_report_dead, self._dead, digest)))
        self._recent[program.ref.digest] = program
        self._recent.move_to_end(program.ref.digest)
        while len(self._recent) > RECENT_PROGRAMS:
            self._recent.popitem(last=False)

    def resolve(self, ref: ProgramRef) -> Program | None:
        found = self._pinned.get(ref.digest)
        if found is not None:
            return found
        for held in tuple(self._held.get(ref.digest, ())):
            program = held()
            if program is not None:
                return program
        return None

    def bound(self, program: Program) -> Bound:
        """The resolver of a tree whose root runs ``program`` (see :class:`Bound`)."""
        return Bound(self, program)

    def programs(self) -> list[Program]:
        """Every registered Program (child bindings included) and every one held now."""
        with self._lock:
            held = (next((p for r in refs if (p := r()) is not None), None) for refs in self._held.values())
            return [*self._pinned.values(), *(p for p in held if p is not None)]

    def loaders(self) -> dict[str, Loader | Sequence[Loader]]:
        with self._lock:
            return dict(self._loaders)

    def add_loaders(self, loaders: Mapping[str, Loader | Sequence[Loader]]) -> None:
        """Register configuration loaders for program names that have none yet."""
        with self._lock:
            for name, loader in loaders.items():
                self._loaders.setdefault(name, loader)

    def load(self, ref: ProgramRef, configuration: JSON) -> Program:
        """The Program for ``ref``, rebuilt from ``configuration`` by its loader if needed."""
        program = self.resolve(ref)
        if program is not None:
            with self._lock:
                if ref.digest in self._recent:
                    self._recent.move_to_end(ref.digest)
            return program
        loaders = self._loaders.get(ref.name)
        if loaders is None or configuration is None:
            raise NotFound(
                "engine.program.unavailable",
                f"no program bound for {ref.name} ({ref.digest}){self.differences(ref)}",
                hint="run with a catalog (or scenario) that binds this exact program: keep the version that started "
                "the run bound beside the new one (Catalog([new, old])) until its runs end",
            )
        # Several loaders: the current way of building the Program first, then the ways
        # earlier releases built it (their trees name the identity those gave).
        rebuilt: list[Program] = []
        for loader in loaders if isinstance(loaders, Sequence) else (loaders,):
            try:
                rebuilt.append(loader(configuration))
            except Exception as exc:
                # Classified like a Program not bound here: `recover` lists the run and goes on to
                # the next one, a host command refuses with a code (a loader's KeyError stopped a
                # worker's whole recover, and reached hosts as a raw exception).
                raise NotFound(
                    "engine.program.unavailable",
                    f"rebuilding {ref.name} ({ref.digest}) from its stored configuration failed: "
                    f"{type(exc).__name__}: {recorded_text(exc)}",
                    hint="the program's loader no longer reads this configuration; keep a loader for the format "
                    "that started the run (loaders for earlier releases follow the current one) until its runs end",
                ) from exc
            if rebuilt[-1].ref == ref:
                break
        else:
            raise NotFound(
                "engine.program.unavailable",
                f"the stored configuration rebuilds {rebuilt[0].ref.digest}, not {ref.digest}",
                hint="the program's code changed since this tree started; run the version that started it",
            )
        program = rebuilt[-1]
        with self._lock:
            self._hold(program)
        return program

    def differences(self, ref: ProgramRef) -> str:
        """For a message: how the Programs bound under ``ref``'s name differ from it (which of
        the digests a run's Program is identified by), or that none is bound under it."""
        same_name = sorted({p.ref.digest: p.ref for p in self.programs() if p.ref.name == ref.name}.values(),
                           key=lambda r: r.digest)
        if not same_name:
            return f"; this process binds no program named {ref.name}"
        parts = {
            "contract_digest": "its Descriptor (name, input, output or signal schemas)",
            "implementation_digest": "its implementation digest (the code of decide/evolve, or an Interaction's "
                                     "model, tool and callback identities)",
            "configuration_digest": "its configuration (an Interaction's tools, Delegates, limits or prompts)",
            "bindings_digest": "its child Programs",
        }
        described = []
        for bound in same_name[:3]:
            changed = [text for name, text in parts.items() if getattr(bound, name) != getattr(ref, name)]
            described.append(f"{bound.digest}, which differs in {'; '.join(changed)}")
        more = f" (and {len(same_name) - 3} more)" if len(same_name) > 3 else ""
        return f"; this process binds {ref.name} as {', '.join(described)}{more}"

    def __contains__(self, ref: object) -> bool:
        return isinstance(ref, ProgramRef) and self.resolve(ref) is not None
