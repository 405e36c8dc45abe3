"""The team tests' call log (tests/team/programs.py): one file per test, named to every process
the test starts through ``AGENTFOLD_TEAM_LOG``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.team import programs as P


@pytest.fixture(autouse=True)
def team_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(P.LOG_ENV, str(path))
    yield path
    P.release_file(path).touch()  # never leave a held policy call behind
