"""Fixtures of the Interaction tests: most run on memory and SQLite; recovery runs on durable stores."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_store_url


@pytest.fixture(params=["memory", "sqlite"])
def local_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store URL on memory and on a SQLite file."""
    return make_store_url(request.param, tmp_path, request)
