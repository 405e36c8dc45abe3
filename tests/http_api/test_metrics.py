"""GET /metrics: what an operator's Prometheus scrapes from `agentfold serve` (docs/http-api.md#get-metrics).

A real server on a fresh store (SQLite file, PostgreSQL database): runs that end, one that
parks for a human answer, one whose model call is left to the host (an unknown Effect). The
exposition must parse as Prometheus' text format 0.0.4, and its figures must be the store's
and the server's: the live runs per classification, the runs holding an unknown Effect, the
appends and their latency histogram, the calls per outcome, the read models' position.
"""

from __future__ import annotations

import itertools
import math
import re
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentfold.domain.ids import TreeID
from tests.audit.support import Sql
from tests.feed.support import stored_envelopes
from tests.http_api.support import ApiServer, ok, problem, server_env, start_server
from tests.test_cli import agentfold
from tests.test_cli_interaction import FINAL, LEFT_TO_HOST, approval, two_call_round, write

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """The families' types and every sample, checking the text format's grammar on the way."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split(" ", 3)[2])
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types, line
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types and family in helps, f"{name}: no HELP/TYPE before it"
        pairs = tuple(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))
        key = (name, pairs)
        assert key not in samples, f"repeated sample {key}"
        samples[key] = math.inf if value == "+Inf" else float(value)
    return types, samples


def start(c: httpx.Client, doc: dict[str, Any]) -> dict[str, Any]:
    data = ok(c.post("/runs", json={"scenario": doc, "start_id": f"m-{uuid.uuid4().hex[:12]}", "wait": 30}), 201)
    assert data["idle"], data
    return data


def test_metrics_say_what_the_store_and_the_server_hold(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer]
) -> None:
    server = start_server(durable_store_url, tmp_path)
    servers.append(server)
    c = server.client()
    assert server.client(token=None).get("/metrics").status_code == 401
    problem(server.client(token="wrong").get("/metrics"), 401, "http.unauthorized")

    types, before = parse(ok_text(c.get("/metrics")))
    assert types["agentfold_append_seconds"] == "histogram" and types["agentfold_appends_total"] == "counter"
    assert before[("agentfold_runs_live", (("classification", "parked"),))] == 0

    done = approval(None)
    done["model"]["responses"] = done["model"]["responses"][1:]  # a run that just ends
    for _ in range(3):
        start(c, done)
    start(c, approval(None))  # parks on a human answer
    start(c, {"name": "left-to-host", "input": {"messages": [{"role": "user", "content": "Hi."}]},
              "model": {"responses": [LEFT_TO_HOST]}})  # parks on an unknown Effect

    health = ok(c.get("/health"))
    _, after = parse(ok_text(c.get("/metrics")))  # the index is written with the events: no lag
    assert after[("agentfold_runs_live", (("classification", "parked"),))] == 2
    assert after[("agentfold_runs_live", (("classification", "progress"),))] == 0
    assert after[("agentfold_runs_with_unknown_effects", ())] == 1
    assert after[("agentfold_calls_settled_total", (("outcome", "unknown"),))] >= 1
    assert after[("agentfold_calls_settled_total", (("outcome", "succeeded"),))] >= 3
    appends = after[("agentfold_appends_total", ())]
    assert appends >= 5 and after[("agentfold_events_appended_total", ())] > appends
    # The histogram counts every append: cumulative buckets, +Inf = count = appends.
    buckets = sorted((float(dict(labels)["le"]), value) for (name, labels), value in after.items()
                     if name == "agentfold_append_seconds_bucket")
    assert buckets[-1] == (math.inf, appends) and after[("agentfold_append_seconds_count", ())] == appends
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))
    assert 0 < after[("agentfold_append_seconds_sum", ())] < appends * 5
    store = after[("agentfold_store_position", ())]
    assert store >= health["positions"]["store"]
    models = after.get(("agentfold_read_models_position", ()))
    assert models is not None and after[("agentfold_read_models_lag", ())] == store - models
    assert after[("agentfold_leases_healthy", ())] == 1
    assert after[("agentfold_runs_stalled", ())] == 0
    assert after[("agentfold_calls_running", ())] == 0
    assert after[("agentfold_timers_waiting", ())] == 0


def test_metrics_without_read_models_leave_their_position_out(tmp_path: Path, servers: list[ApiServer]) -> None:
    server = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path, "--no-follow")
    servers.append(server)
    _, samples = parse(ok_text(server.client().get("/metrics")))
    assert ("agentfold_store_position", ()) in samples
    assert not any(name.startswith("agentfold_read_models") for name, _ in samples)


def ok_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return response.text


def test_metrics_say_how_far_each_kafka_publisher_is(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer], kafka_bootstrap: str
) -> None:
    server = start_server(durable_store_url, tmp_path)
    servers.append(server)
    c = server.client()
    _, none = parse(ok_text(c.get("/metrics")))
    assert not any(name.startswith("agentfold_feed") for name, _ in none)  # no publisher has run yet

    done = approval(None)
    done["model"]["responses"] = done["model"]["responses"][1:]
    start(c, done)
    topic = f"metrics-{uuid.uuid4().hex[:8]}"
    published = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--json",
                          store=durable_store_url)
    assert published.code == 0, published.stderr
    position = published.json()["position"]
    _, caught_up = parse(ok_text(c.get("/metrics")))
    assert caught_up[("agentfold_feed_position", (("topic", topic),))] == position
    assert caught_up[("agentfold_feed_lag", (("topic", topic),))] == caught_up[("agentfold_store_position", ())] - position

    start(c, done)  # more events, not published yet
    _, behind = parse(ok_text(c.get("/metrics")))
    assert behind[("agentfold_feed_position", (("topic", topic),))] == position
    assert behind[("agentfold_feed_lag", (("topic", topic),))] == behind[("agentfold_store_position", ())] - position > 0
    assert caught_up[("agentfold_feed_held_trees", (("topic", topic),))] == 0

    # A corrupt tree: the publisher holds it back and goes on (exit 1); the gauge counts it.
    tree = stored_envelopes(durable_store_url)[-1]["tree_id"]  # the run not published yet
    sql = Sql(durable_store_url)
    version, event_topic, state = sql.rows(TreeID(tree))[2]
    sql.set_row(TreeID(tree), version, event_topic, state.replace(b'"timestamp":"2', b'"timestamp":"1', 1))
    held = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--json",
                     store=durable_store_url)
    assert held.code == 1 and [t["tree_id"] for t in held.json()["held_trees"]] == [tree], held.stderr
    _, after = parse(ok_text(c.get("/metrics")))
    assert after[("agentfold_feed_held_trees", (("topic", topic),))] == 1
    assert after[("agentfold_feed_lag", (("topic", topic),))] == 0  # the held events are passed over


def test_a_crashed_run_taken_over_at_startup_and_a_canceled_one_are_counted_as_they_are(
    tmp_path: Path, servers: list[ApiServer]
) -> None:
    """A process dies after committing a tool call's permission (a real os._exit): the server
    started with --recover takes the run over (agentfold_runs_recovered_total) and the call is
    unknown (a host must act). A canceled run keeps its unknown Effect as evidence, which
    nobody can resolve any more: the gauge stops counting it, as GET /unknown-effects does."""
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    scenario = write(tmp_path, two_call_round(tmp_path / "side-effects.jsonl", final=FINAL))
    died = agentfold("run", str(scenario), "--start-id", "crashed", "--crash-after", "dispatched:2", "--json",
                     store=store)
    assert died.code == 75, died.stderr
    server = start_server(store, tmp_path, "--recover")
    servers.append(server)
    c = server.client()
    _, after_start = parse(ok_text(c.get("/metrics")))
    assert after_start[("agentfold_runs_recovered_total", ())] == 1
    assert after_start[("agentfold_orphans_adopted_total", ())] == 0
    assert after_start[("agentfold_runs_with_unknown_effects", ())] == 1
    assert len(ok(c.get("/unknown-effects"))["unknown_effects"]) == 1

    run = ok(c.get("/runs/crashed"))
    ok(c.post(f"/processes/{run['root_process_id']}/cancel", json={"wait": 30}))
    assert ok(c.get("/runs/crashed"))["classification"] == "terminal"
    assert ok(c.get("/unknown-effects", params={"min_position": ok(c.get("/health"))["positions"]["store"]}))[
        "unknown_effects"] == []
    _, after_cancel = parse(ok_text(c.get("/metrics")))
    assert after_cancel[("agentfold_runs_with_unknown_effects", ())] == 0
    assert after_cancel[("agentfold_runs_live", (("classification", "parked"),))] == 0


def test_serve_takes_its_limit_of_calls_in_flight_and_reports_it(tmp_path: Path, servers: list[ApiServer]) -> None:
    """``serve --dispatch-workers N``: the start line says N, /metrics gives it with the runs
    waiting for a free call; a value out of range is refused before anything listens."""
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    server = start_server(store, tmp_path, "--dispatch-workers", "3")
    servers.append(server)
    assert server.started["dispatch_workers"] == 3
    _, samples = parse(ok_text(server.client().get("/metrics")))
    assert samples[("agentfold_calls_limit", ())] == 3
    assert samples[("agentfold_runs_waiting_for_calls", ())] == 0
    default = start_server(f"sqlite:///{tmp_path / 'other.db'}", tmp_path)
    servers.append(default)
    assert default.started["dispatch_workers"] == 32
    for bad in ("0", "4097"):
        ran = agentfold("serve", "--port", "0", "--dispatch-workers", bad, store=store, env=server_env())
        assert ran.code == 2 and ran.stdout == "", ran
        assert "cli.argument_invalid" in ran.stderr and "--dispatch-workers must be from 1 to 4096" in ran.stderr, ran
