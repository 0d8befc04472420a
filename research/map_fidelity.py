"""How well a distilled flow map follows its teacher's ODE, by jump length.

For held-out blocks and one noise draw, the state x_s on the data path at tau_s
(x_s = (1-s) eps + s onehot(block), pure noise at tau_s = 0) is carried to t = 1 four ways:
the teacher's ODE with `fine` Euler steps in tau (the reference), the teacher's ODE with
`coarse` steps, the map's one jump (s, 1) and the map's two jumps (s, m, 1) through the midpoint
in tau carrying the soft estimate (the paper's 2-step, as served). Per tau_s the table gives,
per slot, how often each endpoint's argmax agrees with the reference's and with the true block,
with 95% intervals from a bootstrap over blocks, and the paired gain of the second jump. The
noise is the one the teacher was trained with, or `--noise shared` / `slot` (a map trained with
a draw per slot, served with the paper's shared draw, is read off states it never saw). A map that is
far below the coarse teacher's agreement has not learnt its teacher; a teacher whose coarse
and fine endpoints disagree has an ODE that is hard to follow in few steps (stiff, or its
endpoint jumps with small changes of the path), which no map distilled from it can match.

    python -m research.map_fidelity --target checkpoints/demo-target --data runs/test-greedy \
        --pair eq=checkpoints/demo-flashmap-eq-teacher,checkpoints/demo-flashmap-eq \
        --noise shared --out runs/diag/map_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flow_map import jump
from flashmap.measure import bootstrap_ci
from training.flow import Batch, noisy_state

TAUS = (0.0, 0.25, 0.5, 0.75)


def teacher_endpoint(teacher: FlashMapDiT, x: Tensor, tau_s: float, steps: int, b: Batch) -> Tensor:
    """The teacher's Euler ODE from x at tau_s to t = 1 in `steps` equal tau steps: the last
    denoiser logits [N, K, V] (the clean block's estimate at the last step)."""
    ctx = b.context(teacher)
    taus = torch.linspace(tau_s, 1.0, steps + 1, dtype=torch.float64)
    ts = [float(teacher.t_of_tau(tau)) for tau in taus]
    logits = None
    for a, c in zip(ts[:-1], ts[1:]):
        logits = teacher(x, a, a, b.anchor, ctx)
        x = jump(x, logits.softmax(-1), a, c)
    return logits


KEYS = (
    "coarse_agrees",
    "map_agrees",
    "map2_agrees",
    "fine_acc",
    "coarse_acc",
    "map_acc",
    "map2_acc",
)


@torch.no_grad()
def fidelity(
    teacher: FlashMapDiT,
    student: FlashMapDiT,
    batches: list[Batch],
    taus=TAUS,
    fine: int = 64,
    coarse: int = 16,
    seed: int = 0,
    shared: bool | None = None,
) -> list[dict]:
    """Per tau_s: the per-slot agreement with the fine teacher's endpoint of the coarse teacher,
    of the map's one jump and of its two jumps, each endpoint's accuracy against the true block,
    95% intervals over blocks and the paired two-jump gain. shared: one noise draw per block
    (None: as the teacher was trained)."""
    V = teacher.cfg.vocab_size
    shared = teacher.cfg.shared_noise if shared is None else shared
    rows = []
    for tau_s in taus:
        gen = torch.Generator().manual_seed(seed)
        hits = {k: [] for k in KEYS}  # per block: slots that hit
        slots = []
        for b in batches:
            s = float(teacher.t_of_tau(tau_s))
            m = float(teacher.t_of_tau((tau_s + 1) / 2))  # the two jumps' midpoint in tau
            n = len(b.anchor)
            x = noisy_state(b.target, torch.full((n,), s), V, gen, shared)
            ref = teacher_endpoint(teacher, x, tau_s, fine, b).argmax(-1)  # [N, K]
            crs = teacher_endpoint(teacher, x, tau_s, coarse, b).argmax(-1)
            ctx = b.context(student)
            one = student(x, s, 1.0, b.anchor, ctx).argmax(-1)
            x_m = jump(x, student(x, s, m, b.anchor, ctx).softmax(-1), s, m)
            two = student(x_m, m, 1.0, b.anchor, ctx).argmax(-1)
            mask = b.mask
            slots.append(mask.sum(-1).double())
            for key, a, c in (
                ("coarse_agrees", crs, ref),
                ("map_agrees", one, ref),
                ("map2_agrees", two, ref),
                ("fine_acc", ref, b.target),
                ("coarse_acc", crs, b.target),
                ("map_acc", one, b.target),
                ("map2_acc", two, b.target),
            ):
                hits[key].append(((a == c) & mask).sum(-1).double())
        w = torch.cat(slots).numpy()
        h = {k: torch.cat(v).numpy() for k, v in hits.items()}
        row = dict(tau_s=tau_s, slots=int(w.sum()), blocks=len(w))
        for k in KEYS:
            row[k] = float(h[k].sum() / w.sum())
            row[k + "_ci"] = bootstrap_ci(
                lambda i, k=k: h[k][i].sum() / w[i].sum(), len(w), seed=seed
            )
        gain = h["map2_acc"] - h["map_acc"]
        row["two_jump_gain"] = float(gain.sum() / w.sum())
        row["two_jump_gain_ci"] = bootstrap_ci(
            lambda i: gain[i].sum() / w[i].sum(), len(w), seed=seed
        )
        rows.append(row)
    return rows


def _ci(r: dict, k: str, signed: bool = False) -> str:
    lo, hi = r.get(k + "_ci", (float("nan"), float("nan")))
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(r[k])} [{f.format(lo)}, {f.format(hi)}]"


