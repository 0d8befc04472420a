"""Does a siblings tree accept what its rule says it should, on the drafters' real contexts?

At a node whose drafted token x ~ q (the drafter's top-m law) carries the rest of its top m as
leaves, multi-draft rejection sampling accepts some child with probability p(S), the target's
mass on the top m; the drafted token alone would be accepted with sum min(p, q). Per drafter,
every prompt is decoded at T = 1 with siblings (flashmap.inprocess.decode, tree_sampling
"siblings"), and at every round's first node the target's p and the drafter's q are read off
the verify pass (target_service.tree), so each round gives its predicted p(S), its
sum min(p, q) and whether a child was accepted. Per domain: the observed rate against p(S)
(a walk that lost mass, or leaves the target never reaches, would fall below it) and the gain
p(S) - sum min(p, q) on the same contexts, each with a 95% interval over prompts.

    python -m research.siblings_check --target checkpoints/demo-target \
        --eagle3 checkpoints/demo-eagle3 --flashmap checkpoints/demo-flashmap-eq \
        --dflash checkpoints/demo-dflash-eq --top-m 16 --max-prompts 12 \
        --out docs/results/trees/siblings_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import target_service.tree as tree
from flashmap.measure import bootstrap_ci, make_requests
from flashmap.prompts import TEST_PROMPTS


def first_node(row, probs) -> tuple[float, float]:
    """p(S) and sum min(p, q) at the anchor's drafted child (the first node of the spine)."""
    p = probs[0].double().cpu().numpy()
    ids, q = row.support_ids[0], row.support_q[0]
    keep = ids >= 0
    return float(p[ids[keep]].sum()), float(np.minimum(p[ids[keep]], q[keep]).sum())


def check(drafter, engine, prompts: list[dict], top_m: int, max_new: int) -> list[dict]:
    """Per prompt: its rounds' predicted p(S), sum min(p, q) and first-node acceptances."""
    from flashmap.inprocess import decode

    seen: list[tuple[float, float, bool]] = []
    walk = tree._rejection_walk

    def spy(row, probs, noise):
        path, picked = walk(row, probs, noise)
        seen.append((*first_node(row, probs), len(path) > 0))
        return path, picked

    out = []
    tree._rejection_walk = spy
    try:
        for req in make_requests(prompts, 1.0, max_new, 0, engine.eos_token_ids):
            seen.clear()
            decode(engine, [req], drafter, tree_sampling="siblings", top_m=top_m)
            ps, single, acc = (np.array(x, float) for x in zip(*seen)) if seen else ([], [], [])
            out.append(
                dict(rounds=len(seen), p_support=list(ps), single=list(single), accepted=list(acc))
            )
    finally:
        tree._rejection_walk = walk
    return out


def summary(per_prompt: list[dict]) -> dict:
    """Pooled rates over rounds, with intervals over prompts (rounds of a prompt resampled
    together)."""
    rows = [r for r in per_prompt if r["rounds"]]
    pooled = lambda key: lambda i: np.concatenate([rows[j][key] for j in i]).mean()  # noqa: E731
    diff = lambda a, b: lambda i: pooled(a)(i) - pooled(b)(i)  # noqa: E731
    every = np.arange(len(rows))
    out = {"prompts": len(rows), "rounds": int(sum(r["rounds"] for r in rows))}
    for name, stat in (
        ("observed", pooled("accepted")),
        ("p_support", pooled("p_support")),
        ("single", pooled("single")),
        ("observed_minus_p_support", diff("accepted", "p_support")),
        ("gain", diff("p_support", "single")),
    ):
        out[name] = [float(stat(every)), *bootstrap_ci(stat, len(rows))]
    return out


def main(argv: list[str] | None = None) -> int:
    from target_service.engine import TargetEngine
    from training.eval_methods import Method, feature_layers_of, make_proposer
    from training.eval_prompts import read_prompts

    ap = argparse.ArgumentParser(prog="python -m research.siblings_check", description=__doc__)
    ap.add_argument("--target", required=True)
    ap.add_argument("--flashmap")
    ap.add_argument("--dflash")
    ap.add_argument("--eagle3")
    ap.add_argument("--top-m", type=int, default=16)
    ap.add_argument("--prompts", default=str(TEST_PROMPTS))
    ap.add_argument("--domains", default="")
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True, help="JSON: per drafter and domain, the summary")
    a = ap.parse_args(argv)
    methods = [
        Method(name, name, path, kind, departures=dep)
        for name, path, kind, dep in (
            ("flashmap", a.flashmap, "flashmap", {}),
            ("dflash", a.dflash, "dflash", {}),
            ("eagle3", a.eagle3, "eagle3", {"sampled_tree": False}),
        )
        if path
    ]
    if not methods:
        ap.error("give at least one drafter (--flashmap, --dflash, --eagle3)")
    by_domain, domains = read_prompts(a)
    longest = max(len(p["ids"]) for ps in by_domain.values() for p in ps)
    result: dict = {
        "command": "python -m research.siblings_check " + " ".join(argv or sys.argv[1:])
    }
    for m in methods:
        engine = TargetEngine(
            a.target,
            n_slots=1,
            feature_layers=feature_layers_of(m, a.target),
            max_seq_len=longest + a.max_new_tokens + 16 * a.top_m + 2,
        )
        drafter = make_proposer(m, a.target, engine, "cpu", {})
        for d in domains:
            s = summary(check(drafter, engine, by_domain[d], a.top_m, a.max_new_tokens))
            result.setdefault(m.name, {})[d] = s
            print(m.name, d, json.dumps(s), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
