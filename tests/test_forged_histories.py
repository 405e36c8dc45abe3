"""Histories with a valid digest chain that the kernel never wrote (a forged export, a hand
edit under a recomputed chain) never make a host call a dispatcher the kernel would not have
called (found by a review of crafted histories)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentfold.domain.integrity import chain_digest, content_bytes, seal, unseal
from tests.test_cli import agentfold, count, ok, start_crashing_run


def rewrite(path: Path, out: Path, edit: Any) -> None:
    """Copy an export file, ``edit(position, topic, body)`` applied to each event body, with
    its digest chain computed again (what a forger with the product's own code can do)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    previous = None
    written = []
    for line in lines:
        if "state" not in line:
            line["end"]["head_digest"] = previous
            written.append(line)
            continue
        unsealed = unseal(line["state"].encode())
        body = unsealed.body
        edit(line["position"], line["topic"], body)
        content = content_bytes(body, unsealed.timestamp)
        digest = chain_digest(previous, line["tree"], line["position"], line["topic"].split(":", 1)[1], content)
        line["state"] = seal(content, digest).decode()
        previous = digest
        written.append(line)
    out.write_text("".join(json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n" for line in written))


def test_a_declaration_forged_to_say_same_identity_is_not_dispatched_again(tmp_path: Path) -> None:
    # The review's case: the charge (policy never) dispatched, the process killed inside the
    # call; its EffectDeclared edited to `replay: same_identity` and the chain recomputed.
    # Import and `audit verify` accepted it and `recover` charged the customer a second time.
    # A call is made again only when its Program, asked again, says same_identity too.
    source = f"sqlite:///{tmp_path / 'source.db'}"
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(source, log, start_id="order-1", point="in-dispatch:1")
    assert count(log, "charge") == 1
    exported = tmp_path / "order-1.jsonl"
    ok(agentfold("export", "order-1", "--out", str(exported), store=source))
    forged = tmp_path / "forged.jsonl"
    edited: list[int] = []

    def same_identity(position: int, topic: str, body: dict[str, Any]) -> None:
        if topic.endswith(":EffectDeclared") and body.get("target") == "dispatcher" and not edited:
            body["replay"] = "same_identity"
            edited.append(position)

    rewrite(exported, forged, same_identity)
    assert edited
    target = f"sqlite:///{tmp_path / 'target.db'}"
    ok(agentfold("import", str(forged), store=target))
    ok(agentfold("recover", "--json", store=target))
    assert count(log, "charge") == 1  # not charged again
    listed = ok(agentfold("unknown", "--json", store=target)).json()["unknown_effects"]
    assert len(listed) == 1 and listed[0]["diagnostic"]["code"] == "engine.dispatch.interrupted", listed
