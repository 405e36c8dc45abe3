"""CLI commands: `audit verify`, `audit drift`, `replay`, `export`, `import` (docs/audit.md)."""

from __future__ import annotations

from typing import Any


def register(command: Any) -> None:
    """Add this module's commands with ``command(name, handler, help, timeout=False)`` (adapters.cli)."""
