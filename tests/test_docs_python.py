"""docs/python.md, docs/team.md and docs/interaction.md run as written: every example, in order, in one empty folder.

A block starting with ``# file: NAME.py`` is saved as that module (and must import); every other ``python``
block is run as its own ``python`` process (the package importable as installed), and when a
``text`` block follows it, its standard output must be exactly that text. So a change that
breaks what the embedding guide tells users (a renamed API, a changed error code, an
example that no longer completes) fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "python.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def blocks(doc: Path = DOC) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(doc.read_text())]


def test_every_python_example_in_the_embedding_guide_runs_and_prints_what_the_guide_shows(tmp_path: Path) -> None:
    # The guide's structure itself: modules saved, programs run, outputs checked (a fence typo
    # would otherwise silently drop an example from this test).
    assert run_examples(DOC, tmp_path) == (5, 5, 5)


def test_the_team_guide_example_runs_and_prints_what_the_guide_shows(tmp_path: Path) -> None:
    assert run_examples(ROOT / "docs" / "team.md", tmp_path) == (1, 2, 2)


def test_the_interaction_guide_example_of_context_hooks_runs_and_prints_what_the_guide_shows(tmp_path: Path) -> None:
    assert run_examples(ROOT / "docs" / "interaction.md", tmp_path) == (1, 1, 1)


def run_examples(doc: Path, tmp_path: Path) -> tuple[int, int, int]:
    """Run ``doc``'s examples; (modules saved, scripts run, outputs compared)."""
    found = blocks(doc)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop("AGENTFOLD_STORE", None)
    ran = saved = compared = 0
    modules: list[str] = []
    for index, (language, body) in enumerate(found):
        if language != "python":
            continue
        first = body.splitlines()[0]
        if first.startswith("# file: "):
            name = first.removeprefix("# file: ").strip()
            (tmp_path / name).write_text(body)
            modules.append(name.removesuffix(".py"))
            saved += 1
            continue
        script = tmp_path / f"example_{index}.py"
        script.write_text(body)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, f"example {index} of {doc.name} failed:\n{body}\n--- stderr:\n{done.stderr}"
        ran += 1
        following = found[index + 1] if index + 1 < len(found) else None
        if following is not None and following[0] == "text":
            assert done.stdout == following[1], (
                f"example {index} of {doc.name} printed something else than the guide shows:\n{done.stdout}"
            )
            compared += 1
    # A module no example runs (the worker) must at least import.
    imported = subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in modules)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=60, check=False)
    assert imported.returncode == 0, imported.stderr
    return saved, ran, compared
