"""The layers of DESIGN.md, checked in the source: ``agentfold.domain`` is pure (no I/O, no
clock, no randomness) and ``agentfold.projections`` imports only the domain; neither imports
the adapters.

Each module's imports (every ``import`` statement, also inside functions) are read with
``ast`` and checked against what the layer may import; calls that read a clock or draw
random numbers are refused by name even from an allowed module (``uuid.uuid4``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "agentfold"

#: The standard library modules the pure layers use: none performs I/O, reads a clock or draws
#: random numbers (``uuid`` for the ``UUID`` type and parsing only: see ``IMPURE_CALLS``).
PURE_STDLIB = {
    "__future__", "abc", "collections", "collections.abc", "copy", "dataclasses", "decimal", "enum", "functools", "heapq",
    "hashlib", "itertools", "json", "math", "operator", "re", "string", "types", "typing", "uuid",
}
ALLOWED = {
    "domain": PURE_STDLIB | {"pydantic", "pydantic_core", "orjson", "agentfold.domain"},
    "projections": PURE_STDLIB | {"orjson", "agentfold.domain", "agentfold.projections"},
}
IMPURE_CALLS = {"uuid1", "uuid4", "now", "utcnow", "today", "time", "monotonic", "perf_counter", "random",
                "randint", "urandom", "token_bytes", "token_hex"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            found.append((node.lineno, str(node.module)))
    return found


def allowed(module: str, layer: str) -> bool:
    return any(module == ok or module.startswith(ok + ".") for ok in ALLOWED[layer])


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_pure_layer_imports_only_what_it_may(layer: str) -> None:
    modules = sorted((PACKAGE / layer).rglob("*.py"))
    assert len(modules) > 3
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}"
             for path in modules for line, module in imports_of(path) if not allowed(module, layer)]
    assert wrong == []


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_pure_layer_reads_no_clock_and_draws_no_random_numbers(layer: str) -> None:
    wrong = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in IMPURE_CALLS:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: calls .{node.func.attr}()")
    assert wrong == []


def test_the_checks_see_a_forbidden_import_and_a_clock(tmp_path: Path) -> None:
    # The checks themselves: a module that reads the clock is caught by both.
    module = tmp_path / "impure.py"
    module.write_text("import time\n\ndef stamp():\n    import os\n    return time.time(), os.getpid()\n")
    assert [m for _, m in imports_of(module) if not allowed(m, "domain")] == ["time", "os"]
    calls = [n.func.attr for n in ast.walk(ast.parse(module.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert "time" in calls and set(calls) & IMPURE_CALLS == {"time"}
