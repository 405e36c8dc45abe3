"""What hosts write through `agentfold serve` and what operators scrape from it, that no test
defended (a mutation audit of agentfold/adapters/http_api.py and metrics.py).

In-process: the application of ``agentfold serve`` (``create_app`` over an ``ApiService`` on an
SQLite file) behind Starlette's test client, as tests/test_edges_s25.py does; the exposition is
checked with the text-format grammar of tests/http_api/test_metrics.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.http_api import MAX_BODY_BYTES, ApiService, create_app
from agentfold.adapters.metrics import Family, Histogram, render
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_input, scenario_program, validate_scenario
from agentfold.adapters.sources import ProgramSources, default_sources
from agentfold.domain.requests import Settlement
from tests.http_api.test_api import HELLO
from tests.http_api.test_metrics import parse
from tests.kernel_programs import chain_program
from tests.test_cli_interaction import FINAL, LEFT_TO_HOST, approval, one_tool_call

TOKEN = "serve-mutants-" + "k" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def failing_call(request: Any, context: Any) -> Settlement:
    return Settlement.failed({"reason": "the card was declined"})


SOURCES = default_sources().plus(ProgramSources(programs=(chain_program(failing_call, name="serve.declined"),)))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, EventStore]]:
    """The server's application on a fresh SQLite file (no follower: reads fold)."""
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    service = ApiService.open(store, SOURCES, TOKEN, follow=False)
    try:
        with TestClient(create_app(service)) as client:
            yield client, store
    finally:
        service.close()
        store.close()


def store_position(client: TestClient) -> int:
    health = client.get("/health")
    assert health.status_code == 200, health.text
    position: int = health.json()["positions"]["store"]
    return position


def parked(client: TestClient, start_id: str) -> dict[str, Any]:
    """A run whose tool waits for a human answer (its tree summary)."""
    started = client.post("/runs", json={"scenario": approval(None), "start_id": start_id, "wait": 10}, headers=AUTH)
    assert started.status_code == 201, started.text
    tree: dict[str, Any] = started.json()["tree"]
    assert tree["classification"] == "parked", tree
    return tree


# ---------------------------------------------------------------------------
# The token


def test_a_part_of_the_token_opens_no_endpoint_and_a_write_with_it_appends_nothing(
    served: tuple[TestClient, EventStore],
) -> None:
    # Mutant: the token compared as a prefix (token.startswith(credentials)): a stranger who
    # sent the first character of the token (or one guessed character at a time) started runs.
    client, _ = served
    before = store_position(client)
    for partial in (TOKEN[:1], TOKEN[:-1], TOKEN[1:]):
        headers = {"Authorization": f"Bearer {partial}"}
        refused = client.post("/runs", json={"scenario": HELLO, "start_id": "stranger-1", "wait": 5}, headers=headers)
        assert refused.status_code == 401, refused.text
        assert refused.json()["code"] == "http.unauthorized"
        assert refused.headers["www-authenticate"] == 'Bearer error="invalid_token"'
        assert client.get("/runs", headers=headers).status_code == 401
        assert client.get("/metrics", headers=headers).status_code == 401
    assert store_position(client) == before  # nothing was started
    assert client.get("/runs/stranger-1", headers=AUTH).status_code == 404


def test_a_service_opened_without_a_side_effect_dir_starts_no_scenario_that_names_a_log(
    served: tuple[TestClient, EventStore], tmp_path: Path,
) -> None:
    # ApiService.open(side_effect_dir=None) (an application embedding the server's service):
    # "a scenario that names one is refused". `agentfold serve` also confines the whole process
    # (side_effect_confinement), which hid the mutant that dropped the service's own check:
    # embedded, a client's scenario appended to any file the process could write.
    client, _ = served
    victim = tmp_path / "victim.jsonl"
    before = store_position(client)
    refused = client.post("/runs", json={"scenario": one_tool_call(victim), "start_id": "logged-1", "wait": 10},
                          headers=AUTH)
    assert refused.status_code == 422 and refused.json()["code"] == "scenario.invalid", refused.text
    assert "without --side-effect-dir" in refused.json()["detail"], refused.text
    assert not victim.exists()
    assert store_position(client) == before


