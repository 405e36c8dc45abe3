"""Histories a writer never stores are refused where every command meets them (found by a
review that fed thousands of altered, correctly chained histories to the fold and the CLI).

Every append holds whole Steps, and position 1 is the TreeStarted: a history that ends
inside a Step, or starts with anything else, was cut or forged by hand. `audit verify` named
both, but `show` and `replay` answered as if the history were sound, and `recover` failed
with a bare FoldError / AssertionError (`cli.internal`), giving up on every other tree it was
to recover. A wait built directly with a response schema no answer can be checked against was
taken, and every answer then stopped the owner with a bare TypeError. Real SQLite files and
PostgreSQL databases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import TOPIC_PREFIX
from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import TreeID
from agentfold.domain.integrity import chain_digest, seal, unseal
from agentfold.domain.program import Complete, Continue, Descriptor, Effect, Program, Step, Target
from tests.audit.support import Sql
from tests.crash import programs
from tests.crash.support import crash, runtime_for, tree_of
from tests.kernel_programs import IMPL, JsonStrategy, config_digest


def _two_trees(url: str, tmp_path: Path) -> tuple[TreeID, TreeID]:
    """A finished chain (to be damaged) and a healthy run whose owner died inside its call."""
    log = tmp_path / "calls.jsonl"
    with runtime_for(url, "chain", log) as (_, runtime):
        assert runtime.start(programs.build("chain", log), {"n": 1}, start_id="damaged").result(timeout=30).status == "completed"
    crash(url, log, "start", "--program", "chain", "--start-id", "healthy", "--input", '{"n": 1}',
          "--crash", "in-dispatch:1")
    return tree_of("damaged"), tree_of("healthy")


@pytest.mark.parametrize("damage", ["cut inside its last Step", "a first event that is no TreeStarted"])
def test_a_cut_or_forged_history_is_store_corrupt_and_recover_goes_on_with_the_others(
    durable_store_url: str, tmp_path: Path, damage: str
) -> None:
    damaged, healthy = _two_trees(durable_store_url, tmp_path)
    sql = Sql(durable_store_url)
    rows = sql.rows(damaged)
    if damage == "cut inside its last Step":
        # The root's `complete` Step without its ProcessTerminated, the index row moved to the cut.
        assert rows[-2][1].endswith("StepCommitted") and rows[-1][1].endswith("ProcessTerminated")
        kept = rows[:-1]
        position, rule = len(rows), "step.sequence"
    else:
        kept = [rows[1], rows[0], *rows[2:]]  # a Step first, the TreeStarted second
        position, rule = 1, "stream.first_event"
    # Written again with a sound digest chain, as someone with write access to the database
    # (or a damaged restore) leaves it, the index row naming the new end of a live run.
    sql.delete(damaged, *[v for v, _, _ in rows])
    previous = None
    for at, (_, topic, state) in enumerate(kept, start=1):
        sealed = unseal(state)
        tag = topic.removeprefix(TOPIC_PREFIX)
        previous = chain_digest(previous, str(damaged), at, tag, sealed.content)
        sql.insert(damaged, at, topic, seal(sealed.content, previous))
    sql.set_head(damaged, len(kept), previous or "")
    sql._run("UPDATE agentfold_trees SET status = 'running', classification = 'progress' WHERE tree_id = ?",
             (str(damaged),))
    with runtime_for(durable_store_url, "chain", tmp_path / "calls.jsonl") as (store, runtime):
        with pytest.raises(CorruptStream) as corrupt:
            store.load(damaged)
        assert (corrupt.value.position, corrupt.value.rule) == (position, rule)
        with pytest.raises(CorruptStream) as corrupt:
            runtime.recover(str(damaged))
        assert (corrupt.value.code, corrupt.value.rule) == ("store.corrupt", rule)
        runtime.recover()  # every tree: the damaged one is reported, the healthy one recovered
        assert runtime.recover_failures[damaged].code == "store.corrupt"
        assert healthy not in runtime.recover_failures
        assert store.load(healthy).state.root.unknown_effects()  # taken over: its call is unknown now


class _OpensABadWait(JsonStrategy):
    def initial(self, input: Any) -> Any:
        return {"phase": "start"}

    def decide(self, state: Any, window: Any) -> Step:
        if state["phase"] == "start":
            wait = Effect(Target.FRAMEWORK, {"operation": "wait", "key": "approval", "response_schema": {"type": 5}})
            return Step(0, Continue((wait,)), {"phase": "waiting"})
        return Step(len(window), Complete(None), {"phase": "done"})


def test_a_wait_built_directly_with_an_invalid_response_schema_is_refused_at_its_step(store_url: str) -> None:
    program = Program(Descriptor("bad.wait"), _OpensABadWait(), implementation_digest=IMPL,
                      configuration_digest=config_digest("bad.wait"))
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {}, start_id="bad-wait").result(timeout=30)
        assert result.status == "failed" and result.termination is not None
        failure = result.termination["failure"]
        assert failure["code"] == "execution.effect.invalid"
        assert "invalid type 5 at #response_schema/type" in failure["message"]
    finally:
        store.close()
