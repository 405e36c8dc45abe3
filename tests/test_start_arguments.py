"""A Python start with arguments of the wrong shape is refused with a classified error and
stores nothing (found by a review: a budget or capabilities of the wrong type raised pydantic's
raw ValidationError from inside the start, and a bare string of capabilities was taken as one
capability per letter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import StartID, TreeID
from tests.kernel_programs import chain_program


@pytest.mark.parametrize(("arguments", "code", "named"), [
    ({"budget": {"steps": 5}}, "budget.invalid", "dict"),
    ({"budget": 5}, "budget.invalid", "int"),
    ({"capabilities": "payments"}, "capabilities.invalid", "'payments'"),
    ({"capabilities": [1]}, "capabilities.invalid", "[1]"),
    ({"capabilities": ["payments", ""]}, "capabilities.invalid", "''"),
    ({"capabilities": b"payments"}, "capabilities.invalid", "b'payments'"),
])
def test_a_start_with_a_wrong_shaped_argument_is_refused_and_stores_nothing(
    tmp_path: Path, arguments: dict[str, Any], code: str, named: str
) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'start.db'}")
    program = chain_program(name="test.start_arguments")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(program, {"n": 1}, start_id="wrong", **arguments)
            assert refused.value.code == code
            assert named in refused.value.message and refused.value.hint
            assert store.head(TreeID.for_start(StartID("wrong"))) is None
            assert store.max_notification_id() == 0
            # the right shapes start
            ok = runtime.start(program, {"n": 1}, start_id="right", budget=Budget(steps=Quota(50)),
                               capabilities=["payments"])
            assert ok.result(timeout=30).status == "completed"
            assert runtime.capture(ok.tree_id).root.capabilities == ("payments",)
    finally:
        store.close()
