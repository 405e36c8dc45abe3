"""Where front ends (CLI, HTTP API, follower) get the Programs a store's trees run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agentfold.adapters.catalog import Catalog, Loader
from agentfold.adapters.kernel_demo import payment_program
from agentfold.adapters.scenario import PROGRAM_NAME as SCENARIO_PROGRAM
from agentfold.adapters.scenario import SCENARIO_LOADERS
from agentfold.domain.program import Program


@dataclass(frozen=True)
class ProgramSources:
    """The Programs trees in a store may use: bound Programs and configuration loaders.

    ``loaders`` maps a program name to a function that rebuilds the Program from the
    configuration document stored in ``TreeStarted`` (see ``agentfold.adapters.catalog``).
    """

    programs: tuple[Program, ...] = ()
    loaders: Mapping[str, Loader | Sequence[Loader]] = field(default_factory=dict)

    def catalog(self) -> Catalog:
        return Catalog(self.programs, self.loaders)

    def plus(self, other: ProgramSources) -> ProgramSources:
        return ProgramSources(self.programs + other.programs, {**self.loaders, **other.loaders})

    def named(self, name: str) -> Program | None:
        """A registered Program by its name (the first registered wins)."""
        return next((p for p in self.programs if p.ref.name == name), None)


def default_sources() -> ProgramSources:
    """What the console script binds: the kernel demo Program and scenario Programs
    (rebuilt from the scenario each tree stored)."""
    return ProgramSources(programs=(payment_program(),), loaders={SCENARIO_PROGRAM: SCENARIO_LOADERS})
