"""A second jump with a network of its own: trains a network for the second of a map's two T = 0
jumps from the zero state, and measures it against the map's one jump.

A map's second jump shares its weights with the first jump and with the flow's noisy states;
here it has weights of its own, trained on the path it serves. The second jump gets a copy of the map whose state
projection starts at zero and whose time input is the first jump's (0, 1), so before training
it drafts exactly the one-jump block (2 jumps = 1 jump, a tie). It is trained on the path the
proposer serves at T = 0: the map's frozen first jump 0 -> t_1 from the zero state, its estimate
carried to t_1 (the map's two_jump_estimate), then the copy, scored by cross-entropy against the
data on every slot (--loss all) or only on the slots acceptance counts, up to and including the
first jump's first wrong slot (--loss upto). The copy reads the map's context keys and values,
so the context cache of a served pair would be shared.

Every --eval-every steps it measures, on the held-out blocks of research.two_jump_probe, the
accepted length of 1 jump and of 2 jumps (leading right slots + 1), their paired difference with
a 95% bootstrap interval over sequences, the share of slots the second jump changes, how often
it fixes the one-jump draft's first wrong slot and breaks a slot before it, and the
cross-entropy of both on the scored slots of each loss (does the objective move while the
drafts do not?), and the same on as many blocks of its training data (does what it learns
hold beyond the sequences it trained on?); the
curve goes to OUT/curve.json and OUT/curve.png, the copy and its optimizer to OUT/state.pt
(a rerun with the same OUT resumes); --final-batches N measures the end state on N held-out
batches (OUT/final.json); --export DIR writes the map with the network as its second jump
(DrafterConfig.second_jump_net), which the proposer serves.

    python -m research.second_jump_refiner --target checkpoints/demo-target \\
        --map checkpoints/demo-flashmap-eq --data runs/published/data \\
        --heldout runs/dev-greedy --steps 1500 --lr 5e-5 --loss upto --out runs/refiner/upto
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from drafter_service.flashmap_dit import FlashMapDiT
from research.two_jump_probe import accepted, first_error
from training.flow import Batch, carried_estimate, make_batch, slot_weights, weighted_ce
from training.loss_plot import save_figure
from training.sequence_stream import SequenceStream
from training.shuffle_test import paired_bootstrap

LOSSES = ("all", "upto")


def second_network(first: FlashMapDiT) -> FlashMapDiT:
    """The copy the second jump runs: the first jump's weights, its state projection zeroed."""
    second = copy.deepcopy(first).train()
    torch.nn.init.zeros_(second.state_in.weight)
    for p in second.parameters():
        p.requires_grad_(True)
    return second


def pair_checkpoint(first: FlashMapDiT, second: FlashMapDiT) -> FlashMapDiT:
    """The map with `second` as its second-jump network (DrafterConfig.second_jump_net): what
    the proposer serves (its T = 0 rows' second of two jumps)."""
    pair = FlashMapDiT(replace(first.cfg, second_jump_net=True))
    state = {
        **first.state_dict(),
        **{f"second_jump.{k}": v for k, v in second.state_dict().items()},
    }
    pair.load_state_dict(state)
    pair.set_target(first.embed, first.lm_head)
    return pair.eval()


def two_jumps(first: FlashMapDiT, second: FlashMapDiT, b: Batch) -> tuple[Tensor, Tensor]:
    """(one-jump logits, second-jump logits) [N, K, V] of the zero-state path: the frozen map's
    jumps 0 -> 1 and 0 -> t_1, then the second network from t_1 * the carried estimate."""
    t_1 = float(first.time_grid(2)[1])
    n, K, V = len(b.anchor), first.cfg.block_size, first.cfg.vocab_size
    with torch.no_grad():
        ctx, zero = b.context(first), torch.zeros(n, K, V)
        one = first(zero, 0.0, 1.0, b.anchor, ctx)
        y = first.embed_state(
            t_1 * carried_estimate(first(zero, 0.0, t_1, b.anchor, ctx), first.cfg)
        )
    mods = second.modulations(torch.zeros(n), torch.ones(n), n)  # the (0, 1) conditioning
    return one, second.evaluate(y, mods, b.anchor, ctx.kv, ctx.lengths)


