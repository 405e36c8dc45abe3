"""Resolving an unknown model call of a Program that reduces its context, from every surface.

With a ``context_policy`` the model receives other messages than the working context, so a
host resolving the call must say which (``settle_model_result`` refuses a response without
them: the working context becomes exactly what the model saw). The CLI (``resolve
--effective-messages``), the HTTP API (``effective_messages``) and the Python Host
(``Host.resolve(effective_messages=...)``) take them; before, only a Python caller of
``settle_model_result`` could, and the CLI's refusal asked for something no option gave.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import EffectResolved
from agentfold.domain.ids import EffectID, TreeID
from tests.audit.support import cli
from tests.http_api.support import ROOT, TOKEN, problem, server_env
from tests.reduced_program import program, sources

SENT = [{"role": "user", "content": "what is up?"}]
ANSWER = {"finish_reason": "stop", "message": {"content": "all quiet"}}


def parked(url: str) -> tuple[str, str]:
    """A run whose first model call is unknown: (tree id, effect id)."""
    p = program()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([p])) as runtime:
            handle = runtime.start(p, {"messages": [{"role": "system", "content": "a long preamble"}, *SENT]})
            tree = runtime.wait_idle(handle.tree_id)
            [effect] = list(tree.unknown_ids)
            return str(handle.tree_id), str(effect)
    finally:
        store.close()


def recorded_context(url: str, tree_id: str, effect: str) -> list[tuple[str, Any]]:
    """The messages the resolution made the working context (its settlement's
    ``replacement_messages``), as (role, text)."""
    store = EventStore(url)
    try:
        [resolved] = [r.event for r in store.read(TreeID(tree_id))
                      if isinstance(r.event, EffectResolved) and r.event.effect_id == EffectID(effect)]
        assert resolved.resolved_by == "host" and resolved.status == "succeeded"
        replaced = resolved.payload["model_result"]["replacement_messages"]  # type: ignore[index]
        return [(m["role"], m["content"][0]["text"]) for m in replaced]
    finally:
        store.close()


def test_the_cli_resolves_a_reduced_model_call_with_the_messages_the_model_received(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    tree_id, effect = parked(url)
    refused = cli(capsys, "resolve", effect, "--model-response", json.dumps(ANSWER), "--json", "--store", url,
                  sources=sources())
    assert refused.code == 2 and "give the effective messages" in refused.stderr, refused.stderr
    alone = cli(capsys, "resolve", effect, "--effective-messages", json.dumps(SENT), "--json", "--store", url,
                sources=sources())
    assert alone.code == 2 and "--effective-messages goes with --model-response" in alone.stderr, alone.stderr
    both_stdin = cli(capsys, "resolve", effect, "--model-response", "-", "--effective-messages", "-", "--json",
                     "--store", url, sources=sources())
    assert both_stdin.code == 2 and "cannot both read standard input" in both_stdin.stderr, both_stdin.stderr
    not_a_list = cli(capsys, "resolve", effect, "--model-response", json.dumps(ANSWER), "--effective-messages", "{}",
                     "--json", "--store", url, sources=sources())
    assert not_a_list.code == 2 and "a list of the messages the model received" in not_a_list.stderr, not_a_list.stderr
    done = cli(capsys, "resolve", effect, "--model-response", json.dumps(ANSWER), "--effective-messages",
               json.dumps(SENT), "--json", "--store", url, sources=sources())
    assert done.code == 0, done.stderr
    assert done.json()["tree"]["status"] == "completed"
    # The working context became what the model saw: no system message.
    assert recorded_context(url, tree_id, effect) == [("user", "what is up?")]


def test_the_python_host_resolves_a_reduced_model_call_with_the_messages_the_model_received(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'host.db'}"
    tree_id, effect = parked(url)
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program()])) as runtime:
            host = Host(runtime)
            with pytest.raises(InvalidInput, match="give the effective messages"):
                host.resolve(effect, model_response=ANSWER)
            host.resolve(effect, model_response=ANSWER, effective_messages=SENT)
            assert runtime.result(tree_id, 30).status == "completed"
    finally:
        store.close()
    assert recorded_context(url, tree_id, effect) == [("user", "what is up?")]


SERVE = """
import sys
from agentfold.adapters.cli import main
from tests.reduced_program import sources
sys.exit(main(sys.argv[1:], sources=sources()))
"""


def test_the_http_api_resolves_a_reduced_model_call_with_the_messages_the_model_received(tmp_path: Path) -> None:
    import httpx

    url = f"sqlite:///{tmp_path / 'http.db'}"
    tree_id, effect = parked(url)
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--store", url, "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=server_env())
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        c = httpx.Client(base_url=started["listening"], headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        path = f"/unknown-effects/{effect}/resolve"
        body = problem(c.post(path, json={"model_response": ANSWER}), 422, "interaction.settlement.invalid")
        assert "give the effective messages" in body["detail"], body
        problem(c.post(path, json={"effective_messages": SENT}), 422, "http.request_invalid")
        done = c.post(path, json={"model_response": ANSWER, "effective_messages": SENT, "wait": 30})
        assert done.status_code == 200, done.text
        assert done.json()["tree"]["status"] == "completed"
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert recorded_context(url, tree_id, effect) == [("user", "what is up?")]
