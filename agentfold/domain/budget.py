"""Quota, Budget and usage counters (kernel spec 6.2).

A :class:`Quota` is either unlimited (the zero value) or a finite inclusive maximum
(which may be 0). A :class:`Budget` bounds three cumulative dimensions of one
Process: committed Steps, prepared Effect identities and accepted Signals. A child
grant is debited from a finite parent permanently, including work the child never
used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentfold.domain.errors import InvalidInput

MAX_COUNTER = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Quota:
    maximum: int | None = None

    def __post_init__(self) -> None:
        if self.maximum is not None and (
            not isinstance(self.maximum, int) or isinstance(self.maximum, bool) or not 0 <= self.maximum <= MAX_COUNTER
        ):
            raise InvalidInput("budget.invalid", f"quota maximum must be a non-negative integer, got {self.maximum!r}")

    @property
    def unlimited(self) -> bool:
        return self.maximum is None

    def allows(self, used: int, add: int = 1) -> bool:
        return self.maximum is None or used + add <= self.maximum

    def to_json(self) -> dict[str, int | None]:
        return {"maximum": self.maximum}

    @classmethod
    def from_json(cls, value: Any) -> Quota:
        if value is None:
            return cls()
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value)
        if not isinstance(value, dict) or set(value) - {"maximum"}:
            raise InvalidInput("budget.invalid", f"quota must be {{'maximum': int|null}}, got {value!r}")
        return cls(value.get("maximum"))


UNLIMITED = Quota()


@dataclass(frozen=True, slots=True)
class Budget:
    steps: Quota = UNLIMITED
    effects: Quota = UNLIMITED
    signals: Quota = UNLIMITED

    def __post_init__(self) -> None:
        for name in ("steps", "effects", "signals"):
            value = getattr(self, name)
            if not isinstance(value, Quota):
                # Budget(steps=5) read its quota's .allows only at the first Step: an AttributeError then.
                raise InvalidInput(
                    "budget.invalid", f"a Budget's {name} is a Quota, not {type(value).__name__} {value!r:.80}",
                    hint=f"pass Budget({name}=Quota(5)), or Budget.of({name}=5); a Quota() is unlimited",
                )

    def to_json(self) -> dict[str, dict[str, int | None]]:
        return {"steps": self.steps.to_json(), "effects": self.effects.to_json(), "signals": self.signals.to_json()}

    @classmethod
    def from_json(cls, value: Any) -> Budget:
        if value is None:
            return cls()
        if not isinstance(value, dict) or set(value) - {"steps", "effects", "signals"}:
            raise InvalidInput("budget.invalid", f"budget must have only steps, effects and signals, got {value!r}")
        return cls(
            Quota.from_json(value.get("steps")),
            Quota.from_json(value.get("effects")),
            Quota.from_json(value.get("signals")),
        )

    @classmethod
    def of(cls, steps: int | None = None, effects: int | None = None, signals: int | None = None) -> Budget:
        return cls(Quota(steps), Quota(effects), Quota(signals))


@dataclass(frozen=True, slots=True)
class Allocation:
    """Resources permanently granted to children, per dimension."""

    steps: int = 0
    effects: int = 0
    signals: int = 0

    def plus(self, other: Allocation) -> Allocation:
        return Allocation(self.steps + other.steps, self.effects + other.effects, self.signals + other.signals)

    def to_json(self) -> dict[str, int]:
        return {"steps": self.steps, "effects": self.effects, "signals": self.signals}


def child_debit(parent: Budget, child: Budget) -> Allocation | str:
    """The permanent debit a child grant costs a parent, or why it is refused.

    Unlimited parent dimension: no debit, any child quota. Finite parent dimension: the
    child quota must be finite and at most the parent maximum; the debit is the child's
    maximum.
    """
    debits: list[int] = []
    for name in ("steps", "effects", "signals"):
        p: Quota = getattr(parent, name)
        c: Quota = getattr(child, name)
        if p.maximum is None:
            debits.append(0)
            continue
        if c.maximum is None:
            return f"the parent's {name} quota is finite, so the child's must be finite too"
        if c.maximum > p.maximum:
            return f"the child's {name} quota {c.maximum} exceeds the parent's maximum {p.maximum}"
        debits.append(c.maximum)
    return Allocation(*debits)


@dataclass(frozen=True, slots=True)
class Usage:
    committed_steps: int = 0
    prepared_effects: int = 0
    accepted_signals: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "steps": self.committed_steps,
            "effects": self.prepared_effects,
            "signals": self.accepted_signals,
        }
