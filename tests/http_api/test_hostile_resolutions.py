"""Hostile input over the HTTP API: resolutions refused with 422 ``interaction.settlement.invalid``
and scenarios refused with 422 ``scenario.invalid``, nothing appended
(tests/interaction/test_hostile_settlements.py and tests/test_scenario_validation_more.py
cover the CLI)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.http_api.support import ApiServer, ok, problem, wait_until
from tests.interaction.test_hostile_settlements import BAD_MODEL_RESPONSES, BAD_TOOL_OUTPUTS
from tests.test_cli_interaction import FINAL, LEFT_TO_HOST, two_call_round


def _unknown(c: httpx.Client, tree_id: str) -> list[dict[str, Any]]:
    return ok(c.get(f"/runs/{tree_id}/unknown-effects"))["unknown_effects"]  # type: ignore[no-any-return]


def test_the_http_api_refuses_hostile_resolutions_with_422_and_appends_nothing(api: ApiServer) -> None:
    c = api.client()
    doc = two_call_round(None, beta={"error": "the beta API timed out"}, final=LEFT_TO_HOST)
    tree = ok(c.post("/runs", json={"scenario": doc, "start_id": "hostile-http", "wait": 30}), 201)["tree"]
    tree_id = tree["tree_id"]
    [beta] = wait_until(lambda: _unknown(c, tree_id) or None)
    url = f"/unknown-effects/{beta['effect_id']}/resolve"
    version = ok(c.get(f"/runs/{tree_id}"))["version"]
    for output, where in BAD_TOOL_OUTPUTS:
        if output is None:
            continue  # `"output": null` is the request's own concern (http.request_invalid)
        body = problem(c.post(url, json={"output": output}), 422, "interaction.settlement.invalid")
        assert body["detail"].startswith(f"{where}:"), (output, body)
    assert ok(c.get(f"/runs/{tree_id}"))["version"] == version

    ok(c.post(url, json={"output": "b is B", "wait": 30}))
    [model] = wait_until(lambda: _unknown(c, tree_id) or None)
    assert model["kind"] == "model"
    model_url = f"/unknown-effects/{model['effect_id']}/resolve"
    version = ok(c.get(f"/runs/{tree_id}"))["version"]
    for response, said in BAD_MODEL_RESPONSES:
        body = problem(c.post(model_url, json={"model_response": response}), 422, "interaction.settlement.invalid")
        assert said in body["detail"], body
    assert ok(c.get(f"/runs/{tree_id}"))["version"] == version
    done = ok(c.post(model_url, json={"model_response": FINAL, "wait": 30}))
    assert done["tree"]["status"] == "completed"


def test_post_runs_refuses_scenario_faults_with_422_and_their_path(api: ApiServer) -> None:
    """The faults of tests/test_scenario_validation_more.py through ``POST /runs`` (a
    ``side_effect_log`` with a NUL character used to be an HTTP 500)."""
    from tests.test_scenario_validation_more import FAULTS

    c = api.client()
    # A run of its own, so the listing below is not empty whichever tests ran on this server before
    # (under pytest-xdist this test may be the first one of its module in its worker).
    ok(c.post("/runs", json={"scenario": two_call_round(None, final=FINAL), "start_id": "valid-before-the-faults",
                             "wait": 30}), 201)
    for name, doc, where, phrase in FAULTS:
        body = problem(c.post("/runs", json={"scenario": doc, "start_id": f"fault-{name}"}), 422, "scenario.invalid")
        assert body["detail"].startswith(f"{where}: ") and phrase in body["detail"], (name, body)
    started = [r["start_id"] for r in ok(c.get("/runs"))["runs"]]
    assert "valid-before-the-faults" in started and not [s for s in started if s.startswith("fault-")]


def test_effective_messages_cannot_rewrite_the_context_of_a_program_without_a_context_policy(api: ApiServer) -> None:
    """A review found ``effective_messages`` other than the request's adopted as the working
    context of a Program without a context policy: the next model request started with the
    forged messages. Without a policy the model received the request's messages exactly."""
    c = api.client()
    tree = ok(c.post("/runs", json={"scenario": two_call_round(None, final=LEFT_TO_HOST),
                                    "start_id": "forged-context", "wait": 30}), 201)["tree"]
    tree_id = tree["tree_id"]
    [model] = wait_until(lambda: _unknown(c, tree_id) or None)
    assert model["kind"] == "model"
    sent = model["request"]["model_call"]["request"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    url = f"/unknown-effects/{model['effect_id']}/resolve"
    version = ok(c.get(f"/runs/{tree_id}"))["version"]
    for forged in ([{"role": "user", "content": "FORGED"}], sent[:1], [*sent, {"role": "user", "content": "more"}]):
        body = problem(c.post(url, json={"model_response": FINAL, "effective_messages": forged, "wait": 30}), 422,
                       "interaction.settlement.invalid")
        assert "this program has no context policy" in body["detail"], body
        assert "omit the effective messages" in body["detail"], body
    assert ok(c.get(f"/runs/{tree_id}"))["version"] == version
    assert [u["effect_id"] for u in _unknown(c, tree_id)] == [model["effect_id"]]
    # Exactly the request's messages say nothing new: accepted, and no context is replaced.
    done = ok(c.post(url, json={"model_response": FINAL, "effective_messages": sent, "wait": 30}))
    assert set(done["resolution"]["payload"]["model_result"]) == {"response"}, done["resolution"]
    assert done["tree"]["status"] == "completed"
