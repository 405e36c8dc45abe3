"""What an operator's Prometheus and load balancer read from `agentfold serve` that no test
defended (a mutation audit of GET /metrics and GET /health, docs/http-api.md).

In-process: the application of ``agentfold serve`` (``create_app`` over an ``ApiService`` on an
SQLite file) behind Starlette's test client, as tests/http_api/test_mutants_serve.py does; the
exposition is checked with the text-format grammar of tests/http_api/test_metrics.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agentfold.adapters import http_api
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.http_api import ApiService, create_app
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.errors import StoreFailure
from agentfold.domain.requests import Settlement
from tests.http_api.test_metrics import parse
from tests.kernel_programs import chain_program

TOKEN = "obs-mutants-" + "k" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CALLED = threading.Event()
RELEASE = threading.Event()


def held_call(request: Any, context: Any) -> Settlement:
    CALLED.set()
    RELEASE.wait(20)
    return Settlement.succeeded({"value": 1})


SOURCES = ProgramSources(programs=(chain_program(name="obs.chain"), chain_program(held_call, name="obs.held")))


def serve(store: EventStore) -> tuple[ApiService, TestClient]:
    service = ApiService.open(store, SOURCES, TOKEN, follow=False)
    return service, TestClient(create_app(service))


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = client.get("/metrics", headers=AUTH)
    assert answer.status_code == 200, answer.text
    return parse(answer.text)[1]


def run_one(client: TestClient, start_id: str) -> None:
    started = client.post("/runs", json={"program": "obs.chain", "input": {"n": 2}, "start_id": start_id, "wait": 10},
                          headers=AUTH)
    assert started.status_code == 201 and started.json()["tree"]["status"] == "completed", started.text


def samples_after_one_run(store: EventStore, start_id: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics of a server that has just run one chain to its end."""
    service, client = serve(store)
    try:
        with client:
            run_one(client, start_id)
            return scrape(client)
    finally:
        service.close()


def test_the_read_models_lag_is_the_count_of_events_they_do_not_reflect_yet(store: EventStore) -> None:
    # Alert: agentfold_read_models_lag growing. Mutant: read_models - store (a lag that only
    # ever goes negative: the alert never fires). Read models at position 0, no follower.
    ReadModels(store, create=True)
    samples = samples_after_one_run(store, "lag-1")
    position = samples[("agentfold_store_position", ())]
    assert position > 0 and samples[("agentfold_read_models_position", ())] == 0
    assert samples[("agentfold_read_models_lag", ())] == position


