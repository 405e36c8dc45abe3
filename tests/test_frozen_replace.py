"""agentfold.domain.frozen.replace: the same copies as dataclasses.replace, for the Interaction's
state records and for classes it does not generate a copier for."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agentfold.domain import frozen
from agentfold.domain.frozen import replace
from agentfold.domain.interaction.state import Batch, InteractionState, Invocation, Round
from agentfold.domain.interaction.tool_call import ToolCallState


def test_each_field_changed_alone_gives_what_dataclasses_replace_gives() -> None:
    state = InteractionState(messages=({"role": "user", "content": "hi"},), model_call_count=2, preparing=1)
    for field in dataclasses.fields(InteractionState):
        value: Any = ("changed", field.name)
        copy = replace(state, **{field.name: value})
        assert copy == dataclasses.replace(state, **{field.name: value})
        assert getattr(copy, field.name) == value
        assert type(copy) is InteractionState
    assert state.model_call_count == 2  # the original is untouched
    # every field at once, and none
    everything: dict[str, Any] = {f.name: ("all", f.name) for f in dataclasses.fields(InteractionState)}
    assert replace(state, **everything) == dataclasses.replace(state, **everything)
    assert replace(state) == state and replace(state) is not state


@pytest.mark.parametrize("record", [
    Invocation(requested=True, process_id="process:x"),
    Batch("tool", 0, (Invocation(),)),
    Round(1, {"message": {"role": "assistant"}}, ()),
    ToolCallState({"id": "call_1", "name": "fetch"}),
])
def test_state_records_get_a_generated_copier_that_agrees(record: object) -> None:
    cls = type(record)
    assert frozen._replacer(cls) is not dataclasses.replace
    first = dataclasses.fields(cls)[0].name  # type: ignore[arg-type]
    assert replace(record, **{first: "x"}) == dataclasses.replace(record, **{first: "x"})  # type: ignore[type-var]


def test_an_unknown_field_is_a_type_error_and_a_frozen_copy_stays_frozen() -> None:
    with pytest.raises(TypeError):
        replace(InteractionState(), no_such_field=1)
    with pytest.raises(TypeError):
        replace(InteractionState(), InteractionState())  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        replace(InteractionState(), completed=True).completed = False  # type: ignore[misc]


@dataclasses.dataclass(frozen=True, slots=True)
class _Checked:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("negative")


@dataclasses.dataclass(slots=True)
class _Mutable:
    value: int


@dataclasses.dataclass(frozen=True)
class _NoSlots:
    value: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Derived:
    value: int
    twice: int = dataclasses.field(init=False, default=0)


@pytest.mark.parametrize("cls", [_Checked, _Mutable, _NoSlots, _Derived])
def test_classes_it_does_not_fit_get_dataclasses_replace(cls: type) -> None:
    assert frozen._replacer(cls) is dataclasses.replace
    assert replace(cls(1), value=2) == cls(2)


def test_a_post_init_check_still_runs() -> None:
    with pytest.raises(ValueError, match="negative"):
        replace(_Checked(1), value=-1)
