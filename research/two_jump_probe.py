"""What the second jump from the zero state does to a map's T = 0 draft.

A map distilled with zero-state jumps drafts T = 0 rows from the zero state: one jump (0, 1),
or two jumps (0, t_1) then (t_1, 1) from t_1 * the first jump's estimate (its softmax, or its
one-hot argmax: the map's two_jump_estimate, as the proposer drafts). On held-out blocks this
prints, per slot, the accuracy against the target's own answer of the one-jump draft, of the
first jump's estimate and of the two-jump draft, how often the second jump changes the first's
argmax and whether a change fixes or breaks the slot, and the mean accepted length along the
reference (leading right slots + 1, what a T = 0 round commits when the data are the target's
greedy answers). A second jump that changes no slot, or breaks as many as it fixes, adds a
pass and nothing else.

Where acceptance is decided: a second jump adds acceptance by fixing the first jump's first
wrong slot and loses it by breaking a slot before it. Per block this prints how often each
happens, and the bound of one fix: the accepted length had the second jump fixed exactly the
first wrong slot and kept the rest. Two ways a second pass could find that slot are measured
beside it: its own confidence (the two-jump draft with a change kept only where the second
jump's probability reaches a threshold, `gamma_kept`), and the tokens before each slot (from a
research.bound output holding the first drafter and the EAGLE-style chain, greedy, per anchor:
one parallel pass of the chain over the first draft keeps its slot k right only if the chain is
right given the draft's slots before k, so it accepts 1 + min(A_chain, A_first + 1), A the
accepted draft tokens; `refine_bound`).

    python -m research.two_jump_probe --target checkpoints/demo-target \
        --data runs/test-greedy --map eq=checkpoints/demo-flashmap-eq --out runs/probe.json
    python -m research.two_jump_probe --refine-bound docs/experiments/2026-12-06-flashmap-vs-dflash-dev/t0.json \
        --first dflash --chain chain
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from drafter_service.flashmap_dit import FlashMapDiT
from training.flow import Batch, carried_estimate
from training.shuffle_test import paired_bootstrap

KEEP_THRESHOLDS = (0.5, 0.7, 0.9)


def accepted(draft: Tensor, b: Batch) -> Tensor:
    """[N] leading slots of draft [N, K] equal to the block, + 1 (the target's own token)."""
    right = (draft == b.target) & b.mask
    return right.long().cumprod(-1).sum(-1) + 1


def first_error(first: Tensor, two: Tensor, b: Batch) -> dict[str, Tensor]:
    """Per block [N], for a first draft and a second [N, K]: `error` the first draft has a wrong
    slot inside the mask, `fixes` the second is right at the first wrong slot, `breaks` the
    second is wrong at a slot before it, `one_fix` the accepted length had exactly that slot
    been fixed and the rest of the first draft kept."""
    m, y = b.mask, b.target
    right = (first == y) & m  # [N, K]
    lead = accepted(first, b) - 1  # [N] leading right slots of the first draft
    err = lead < m.sum(-1)
    at = torch.nn.functional.one_hot(lead.clamp(max=m.shape[1] - 1), m.shape[1]).bool()
    at &= err[:, None]  # [N, K] the first wrong slot
    before = torch.arange(m.shape[1])[None] < lead[:, None]  # [N, K]
    return dict(
        error=err,
        fixes=((two == y) & at).any(-1),
        breaks=((two != y) & before & m).any(-1),
        one_fix=(right | at).long().cumprod(-1).sum(-1) + 1,
    )


@torch.no_grad()
def probe(model: FlashMapDiT, batches: list[Batch]) -> dict:
    """Slot accuracies and change counts of the zero-state drafts (module docstring)."""
    t_1 = float(model.time_grid(2)[1])
    keys = ("one_acc", "first_acc", "two_acc", "changed", "fixed", "broken")
    hits = dict.fromkeys(keys, 0.0)
    gamma = {
        "one": 0.0,
        "two": 0.0,
        "one_fix": 0.0,
        **{f"kept_{th}": 0.0 for th in KEEP_THRESHOLDS},
    }
    per_block = {"fixes_first_error": 0.0, "breaks_before_it": 0.0}
    slots = blocks = with_error = 0
    for b in batches:
        ctx, n, V = b.context(model), len(b.anchor), model.cfg.vocab_size
        zero = torch.zeros(n, model.cfg.block_size, V)
        one = model(zero, 0.0, 1.0, b.anchor, ctx).argmax(-1)  # [N, K]
        first_logits = model(zero, 0.0, t_1, b.anchor, ctx)
        first = first_logits.argmax(-1)
        estimate = carried_estimate(first_logits, model.cfg)  # as trained and served
        prob, two = model(t_1 * estimate, t_1, 1.0, b.anchor, ctx).softmax(-1).max(-1)
        m, y = b.mask, b.target
        e = first_error(first, two, b)
        per_block["fixes_first_error"] += float(e["fixes"].sum())
        per_block["breaks_before_it"] += float(e["breaks"].sum())
        gamma["one_fix"] += float(e["one_fix"].sum())
        with_error += int(e["error"].sum())
        changed = (two != first) & m
        for key, v in (
            ("one_acc", (one == y) & m),
            ("first_acc", (first == y) & m),
            ("two_acc", (two == y) & m),
            ("changed", changed),
            ("fixed", changed & (two == y)),
            ("broken", changed & (first == y)),
        ):
            hits[key] += float(v.sum())
        gamma["one"] += float(accepted(one, b).sum())
        gamma["two"] += float(accepted(two, b).sum())
        for th in KEEP_THRESHOLDS:  # the second jump's change kept only where it is this sure
            gamma[f"kept_{th}"] += float(accepted(torch.where(prob >= th, two, first), b).sum())
        slots, blocks = slots + int(m.sum()), blocks + n
    return dict(
        t_1=t_1,
        estimate=model.cfg.two_jump_estimate,
        slots=slots,
        blocks=blocks,
        blocks_with_error=with_error,
        **{k: v / slots for k, v in hits.items()},
        **{f"gamma_{k}": v / blocks for k, v in gamma.items()},
        fixes_first_error=per_block["fixes_first_error"] / max(with_error, 1),
        breaks_before_it=per_block["breaks_before_it"] / blocks,
    )


def refine_bound(cells: dict, first: str, chain: str) -> dict:
    """The accepted length of one parallel chain pass over `first`'s drafts, from a
    research.bound output at T = 0 holding both rows per anchor (module docstring), paired
    against `first` with a 95% interval over sequences; and the two rows' own means."""
    rows = cells["rows"]
    a, c = rows[first]["per_anchor"], rows[chain]["per_anchor"]
    if a["seq"] != c["seq"]:
        raise ValueError(f"rows {first!r} and {chain!r} were not measured on the same anchors")
    ga, gc = np.asarray(a["gamma"], np.float64), np.asarray(c["gamma"], np.float64)
    refined = 1 + np.minimum(gc - 1, ga)  # A_first + 1 = ga: the fixed slot, then nothing
    dom = np.asarray(a.get("domain", ["all"] * len(ga)))
    return dict(
        first=float(ga.mean()),
        chain=float(gc.mean()),
        refined=float(refined.mean()),
        refined_minus_first=paired_bootstrap(refined, ga, np.asarray(a["seq"])),
        by_domain={
            d: dict(first=float(ga[dom == d].mean()), refined=float(refined[dom == d].mean()))
            for d in sorted(set(dom.tolist()))
        },
    )


def format_table(results: dict) -> str:
    lines = [
        "| map | estimate | acc 1 jump | acc first jump | acc 2 jumps | 2nd jump changes "
        "| fixes | breaks | fixes the first error | breaks before it | accepted 1 jump "
        "| 2 jumps | one fix (bound) | 2 jumps, changes kept at p >= "
        + " / ".join(str(th) for th in KEEP_THRESHOLDS)
        + " | slots |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['estimate']} | {r['one_acc']:.3f} | {r['first_acc']:.3f} "
            f"| {r['two_acc']:.3f} | {r['changed']:.3f} | {r['fixed']:.3f} | {r['broken']:.3f} "
            f"| {r['fixes_first_error']:.3f} | {r['breaks_before_it']:.3f} "
            f"| {r['gamma_one']:.2f} | {r['gamma_two']:.2f} | {r['gamma_one_fix']:.2f} | "
            + " / ".join(f"{r[f'gamma_kept_{th}']:.2f}" for th in KEEP_THRESHOLDS)
            + f" | {r['slots']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from drafter_service.checkpoint import load_drafter
    from research.map_fidelity import flow_check_draw

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="the target checkpoint (with --map)")
    p.add_argument("--data", help="held-out drafter data with features (with --map)")
    p.add_argument("--map", action="append", default=[], help="NAME=MAP_DIR (repeatable)")
    p.add_argument("--refine-bound", help="a research.bound output (T = 0, per anchor)")
    p.add_argument("--first", default="dflash", help="--refine-bound: the first drafter's row")
    p.add_argument("--chain", default="chain", help="--refine-bound: the greedy chain's row")
    p.add_argument("--batches", type=int, default=16, help="held-out batches of 32 blocks")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.map and not args.refine_bound:
        p.error("give --map and/or --refine-bound")
    if args.map and not (args.target and args.data):
        p.error("--map needs --target and --data")
    results = {}
    if args.refine_bound:
        cells = json.loads(Path(args.refine_bound).read_text())
        results["refine_bound"] = r = refine_bound(cells, args.first, args.chain)
        d = r["refined_minus_first"]
        print(
            f"{args.first} {r['first']:.2f}, chain {r['chain']:.2f}, one chain pass over "
            f"{args.first}'s draft {r['refined']:.2f} ({d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}])"
        )
    for spec in args.map:
        name, path = spec.split("=", 1)
        model = load_drafter(path, args.target).eval()
        batches = flow_check_draw(args.data, args.batches, model.cfg.block_size)
        results[name] = probe(model, batches)
    if args.map:
        print(format_table({k: v for k, v in results.items() if k != "refine_bound"}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
