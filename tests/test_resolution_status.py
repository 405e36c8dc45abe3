"""A resolution's ``status`` is exactly ``succeeded`` or ``failed``: anything else is refused.

``Host.resolve(effect_id, output=..., status=X)`` used to settle the Effect as succeeded for
any X other than exactly ``"failed"`` (a typo ``"fail"``, ``"FAILED"``, ``0``): a declined
payment became a success. Now the Python host gets ``host.resolution_invalid`` (with a hint)
and nothing is appended; the HTTP API refuses the same body with 422 before it reaches the
rules (its request model names the two values).
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from agentfold.adapters.dispatch import FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.http_api import ApiService, create_app
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import Digest
from agentfold.domain.program import Complete, Continue, Descriptor, Program, Step, dispatcher_effect
from tests.kernel_programs import JsonStrategy

BAD_STATUSES: list[Any] = ["fail", "FAILED", "Succeeded", "success", "", "failed ", 0, 1, True]


class OneCall(JsonStrategy):
    """One dispatcher call, then complete with how it settled."""

    def initial(self, input: Any) -> Any:
        return {}

    def decide(self, state: Any, window: Any) -> Step:
        if not window:
            return Step(0, Continue((dispatcher_effect({"charge": 12}),)))
        return Step(1, Complete({"status": window[0].status.value, "payload": window[0].payload}))


def lost_reply(request: Any, context: Any) -> Any:
    raise ConnectionError("the payment provider reset the connection")


def charge() -> Program:
    return Program(Descriptor("test.charge"), OneCall(), implementation_digest=Digest.of(b"charge"),
                   configuration_digest=Digest.of(b"-"), dispatcher=FunctionDispatcher(lost_reply))


def unknown_charge(runtime: Runtime, start_id: str) -> tuple[Host, Any, dict[str, Any]]:
    """A run whose one call's outcome is unknown: the Host, the run, and its unknown Effect."""
    host = Host(runtime)
    run = runtime.start(charge(), {}, start_id=start_id)
    runtime.wait_idle(run.tree_id, timeout=10)
    [unknown] = host.unknown(run.tree_id)
    return host, run, unknown


def test_host_resolve_refuses_a_status_that_is_not_succeeded_or_failed_and_appends_nothing() -> None:
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            host, run, unknown = unknown_charge(runtime, "charge-1")
            version = store.head(run.tree_id).version
            for status in BAD_STATUSES:
                with pytest.raises(InvalidInput) as refused:
                    host.resolve(unknown["effect_id"], output={"declined": True}, status=status)
                assert refused.value.code == "host.resolution_invalid", status
                assert repr(status) in refused.value.message, refused.value.message
                assert "'succeeded' or 'failed'" in refused.value.message
                assert 'status= "succeeded" or "failed"' in refused.value.hint
                assert store.head(run.tree_id).version == version, status
                assert [u["effect_id"] for u in host.unknown(run.tree_id)] == [unknown["effect_id"]]

            settlement = host.resolve(unknown["effect_id"], output={"declined": True}, status="failed")
            assert settlement.status.value == "failed"
            assert runtime.result(run.tree_id, timeout=10).output == {"status": "failed", "payload": {"declined": True}}
    finally:
        store.close()


@pytest.mark.parametrize("status", ["succeeded", None])
def test_host_resolve_still_settles_succeeded_with_the_word_or_by_default(status: str | None) -> None:
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            host, run, unknown = unknown_charge(runtime, "charge-ok")
            settlement = host.resolve(unknown["effect_id"], output={"charged": 12}, status=status)
            assert settlement.status.value == "succeeded"
            assert runtime.result(run.tree_id, timeout=10).output == {"status": "succeeded", "payload": {"charged": 12}}
    finally:
        store.close()


def test_the_http_api_refuses_a_bad_status_with_422_and_appends_nothing() -> None:
    store = EventStore("memory:")
    service = ApiService.open(store, ProgramSources((charge(),)), "t0ken", follow=False)
    app = create_app(service)

    async def post(url: str, body: dict[str, Any]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     headers={"Authorization": "Bearer t0ken"}) as client:
            return await client.post(url, json=body)

    try:
        run = service.runtime.start(charge(), {}, start_id="charge-http")
        service.runtime.wait_idle(run.tree_id, timeout=10)
        [unknown] = Host(service.runtime).unknown(run.tree_id)
        version = store.head(run.tree_id).version
        url = f"/unknown-effects/{unknown['effect_id']}/resolve"
        for status in BAD_STATUSES:
            answer = anyio.run(post, url, {"output": {"declined": True}, "status": status})
            assert answer.status_code == 422, (status, answer.text)
            assert answer.json()["code"] == "http.request_invalid", answer.text
            assert store.head(run.tree_id).version == version, status
        answer = anyio.run(post, url, {"output": {"declined": True}, "status": "failed", "wait": 10})
        assert answer.status_code == 200, answer.text
        assert answer.json()["resolution"]["status"] == "failed"
    finally:
        service.close()
        store.close()