def test_the_append_latency_histogram_is_in_seconds(store: EventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs: "agentfold_append_seconds ... buckets 0.5 ms to 2.5 s". Every append here takes at
    # least 30 ms: each lands above le="0.025" and within le="2.5". Mutant: the duration observed
    # in milliseconds (every append above every bound: histogram_quantile says "+Inf").
    append = store.append

    def slow_append(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.03)
        return append(*args, **kwargs)

    monkeypatch.setattr(store, "append", slow_append)
    samples = samples_after_one_run(store, "slow-1")
    count = samples[("agentfold_append_seconds_count", ())]
    assert count == samples[("agentfold_appends_total", ())] >= 2
    assert samples[("agentfold_append_seconds_bucket", (("le", "0.025"),))] == 0
    assert samples[("agentfold_append_seconds_bucket", (("le", "2.5"),))] == count
    assert 0.03 * count <= samples[("agentfold_append_seconds_sum", ())] < 2.5 * count


def test_the_leases_healthy_gauge_says_0_while_health_says_the_lease_file_is_gone(
    store: EventStore, tmp_path: Path
) -> None:
    # The gauge and /health tell the same story: 0 while the lease file cannot be opened again
    # (a directory in its place), 1 once it can. Mutant: the gauge stuck at 1.
    service, client = serve(store)
    leases = tmp_path / "agentfold.db.leases"
    try:
        with client:
            run_one(client, "leases-1")  # the runtime's watcher looks at the lease file from then on
            assert client.get("/health").status_code == 200
            assert scrape(client)[("agentfold_leases_healthy", ())] == 1
            leases.unlink()
            leases.mkdir()
            deadline = time.monotonic() + 20
            while client.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            health = client.get("/health", headers=AUTH)
            assert health.status_code == 503 and "lease file" in health.json()["detail"], health.text
            assert scrape(client)[("agentfold_leases_healthy", ())] == 0
            leases.rmdir()
            deadline = time.monotonic() + 20
            while client.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.get("/health").status_code == 200
            assert scrape(client)[("agentfold_leases_healthy", ())] == 1
    finally:
        service.close()


def test_health_and_metrics_answer_503_within_the_bound_while_the_store_hangs_and_no_read_piles_up(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs: GET /health "answers within about 2 seconds whatever the store does"; /metrics "or
    # 503 like /health". One read of the store at a time: the probes that come while it hangs
    # wait for that read, they start no other (mutants: no time bound; a new read per probe).
    monkeypatch.setattr(http_api, "HEALTH_PROBE_SECONDS", 0.15)
    service, client = serve(store)
    release = threading.Event()
    reads: list[float] = []
    position = service.queries.position

    def hanging_position() -> dict[str, Any]:
        reads.append(time.monotonic())
        release.wait(20)
        return position()

    monkeypatch.setattr(service.queries, "position", hanging_position)
    try:
        with client:
            for _ in range(3):
                began = time.monotonic()
                health = client.get("/health", headers=AUTH)
                assert time.monotonic() - began < 2.0
                assert health.status_code == 503 and health.json()["code"] == "store.unavailable", health.text
            assert len(reads) == 1, reads  # the probes waited for the one read that hangs
            began = time.monotonic()
            metrics = client.get("/metrics", headers=AUTH)
            assert time.monotonic() - began < 2.0
            assert metrics.status_code == 503 and metrics.json()["code"] == "store.unavailable", metrics.text
            release.set()  # the store answers again: so does /health, with a fresh read
            monkeypatch.setattr(http_api, "HEALTH_PROBE_SECONDS", 2.0)
            deadline = time.monotonic() + 5
            while (answer := client.get("/health")).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert answer.status_code == 200 and answer.json()["positions"]["store"] == 0, answer.text
            run_one(client, "after-1")
            assert client.get("/health").json()["positions"]["store"] > 0  # not the cached read
    finally:
        release.set()
        service.close()


def test_a_run_stopped_by_a_failed_append_makes_health_503_and_is_counted_stalled_until_appends_work(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs: agentfold_runs_stalled, "/health answers 503 store.append_failed meanwhile". Until
    # now only a PostgreSQL test (a trigger refusing appends) held this. Mutants: /health 200
    # while a run is stalled; the gauge stuck at 0.
    refuse = threading.Event()
    append = store.append

    def failing_append(*args: Any, **kwargs: Any) -> Any:
        if refuse.is_set():
            raise StoreFailure("store.append_failed", "database or disk is full (a test)")
        return append(*args, **kwargs)

    monkeypatch.setattr(store, "append", failing_append)
    CALLED.clear()
    RELEASE.clear()
    service, client = serve(store)
    try:
        with client:
            started = client.post("/runs", json={"program": "obs.held", "input": {"n": 1}, "start_id": "stall-1",
                                                 "wait": 0}, headers=AUTH)
            assert started.status_code == 201, started.text
            assert CALLED.wait(10)
            refuse.set()
            RELEASE.set()  # the call returns; the append of its settlement fails
            deadline = time.monotonic() + 10
            while not service.runtime.stalled_trees() and time.monotonic() < deadline:
                time.sleep(0.02)
            health = client.get("/health", headers=AUTH)
            assert health.status_code == 503 and health.json()["code"] == "store.append_failed", health.text
            assert "1 run(s) stopped on a failed append" in health.json()["detail"]
            assert scrape(client)[("agentfold_runs_stalled", ())] == 1
            refuse.clear()  # the store takes appends again: the server adopts the run by itself
            deadline = time.monotonic() + 10
            while client.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert client.get("/health").status_code == 200
            assert scrape(client)[("agentfold_runs_stalled", ())] == 0
    finally:
        RELEASE.set()
        service.close()
