"""A scenario's Tool child Program is as much the document's as its root Program.

Two documents with the same tool definitions but different scripted results (or side-effect
logs) are two different Programs: one long-lived runtime (``agentfold serve``, the Python API)
running both must call each document's own tools. Trees stored before the identity included
the document still load (the catalog falls back to the identity they were stored under).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import legacy_scenario_program, scenario_catalog, scenario_input, scenario_program
from agentfold.adapters.scenario import validate_scenario as validated
from tests.test_cli_interaction import FINAL, two_call_round


def tool_outputs(store: EventStore, tree_id: Any, catalog: Catalog) -> list[Any]:
    """The outputs of the tree's Tool children, in order."""
    loaded = store.load(tree_id, catalog.resolve)
    return [p.output for p in loaded.state.processes.values() if p.parent_id is not None]


def test_two_documents_with_the_same_tools_run_their_own_tools_in_one_runtime(tmp_path: Path) -> None:
    first = validated(two_call_round(tmp_path / "first.jsonl", alpha={"output": "alpha of the first"}, final=FINAL))
    second = validated(two_call_round(tmp_path / "second.jsonl", alpha={"output": "alpha of the second"}, final=FINAL))
    programs = [scenario_program(first), scenario_program(second)]
    [tools_1] = [c for c in programs[0].walk() if c.ref.name.endswith(".tools")]
    [tools_2] = [c for c in programs[1].walk() if c.ref.name.endswith(".tools")]
    assert tools_1.ref != tools_2.ref

    store = EventStore("memory:")
    catalog = scenario_catalog()
    with Runtime(store, catalog) as runtime:
        handles = [
            runtime.start(program, scenario_input(doc), start_id=f"s{i}", configuration=doc)
            for i, (program, doc) in enumerate(zip(programs, (first, second), strict=True))
        ]
        for handle in handles:
            assert handle.result(timeout=30).status == "completed"
        outputs = [tool_outputs(store, h.tree_id, catalog) for h in handles]
    alpha_texts = [out[0]["output"]["content"][0]["text"] for out in outputs]
    assert alpha_texts == ["alpha of the first", "alpha of the second"]
    assert (tmp_path / "first.jsonl").read_text().count("\n") == 2
    assert (tmp_path / "second.jsonl").read_text().count("\n") == 2


def test_a_tree_stored_under_the_legacy_tool_identity_still_loads_and_runs(tmp_path: Path) -> None:
    doc = validated(two_call_round(tmp_path / "log.jsonl", final=FINAL))
    legacy = legacy_scenario_program(doc)
    assert legacy.ref != scenario_program(doc).ref
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    with Runtime(store, Catalog([legacy])) as runtime:
        handle = runtime.start(legacy, scenario_input(doc), start_id="old", configuration=doc)
        assert handle.result(timeout=30).status == "completed"
    store.close()

    # A later release: only the loaders, which rebuild the current identity first.
    store = EventStore(url)
    catalog = scenario_catalog()
    with Runtime(store, catalog) as runtime:
        tree = runtime.capture(handle.tree_id)
    assert tree.root.status == "completed"
    assert tree.root.program == legacy.ref
    store.close()