def loss_mask(one: Tensor, b: Batch, loss: str) -> Tensor:
    """[N, K] slots scored: every data slot, or ("upto") those up to the one-jump draft's first
    wrong slot (a slot after it is accepted only if the second jump fixed that one)."""
    if loss == "all":
        return b.mask
    lead = accepted(one.argmax(-1), b) - 1  # [N] leading right slots
    return b.mask & (torch.arange(b.mask.shape[1])[None] <= lead[:, None])


def sequence_ids(b: Batch) -> np.ndarray:
    """[N] an identity of each block's sequence, the same in every batch the stream draws it in
    (its first context features; two sequences that begin alike share one, which only widens
    the interval)."""
    head = b.features[:, :16].float().sum(-1).numpy().round(3)  # [S, 16]
    ids = np.asarray([zlib.crc32(row.tobytes()) for row in head], dtype=np.int64)
    return ids[b.seq_index.numpy()]


@torch.no_grad()
def evaluate(first: FlashMapDiT, second: FlashMapDiT, batches: list[Batch]) -> dict:
    """Accepted lengths of 1 and 2 jumps on held-out blocks, paired over sequences."""
    g1, g2, cl = [], [], []
    sums = dict.fromkeys(("changed", "slots", "fixes", "breaks", "errors", "blocks"), 0.0)
    ce = {f"{which}_{loss}": 0.0 for which in ("one", "two") for loss in LOSSES}
    w = slot_weights(first.cfg.block_size, first.cfg.slot_loss_decay)
    for b in batches:
        one, two = two_jumps(first, second, b)
        d1, d2 = one.argmax(-1), two.argmax(-1)
        g1.append(accepted(d1, b).numpy())
        g2.append(accepted(d2, b).numpy())
        cl.append(sequence_ids(b))  # the blocks of one sequence resample together
        e = first_error(d1, d2, b)
        for key, v in (
            ("changed", (d1 != d2) & b.mask),
            ("slots", b.mask),
            ("fixes", e["fixes"]),
            ("breaks", e["breaks"]),
            ("errors", e["error"]),
        ):
            sums[key] += float(v.sum())
        sums["blocks"] += len(b.anchor)
        for loss in LOSSES:
            m = loss_mask(one, b, loss)
            ce[f"one_{loss}"] += weighted_ce(one, b.target, m, w).item() / len(batches)
            ce[f"two_{loss}"] += weighted_ce(two, b.target, m, w).item() / len(batches)
    g1, g2, cl = (np.concatenate(x) for x in (g1, g2, cl))
    return dict(
        one=float(g1.mean()),
        two=float(g2.mean()),
        diff=paired_bootstrap(g2, g1, cl),
        changed=sums["changed"] / sums["slots"],
        fixes_first_error=sums["fixes"] / max(sums["errors"], 1),
        breaks_before_it=sums["breaks"] / sums["blocks"],
        ce=ce,
    )


