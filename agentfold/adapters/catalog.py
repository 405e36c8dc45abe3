"""The catalog of bound Programs a runtime can drive.

A runtime resolves every Process's exact ProgramRef through its catalog. Programs
are registered explicitly (with every child binding they reach); a *loader* can also
rebuild a Program from the configuration document a tree stored in its
``TreeStarted`` (for example a scenario), so later commands work without the file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import NotFound
from agentfold.domain.ids import Digest
from agentfold.domain.program import Program, ProgramRef

Loader = Callable[[JSON], Program]


class Catalog:
    def __init__(
        self, programs: Iterable[Program] = (), loaders: Mapping[str, Loader | Sequence[Loader]] | None = None
    ) -> None:
        self._programs: dict[Digest, Program] = {}
        self._loaders = dict(loaders or {})
        self._lock = threading.Lock()
        for program in programs:
            self.add(program)

    def add(self, program: Program) -> Program:
        """Register a Program and every Program reachable through its child bindings."""
        with self._lock:
            for bound in program.walk():
                self._programs.setdefault(bound.ref.digest, bound)
        return program

    def resolve(self, ref: ProgramRef) -> Program | None:
        return self._programs.get(ref.digest)

    def programs(self) -> list[Program]:
        """Every registered Program (child bindings included), in registration order."""
        with self._lock:
            return list(self._programs.values())

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
            return program
        loaders = self._loaders.get(ref.name)
        if loaders is None or configuration is None:
            raise NotFound(
                "engine.program.unavailable",
                f"no program bound for {ref.name} ({ref.digest})",
                hint="run with a catalog (or scenario) that binds this exact program",
            )
        # Several loaders: the current way of building the Program first, then the ways
        # earlier releases built it (their trees name the identity those gave).
        rebuilt: list[Program] = []
        for loader in loaders if isinstance(loaders, Sequence) else (loaders,):
            rebuilt.append(loader(configuration))
            if rebuilt[-1].ref == ref:
                break
        else:
            raise NotFound(
                "engine.program.unavailable",
                f"the stored configuration rebuilds {rebuilt[0].ref.digest}, not {ref.digest}",
                hint="the program's code changed since this tree started; run the version that started it",
            )
        program = rebuilt[-1]
        return self.add(program)

    def __contains__(self, ref: object) -> bool:
        return isinstance(ref, ProgramRef) and ref.digest in self._programs