def test_every_write_refuses_a_wait_beyond_300_seconds_or_below_0_and_appends_nothing(
    served: tuple[TestClient, EventStore],
) -> None:
    # docs/http-api.md "Waiting for a run": wait is 0 to 300 on every write. Mutant: a write's
    # bound dropped (a request then held one of the server's worker threads for days).
    client, _ = served
    tree = parked(client, "bounded-1")
    pid = tree["root_process_id"]
    writes = {
        "/runs": {"scenario": HELLO},
        f"/processes/{pid}/waits/wait:{'0' * 64}/answer": {"response": {"approved": True}},
        f"/processes/{pid}/steer": {"text": "hurry"},
        f"/unknown-effects/effect:{'0' * 64}/resolve": {"output": "x"},
        f"/processes/{pid}/cancel": {},
        f"/processes/{pid}/pause": {},
        f"/processes/{pid}/resume": {},
    }
    before = store_position(client)
    for path, body in writes.items():
        for wait in (300.5, 1e9, -1):
            refused = client.post(path, json={**body, "wait": wait}, headers=AUTH)
            assert refused.status_code == 422, (path, wait, refused.text)
            assert refused.json()["code"] == "http.request_invalid", (path, wait, refused.text)
            assert refused.json()["errors"][0]["location"] == ["body", "wait"], (path, wait, refused.text)
    assert store_position(client) == before


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(served: tuple[TestClient, EventStore]) -> None:
    # docs/http-api.md: bodies are limited to 16,778,240 bytes; that many is still a request.
    # Mutant: the declared length compared with >= (a body at the limit refused).
    client, _ = served
    text = json.dumps({"scenario": HELLO, "start_id": "at-the-limit", "wait": 10})
    at_limit = (text + " " * (MAX_BODY_BYTES - len(text))).encode()
    assert len(at_limit) == MAX_BODY_BYTES == 16_778_240
    headers = {**AUTH, "content-type": "application/json"}
    too_large = client.post("/runs", content=at_limit + b" ", headers=headers)
    assert too_large.status_code == 413 and too_large.json()["code"] == "payload.too_large", too_large.text
    started = client.post("/runs", content=at_limit, headers=headers)
    assert started.status_code == 201 and started.json()["tree"]["status"] == "completed", started.text


# ---------------------------------------------------------------------------
# Positions and reasons of writes


def test_a_writes_position_is_the_stores_last_event_not_the_runs_version(served: tuple[TestClient, EventStore]) -> None:
    # Mutant: the answer's position was the run's own version: behind the write in a store
    # holding other runs, so a read with min_position=position did not wait for the write.
    client, _ = served
    for n in range(2):  # other runs before: the store's positions run ahead of this run's versions
        assert client.post("/runs", json={"scenario": HELLO, "start_id": f"before-{n}", "wait": 10},
                           headers=AUTH).status_code == 201
    tree = parked(client, "positioned-1")
    assert store_position(client) > tree["version"]
    paused = client.post(f"/processes/{tree['root_process_id']}/pause", json={"wait": 10}, headers=AUTH)
    assert paused.status_code == 200, paused.text
    body = paused.json()
    assert body["tree"]["status"] == "paused"
    # Nothing else writes: the store's last event is this write's (or later).
    assert body["position"] == store_position(client) > body["tree"]["version"]


def test_a_resolution_of_a_run_another_live_runtime_owns_says_driven_false_and_that_owner_drives_it_on(
    served: tuple[TestClient, EventStore], tmp_path: Path,
) -> None:
    # Mutant: driven always true: a host was told this server drives the run on while the
    # runtime that owns it (a worker beside the server) did.
    client, _ = served
    doc = validate_scenario({"name": "left-to-host", "input": {"messages": [{"role": "user", "content": "Hi."}]},
                             "model": {"responses": [LEFT_TO_HOST]}})
    with Runtime(EventStore(f"sqlite:///{tmp_path / 'runs.db'}"), SOURCES.catalog(), poll_interval=0.02) as worker:
        handle = worker.start(scenario_program(doc), scenario_input(doc), start_id="owned-1", configuration=doc)
        parked_tree = worker.wait_idle(handle.tree_id, timeout=10)
        [effect_id] = tree_summary_unknown(parked_tree)
        resolved = client.post(f"/unknown-effects/{effect_id}/resolve", json={"model_response": FINAL, "wait": 10},
                               headers=AUTH)
        assert resolved.status_code == 200, resolved.text
        assert resolved.json()["driven"] is False, resolved.json()
        assert worker.drives(handle.tree_id)
        assert worker.wait_idle(handle.tree_id, timeout=10).root.status == "completed"
    assert client.get("/runs/owned-1", headers=AUTH).json()["status"] == "completed"