def plot(curve: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [c["step"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in ("heldout", "seen"):
        d = [c[k]["diff"] for c in curve]
        ax.fill_between(steps, [x["lo"] for x in d], [x["hi"] for x in d], alpha=0.2)
        ax.plot(steps, [x["mean"] for x in d], marker="o", label=f"2 jumps - 1 jump, {k} blocks")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("training step of the second network")
    ax.set_ylabel("accepted tokens a round")
    save_figure(fig, ax, png.parent.name, png)


def main(argv: list[str] | None = None) -> int:
    from drafter_service.checkpoint import load_drafter
    from research.map_fidelity import flow_check_draw

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--map", required=True, help="the map whose first jump is kept (frozen)")
    p.add_argument("--data", required=True, help="training drafter data (with features)")
    p.add_argument("--heldout", required=True, help="held-out drafter data (with features)")
    p.add_argument("--out", required=True)
    p.add_argument("--loss", choices=LOSSES, default="all")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--batch-seqs", type=int, default=8, help="sequences a step (4 anchors each)")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--batches", type=int, default=16, help="held-out batches of 32 blocks")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    final = "held-out batches of the end state (0: none)"
    p.add_argument("--final-batches", type=int, default=0, help=final)
    p.add_argument("--export", help="DIR: the map with this network as its second jump")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = load_drafter(args.map, args.target).eval()
    for q in first.parameters():
        q.requires_grad_(False)
    second = second_network(first)
    opt = torch.optim.AdamW(second.parameters(), lr=args.lr, weight_decay=0.0)
    evals = {  # the held-out blocks, and blocks of the sequences it trains on
        "heldout": flow_check_draw(args.heldout, args.batches, first.cfg.block_size, choosing=True),
        "seen": flow_check_draw(args.data, args.batches, first.cfg.block_size),
    }
    state_path, step, curve = out / "state.pt", 0, []
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        second.load_state_dict(st["second"])
        opt.load_state_dict(st["opt"])
        step, curve = st["step"], st["curve"]
        print(f"resumed at step {step}")
    else:
        curve.append(dict(step=0, **{k: evaluate(first, second, v) for k, v in evals.items()}))
    stream = SequenceStream(args.data, seed=args.seed, max_len=256)
    K = first.cfg.block_size
    w = slot_weights(K, first.cfg.slot_loss_decay)
    t0 = time.perf_counter()
    while step < args.steps:
        step += 1
        seqs = stream.take((step - 1) * args.batch_seqs, args.batch_seqs)
        b = make_batch(seqs, K, 4, 256, np.random.default_rng([args.seed, step]))
        one, two = two_jumps(first, second, b)
        loss = weighted_ce(two, b.target, loss_mask(one, b, args.loss), w)
        for g in opt.param_groups:  # 50 steps of warm-up
            g["lr"] = args.lr * min(1.0, step / 50)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} {time.perf_counter() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            curve.append(
                dict(step=step, **{k: evaluate(first, second, v) for k, v in evals.items()})
            )
            for k in evals:
                c = curve[-1][k]
                print(
                    f"step {step} {k}: 1 jump {c['one']:.3f}, 2 jumps {c['two']:.3f}, diff "
                    f"{c['diff']['mean']:+.3f} [{c['diff']['lo']:+.3f}, {c['diff']['hi']:+.3f}], "
                    f"changed {c['changed']:.1%}, fixes the first error "
                    f"{c['fixes_first_error']:.1%}, breaks before it {c['breaks_before_it']:.1%}, "
                    f"CE upto 1 / 2 jumps {c['ce']['one_upto']:.3f} / {c['ce']['two_upto']:.3f}",
                    flush=True,
                )
            torch.save(
                dict(second=second.state_dict(), opt=opt.state_dict(), step=step, curve=curve),
                state_path,
            )
            (out / "curve.json").write_text(
                json.dumps(dict(args=vars(args), curve=curve), indent=1)
            )
            plot(curve, out / "curve.png")
    if args.final_batches:  # the end state on more held-out blocks (runs again on a finished run)
        blocks = flow_check_draw(args.heldout, args.final_batches, K)
        final = dict(step=step, batches=args.final_batches, **evaluate(first, second, blocks))
        d = final["diff"]
        print(
            f"final, {len(blocks)} held-out batches: 1 jump {final['one']:.3f}, 2 jumps "
            f"{final['two']:.3f}, diff {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"
        )
        (out / "final.json").write_text(json.dumps(final, indent=1))
    if args.export:
        from drafter_service.checkpoint import save_drafter

        save_drafter(pair_checkpoint(first, second.eval()), args.export)
        print(f"map + second-jump network in {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
