"""The identity and validation of team Programs: what the mutation audit "teamcfg"
(2026-12-05) found undefended in agentfold/adapters/team.py.

A Runtime rebinds a stored run to a Program by its ProgramRef (docs/python.md, "What to keep
stable between deployments"), so two configurations that behave differently must not share
one, and a configuration that behaves the same must keep it in every process. A refused
configuration raises ``InvalidInput`` with its documented code before anything runs
(docs/team.md, "Building one" and "Failure codes"). A Deadline's timer waits for the instant
its input names (docs/team.md, "Deadline"). Pure functions and fresh Python processes only:
no runtime is needed to observe any of this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.team import (
    FIRST_COMPLETED,
    DeadlineDispatcher,
    FirstSuccessConfig,
    InputGateConfig,
    TeamConfig,
    TeamMember,
    TransformConfig,
    compile_first_success,
    compile_input_gate,
    compile_team,
    transform,
)
from agentfold.domain.errors import InvalidInput
from agentfold.domain.requests import Settlement
from tests.team import programs as P

REPO = Path(__file__).resolve().parents[2]


def _team(**changes: Any) -> Any:
    fields: dict[str, Any] = {
        "name": "test.identity",
        "coordinator": TeamMember(P.coordinator(P.finish_at_once), P.COORDINATOR_BUDGET),
        "workers": [TeamMember(P.echo(), P.WORKER_BUDGET), TeamMember(P.gate(), P.WORKER_BUDGET)],
        "max_turns": 5,
        "max_tasks": 4,
        "max_concurrent_tasks": 2,
        "max_controls_per_turn": 1,
        "configuration": {"desk": "A"},
    }
    fields.update(changes)
    return compile_team(TeamConfig(**fields))


# ---------------------------------------------------------------------------
# A team's ProgramRef covers every limit and its configuration


@pytest.mark.parametrize("change", [
    {"max_turns": 6}, {"max_turns": None},
    {"max_tasks": 0}, {"max_tasks": None},
    {"max_concurrent_tasks": 1},
    {"max_controls_per_turn": 2},
    {"configuration": {"desk": "B"}},
    {"workers": [TeamMember(P.gate(), P.WORKER_BUDGET), TeamMember(P.echo(), P.WORKER_BUDGET)]},
], ids=lambda change: next(iter(change)) + "=" + repr(next(iter(change.values())))[:20])
def test_teams_that_differ_in_a_limit_their_configuration_or_worker_order_have_different_refs(
    change: dict[str, Any],
) -> None:
    """Each limit changes what the team does (another turn allowed, a task start refused, a
    control refused), ``configuration`` is documented as part of the configuration digest, and
    the workers' order is the order of the Turn's ``workers`` the coordinator reads: a run
    started under one must not be continued by the other."""
    base = _team()
    assert _team().ref == base.ref
    changed = _team(**change)
    assert changed.ref != base.ref
    assert changed.ref.configuration_digest != base.ref.configuration_digest


_REF_OF_A_TEAM_WITH_CAPABILITIES = """
from agentfold.adapters.team import TeamConfig, TeamMember, compile_team
from tests.team import programs as P
caps = frozenset(f"cap.{i}" for i in range(12))
team = compile_team(TeamConfig("test.caps", TeamMember(P.coordinator(P.finish_at_once), P.COORDINATOR_BUDGET, caps),
                               [TeamMember(P.echo(), P.WORKER_BUDGET, caps)]))
print(team.ref)
"""


def test_a_teams_ref_with_member_capabilities_is_the_same_in_every_process() -> None:
    """Capabilities are a set: their iteration order depends on the process's hash seed. Two
    processes (a starter and a `recover`, or `serve`) must compute the same ref, or the second
    cannot take the run up."""
    refs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _REF_OF_A_TEAM_WITH_CAPABILITIES], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        refs.add(done.stdout.strip())
    assert len(refs) == 1, refs


def test_a_plain_race_keeps_the_digest_its_stored_runs_recorded() -> None:
    """FIRST_COMPLETED is agentfold's own function: it is named as before agentfold's modules
    moved under the ``agentfold`` package (agentfold/adapters/interaction.py, ``_identity``),
    so a race started before an upgrade is still bound by the same ref after it."""
    race = compile_first_success(FirstSuccessConfig("test.race", [P.gate()], FIRST_COMPLETED, max_candidates=3))
    assert race.configuration == {"accept": "adapters.team._accept_everything", "max_candidates": 3}


# ---------------------------------------------------------------------------
# InputGate and transform identities


def test_gates_with_different_answer_schemas_have_different_refs() -> None:
    """The answer schema decides which answers a gate admits (and its output): it is not in
    the gate's contract, so the configuration digest must carry it."""
    yes_no = compile_input_gate(InputGateConfig("test.gate", answer_schema={"type": "boolean"}))
    assert compile_input_gate(InputGateConfig("test.gate", answer_schema={"type": "boolean"})).ref == yes_no.ref
    assert compile_input_gate(InputGateConfig("test.gate", answer_schema={"type": "string"})).ref != yes_no.ref