def format_table(results: dict, fine: int, coarse: int) -> str:
    lines = [
        f"| pair | tau_s | coarse ({coarse}) agrees with fine ({fine}) | 1 jump agrees with fine "
        "| 2 jumps agree with fine | fine acc | coarse acc | 1 jump acc | 2 jumps acc "
        "| 2 jumps - 1 jump (acc) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        for r in rows:
            cells = [_ci(r, k) for k in ("coarse_agrees", "map_agrees", "map2_agrees")]
            cells += [f"{r[k]:.3f}" for k in ("fine_acc", "coarse_acc")]
            cells += [_ci(r, k) for k in ("map_acc", "map2_acc")]
            cells.append(_ci(r, "two_jump_gain", signed=True))
            lines.append(f"| {name} | {r['tau_s']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flow_check_draw(data: str, n: int, block_size: int, choosing: bool = False) -> list:
    """`n` held-out batches of 32 blocks, drawn as the flow check draws them. choosing: the
    caller picks something by them (a curve that sets steps or a learning rate), so they must
    not come from the test prompts (flashmap.prompts.for_choosing)."""
    from flashmap.prompts import for_choosing
    from training.drafter_data import read_meta
    from training.step_batches import flow_check_batches
    from training.train_drafter_config import TrainConfig

    if choosing:
        for_choosing(read_meta(data, tokens_ok=True).get("split", ""), "a curve that chooses")

    tcfg = TrainConfig.for_stage("flow", small=True)
    tcfg.check_batches = n
    return flow_check_batches(data, tcfg, block_size, "cpu")


def main(argv: list[str] | None = None) -> int:
    from drafter_service.checkpoint import load_drafter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, help="held-out drafter data (with features)")
    p.add_argument(
        "--pair", action="append", required=True, help="NAME=TEACHER_DIR,MAP_DIR (repeatable)"
    )
    p.add_argument("--batches", type=int, default=4, help="held-out batches of 32 blocks")
    p.add_argument("--fine", type=int, default=64)
    p.add_argument("--coarse", type=int, default=16)
    p.add_argument(
        "--noise",
        choices=("trained", "shared", "slot"),
        default="trained",
        help="one draw per block (shared, the paper's), one per slot, or as the teacher was trained",
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for spec in args.pair:
        name, dirs = spec.split("=", 1)
        tdir, mdir = dirs.split(",")
        teacher = load_drafter(tdir, args.target).eval()
        student = load_drafter(mdir, args.target).eval()
        batches = flow_check_draw(args.data, args.batches, teacher.cfg.block_size)
        shared = None if args.noise == "trained" else args.noise == "shared"
        results[name] = fidelity(
            teacher, student, batches, fine=args.fine, coarse=args.coarse, shared=shared
        )
        print(format_table({name: results[name]}, args.fine, args.coarse), flush=True)
    print(format_table(results, args.fine, args.coarse))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                dict(fine=args.fine, coarse=args.coarse, noise=args.noise, results=results),
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
