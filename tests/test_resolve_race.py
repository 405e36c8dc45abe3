"""The loser of two hosts resolving one unknown Effect at once is told it lost.

Each surface looks the effect up in the index (still unknown), folds the run, builds the
settlement from the host's description, then lets the kernel check it. When another
host's resolution committed between the lookup and the fold, the effect is no longer
there to tell its kind: the loser was told its (valid) description did not fit
(``--disposition applies to tool calls only``, ``is not a model call``: a usage error, a
422 over HTTP) instead of ``engine.effect.not_pending``. Found by a race audit storming
one run from the CLI, HTTP and the Python Host (2 in 8-12 storms); here the interleaving
is made deterministic: the winner, another process, resolves right after the lookup.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import agentfold.adapters.cli as cli_module
import agentfold.adapters.host as host_module
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import default_sources
from agentfold.domain.errors import AgentfoldError
from tests.audit.support import cli
from tests.test_cli_interaction import run_json, unknowns, write

SCENARIOS = {
    "tool": {"name": "race", "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"tool_calls": [{"id": "c1", "name": "flaky", "arguments": "{}"}]}},
        {"finish_reason": "stop", "message": {"content": "done"}}]},
        "tools": [{"name": "flaky", "result": {"error": "boom"}}]},
    "model": {"name": "race", "model": {"responses": [{"error": "model down"}]}},
}
WINNER = {"tool": ["--output", '"won"', "--disposition", "succeeded"],
          "model": ["--model-response", '{"finish_reason": "stop", "message": {"content": "won"}}']}
LOSER = {"tool": {"output": "lost", "disposition": "failed"},
         "model": {"model_response": {"finish_reason": "stop", "message": {"content": "lost"}}}}


def parked(tmp_path: Path, kind: str) -> tuple[str, str]:
    url = f"sqlite:///{tmp_path / 'race.db'}"
    tree = run_json(url, write(tmp_path, SCENARIOS[kind]))
    [entry] = unknowns(url, tree["tree_id"])
    return url, entry["effect_id"]


def losing_lookup(monkeypatch: pytest.MonkeyPatch, module: Any, url: str, effect: str, kind: str) -> None:
    """``module``'s index lookup finds the effect unknown, then another process resolves it."""
    lookup = module.unknown_effect_tree

    def lookup_then_lose(*args: Any, **kwargs: Any) -> Any:
        found = lookup(*args, **kwargs)
        won = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", "resolve", effect, *WINNER[kind],
                              "--store", url], capture_output=True, text=True, timeout=120)
        assert won.returncode == 0, won.stderr
        return found

    monkeypatch.setattr(module, "unknown_effect_tree", lookup_then_lose)


@pytest.mark.parametrize("kind", ["tool", "model"])
def test_the_python_host_that_loses_a_resolve_race_is_told_the_effect_is_not_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    url, effect = parked(tmp_path, kind)
    losing_lookup(monkeypatch, host_module, url, effect, kind)
    store = EventStore(url)
    try:
        with Runtime(store, default_sources().catalog()) as runtime:
            with pytest.raises(AgentfoldError) as lost:
                Host(runtime, default_sources()).resolve(effect, **LOSER[kind])
    finally:
        store.close()
    assert lost.value.code == "engine.effect.not_pending", lost.value


@pytest.mark.parametrize("kind", ["tool", "model"])
def test_the_cli_that_loses_a_resolve_race_is_told_the_effect_is_not_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    url, effect = parked(tmp_path, kind)
    losing_lookup(monkeypatch, cli_module, url, effect, kind)
    args = ["--output", '"lost"', "--disposition", "failed"] if kind == "tool" else [
        "--model-response", '{"finish_reason": "stop", "message": {"content": "lost"}}']
    lost = cli(capsys, "resolve", effect, *args, "--json", "--store", url)
    assert lost.code == 2
    assert lost.error()["code"] == "engine.effect.not_pending", lost.stderr
