"""Metrics of a server, in Prometheus' text exposition format (``GET /metrics``, docs/http-api.md).

Counters and histograms are this process's since it started (a Prometheus ``rate()`` handles
restarts); gauges are read when asked. Nothing here reads the store: ``Service.metrics`` does.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Content type of the text exposition format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds (seconds) of the append latency histogram: an SQLite append is ~0.2 ms, a
#: PostgreSQL one ~0.3 ms on a local disk, a cloud volume's a few ms; a stall shows in the top ones.
APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)


class Histogram:
    """Observations counted into cumulative buckets (thread-safe)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[float, int]], int, float]:
        """(cumulative count per upper bound, +Inf last), total count, sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return cumulative, running, total


class Counter:
    """Counts by label value (thread-safe)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, label: str, n: int = 1) -> None:
        with self._lock:
            self._counts[label] = self._counts.get(label, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass(slots=True)
class Family:
    """One metric: its name, kind (``counter``, ``gauge``, ``histogram``), help and samples
    (label set, value); a histogram's samples come from ``histogram``."""

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)
    histogram: Histogram | None = None

    def lines(self) -> Iterable[str]:
        yield f"# HELP {self.name} {_escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.kind}"
        if self.histogram is not None:
            buckets, count, total = self.histogram.snapshot()
            for bound, cumulative in buckets:
                yield f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}'
            yield f"{self.name}_sum {_number(total)}"
            yield f"{self.name}_count {count}"
            return
        for labels, value in self.samples:
            yield f"{self.name}{_labels(labels)} {_number(value)}"


def render(families: Iterable[Family]) -> str:
    """The text exposition of ``families`` (a final newline included)."""
    return "".join(line + "\n" for family in families for line in family.lines())


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape_label(value)}"' for key, value in sorted(labels.items()))
    return "{" + inner + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))