def test_a_transform_identity_names_its_function_in_the_ref_and_must_be_text() -> None:
    """docs/team.md, Transforms: ``identity`` names ``fn`` in the configuration digest (change it
    when fn changes meaning); blank text is refused (program.invalid)."""
    v1 = transform(TransformConfig("test.review", P.echo_fn, identity="shop.review/1"))
    assert transform(TransformConfig("test.review", P.echo_fn, identity="shop.review/1")).ref == v1.ref
    assert transform(TransformConfig("test.review", P.echo_fn, identity="shop.review/2")).ref != v1.ref
    assert transform(TransformConfig("test.review", P.echo_fn)).ref != v1.ref
    for blank in ("", "  "):
        with pytest.raises(InvalidInput) as caught:
            transform(TransformConfig("test.review", P.echo_fn, identity=blank))
        assert caught.value.code == "program.invalid"


def test_a_races_accept_identity_names_its_predicate_in_the_ref() -> None:
    """docs/team.md, FirstSuccess: ``accept_identity`` names ``accept`` in the configuration
    digest; a new identity (the predicate changed meaning) is a new ref, so a stored race is
    never judged again by the other predicate."""

    def race(identity: str | None) -> Any:
        return compile_first_success(FirstSuccessConfig("test.race", [P.gate()], FIRST_COMPLETED,
                                                        accept_identity=identity))

    v1 = race("shop.first/1")
    assert race("shop.first/1").ref == v1.ref
    assert race("shop.first/2").ref != v1.ref
    assert race(None).ref != v1.ref


# ---------------------------------------------------------------------------
# Refused team limits carry the team's own code


@pytest.mark.parametrize("change", [
    {"max_tasks": -1}, {"max_turns": -1}, {"max_turns": True}, {"max_tasks": False}, {"max_tasks": "3"},
], ids=lambda change: next(iter(change)) + "=" + repr(next(iter(change.values()))))
def test_a_limit_that_is_not_a_count_is_refused_as_a_bad_definition(change: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput) as caught:
        _team(**change)
    assert caught.value.code == "collaboration.definition.invalid", caught.value


@pytest.mark.parametrize("name", ["max_turns", "max_tasks", "max_concurrent_tasks", "max_controls_per_turn"])
def test_a_limit_beyond_the_largest_count_is_refused_as_a_bad_definition(name: str) -> None:
    """Found by this audit: 2**63 was refused as ``budget.invalid`` (max_turns, max_tasks) or
    raised a bare TypeError from the digest (max_concurrent_tasks, max_controls_per_turn)."""
    with pytest.raises(InvalidInput) as caught:
        _team(**{name: 2**63})
    assert caught.value.code == "collaboration.definition.invalid", caught.value
    assert name in caught.value.message


# ---------------------------------------------------------------------------
# The Deadline's timer: the instant, to the fraction, in UTC


class _Request:
    """What DeadlineDispatcher.due reads of an EffectRequest: its payload."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload


@pytest.mark.parametrize(("text", "seconds"), [
    ("2026-12-03T06:00:00Z", 1796277600.0),
    ("2026-12-03T07:00:00+01:00", 1796277600.0),
    ("2026-12-03T00:30:00-05:30", 1796277600.0),
    ("2026-12-03T06:00:00.5Z", 1796277600.5),
    ("2026-12-03T06:00:00.250+00:00", 1796277600.25),
])
def test_a_deadline_timer_is_due_at_the_utc_instant_its_input_names(text: str, seconds: float) -> None:
    """An offset is applied (never read as UTC or local time) and a fraction of a second is
    kept: the timer fires at that instant, not an hour or half a second off."""
    assert DeadlineDispatcher().due(_Request({"deadline": text})) == pytest.approx(seconds, abs=1e-6)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [
    {"deadline": "2026-12-03T06:00:00Z", "extra": 1}, {}, "2026-12-03T06:00:00Z", {"deadline": "2026-12-03T06:00:00"},
])
def test_a_malformed_timer_payload_settles_failed_at_once(payload: Any) -> None:
    due = DeadlineDispatcher().due(_Request(payload))  # type: ignore[arg-type]
    assert isinstance(due, Settlement) and due.status == "failed", due
