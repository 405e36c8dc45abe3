"""``agentfold serve`` across a network partition from its PostgreSQL server (real packets dropped).

Unlike a frozen server (every PostgreSQL process stopped: the kernel still acknowledges
packets and accepts connections), a partition answers nothing at all: open connections
get no acknowledgement and new ones no reply to their SYN, and both ends live on: the
server keeps the sessions, and the owner-lease advisory locks, of connections the agentfold
process gave up on, until it hears that they are closed.

What a host must see: every request answers within bounds during the partition (the
statement watchdog, ``AGENTFOLD_PG_STATEMENT_WAIT``, gives up on the unanswered sessions and
closes them; with neither it nor ``AGENTFOLD_PG_TCP_TIMEOUT``, half the requests were still
waiting when the network came back), and afterwards the server takes its run back by itself,
with the call that was under way recorded unknown (it ran once; it is never called again),
instead of a run stuck under a lease. The lease comes back within seconds: the connections
this process closed during the partition end the server's sessions as soon as their
closing packets get through (measured: ~3 s after the network came back).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from tests.http_api.support import ok, problem, send_at_once, start_server, wait_until
from tests.http_api.test_serve_failures import blocked_in_the_tool
from tests.test_cli_interaction import one_tool_call
from tests.test_pg_silent_cut import packets_dropped, require_iptables
from tests.test_shutdown_during_outage import OwnServer, _read_fifo, own_pg  # noqa: F401 - a fixture

#: Seconds the network stays partitioned: longer than every bound a request has.
PARTITION_SECONDS = 24


def test_requests_answer_during_a_network_partition_and_the_run_is_taken_back_after_it(
    own_pg: OwnServer, tmp_path: Path,  # noqa: F811 - the fixture imported above
) -> None:
    require_iptables()
    fifo = tmp_path / "pay.fifo"
    os.mkfifo(fifo)
    wait = 3
    server = start_server(own_pg.url, tmp_path, env={"AGENTFOLD_PG_STATEMENT_WAIT": str(wait),
                                                     "AGENTFOLD_PG_POOL_WAIT": str(wait)})
    try:
        c = server.client()
        run = ok(c.post("/runs", json={"scenario": one_tool_call(fifo), "start_id": "partition", "wait": 0}), 201)
        tree_id = run["tree"]["tree_id"]
        wait_until(lambda: blocked_in_the_tool(server.proc.pid), timeout=30)  # the server holds the run's lease
        for _ in range(3):  # pooled connections open and idle: they are cut too
            ok(c.get("/runs"))
        requests = [("GET", "/runs")] * 4 + [
            ("GET", f"/runs/{tree_id}"), ("GET", f"/runs/{tree_id}/results"), ("GET", "/unknown-effects"),
            ("GET", "/health"),
        ]
        with packets_dropped(own_pg.url, None):
            cut_at = time.monotonic()
            answers = send_at_once(server, requests, PARTITION_SECONDS - 1)
            # Every request answered while the network was still down, within the statement wait,
            # a pool wait or two and the connect timeout of an attempt in progress.
            assert len(answers) == len(requests), f"unanswered in {PARTITION_SECONDS} s: {answers}"
            assert all(status in (200, 503, 504) for _, status, _, _ in answers), answers
            assert all("Traceback" not in text for *_, text in answers), answers
            assert any(status == 503 for _, status, _, _ in answers), answers
            down = problem(httpx.get(server.url + "/health", timeout=30), 503, "store.unavailable")
            assert down["detail"], down
            time.sleep(max(0.0, cut_at + PARTITION_SECONDS - time.monotonic()))
        healed = time.monotonic()
        # The network is back: the server's sessions this process closed end, the run's lease
        # with them, and the agentfold server adopts its run again by itself.
        assert wait_until(lambda: httpx.get(server.url + "/health", timeout=30).status_code == 200, timeout=60)
        calls = _read_fifo(fifo)  # the tool that was under way returns now
        wait_until(lambda: calls, timeout=30)
        state = wait_until(lambda: (r := ok(c.get(f"/runs/{tree_id}")))["classification"] != "progress" and r,
                           timeout=60)
        taken_back = time.monotonic() - healed
        assert state["classification"] == "parked", state
        # Its outcome is unknown: the append of its result was lost with the lease; a host settles it.
        unknown = ok(c.get(f"/runs/{tree_id}/unknown-effects"))
        assert len(unknown["unknown_effects"]) == 1, unknown
        time.sleep(1.0)
        assert calls == [1], calls  # the tool ran once and was never called again
        assert taken_back < 45, taken_back
    finally:
        server.stop()