def tree_summary_unknown(tree: Any) -> list[str]:
    return sorted(str(r.effect_id) for p in tree.processes.values() for r in p.unknown_effects())


# ---------------------------------------------------------------------------
# GET /metrics


def test_a_failed_call_is_counted_under_outcome_failed(served: tuple[TestClient, EventStore]) -> None:
    # Mutant: a definite failure counted as succeeded: an alert on
    # rate(agentfold_calls_settled_total{outcome="failed"}) never fired.
    client, _ = served
    started = client.post("/runs", json={"program": "serve.declined", "input": {"n": 1}, "start_id": "declined-1",
                                         "wait": 10}, headers=AUTH)
    assert started.status_code == 201 and started.json()["tree"]["status"] == "failed", started.text
    metrics = client.get("/metrics", headers=AUTH)
    assert metrics.status_code == 200, metrics.text
    _, samples = parse(metrics.text)
    settled = {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
               if name == "agentfold_calls_settled_total"}
    assert settled == {"succeeded": 0, "failed": 1, "unknown": 0}


def histogram_samples(histogram: Histogram) -> dict[str, float]:
    _, samples = parse(render([Family("agentfold_append_seconds", "histogram", "Time of an append.",
                                      histogram=histogram)]))
    return {dict(labels).get("le", name): value for (name, labels), value in samples.items()}


def test_an_append_that_took_exactly_a_bound_is_counted_in_that_bucket() -> None:
    # Prometheus' le is "less than or equal": an append of exactly 1 ms is in le="0.001".
    # Mutant: bisect_right put it in the next bucket only.
    histogram = Histogram((0.001, 0.01))
    histogram.observe(0.001)
    histogram.observe(0.01)
    assert histogram_samples(histogram) == {
        "0.001": 1, "0.01": 2, "+Inf": 2, "agentfold_append_seconds_sum": 0.011, "agentfold_append_seconds_count": 2}


def test_an_append_slower_than_every_bound_is_only_in_the_inf_bucket() -> None:
    # A stall shows in the top bucket: an append of 10 s is not "at most 2.5 s". Mutant: an
    # observation above every bound counted in the last finite bucket.
    histogram = Histogram((0.5, 2.5))
    histogram.observe(0.1)
    histogram.observe(10.0)
    samples = histogram_samples(histogram)
    assert (samples["0.5"], samples["2.5"], samples["+Inf"]) == (1, 1, 2)
    assert samples["+Inf"] == samples["agentfold_append_seconds_count"]
    assert math.isclose(samples["agentfold_append_seconds_sum"], 10.1)


def test_label_values_with_quotes_backslashes_and_newlines_stay_one_valid_sample() -> None:
    # A label value (a feed topic read from the store) is escaped as the text format says:
    # \\, \" and \n. Mutants: the quote left as is (the line no longer parses), or the
    # backslash escaped after the quote (\" became \\" : the value ended early).
    value = 'a"b\\c\nd'
    text = render([Family("agentfold_feed_lag", "gauge", "Events past a publisher.", [({"topic": value}, 3.0)])])
    assert text.splitlines()[-1] == 'agentfold_feed_lag{topic="a\\"b\\\\c\\nd"} 3'
    _, samples = parse(text)
    [(name, labels)] = samples
    escaped = dict(labels)["topic"]
    unescaped = escaped.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
    assert (name, unescaped, samples[(name, labels)]) == ("agentfold_feed_lag", value, 3)
