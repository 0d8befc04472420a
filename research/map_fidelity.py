"""How well a distilled flow map follows its teacher's ODE, by jump length.

For held-out blocks and one noise draw, the state x_s on the data path at tau_s
(x_s = (1-s) eps + s onehot(block), pure noise at tau_s = 0) is carried to t = 1 three ways:
the teacher's ODE with `fine` Euler steps in tau (the reference), the teacher's ODE with
`coarse` steps, and the map's one jump (s, 1). Per tau_s the table gives, per slot, how often
each endpoint's argmax agrees with the reference's and with the true block. A map that is
far below the coarse teacher's agreement has not learnt its teacher; a teacher whose coarse
and fine endpoints disagree has an ODE that is hard to follow in few steps (stiff, or its
endpoint jumps with small changes of the path), which no map distilled from it can match.

    python -m research.map_fidelity --target checkpoints/demo-target --data runs/test-greedy \
        --pair eq=checkpoints/demo-flashmap-eq-teacher,checkpoints/demo-flashmap-eq \
        --out runs/diag/map_fidelity.json
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


@torch.no_grad()
def fidelity(
    teacher: FlashMapDiT,
    student: FlashMapDiT,
    batches: list[Batch],
    taus=TAUS,
    fine: int = 64,
    coarse: int = 16,
    seed: int = 0,
) -> list[dict]:
    """Per tau_s: the per-slot agreement with the fine teacher's endpoint of the coarse teacher
    and of the map's one jump, and each endpoint's accuracy against the true block."""
    V = teacher.cfg.vocab_size
    rows = []
    for tau_s in taus:
        gen = torch.Generator().manual_seed(seed)
        n = 0
        hits = dict(coarse_agrees=0.0, map_agrees=0.0, fine_acc=0.0, coarse_acc=0.0, map_acc=0.0)
        for b in batches:
            s = float(teacher.t_of_tau(tau_s))
            x = noisy_state(
                b.target, torch.full((len(b.anchor),), s), V, gen, teacher.cfg.shared_noise
            )
            ref = teacher_endpoint(teacher, x, tau_s, fine, b).argmax(-1)  # [N, K]
            crs = teacher_endpoint(teacher, x, tau_s, coarse, b).argmax(-1)
            one = student(x, s, 1.0, b.anchor, b.context(student)).argmax(-1)
            m = b.mask
            n += int(m.sum())
            for key, a, c in (
                ("coarse_agrees", crs, ref),
                ("map_agrees", one, ref),
                ("fine_acc", ref, b.target),
                ("coarse_acc", crs, b.target),
                ("map_acc", one, b.target),
            ):
                hits[key] += float(((a == c) & m).sum())
        rows.append(dict(tau_s=tau_s, slots=n, **{k: v / n for k, v in hits.items()}))
    return rows


def format_table(results: dict, fine: int, coarse: int) -> str:
    lines = [
        f"| pair | tau_s | coarse ({coarse}) agrees with fine ({fine}) | map agrees with fine "
        "| fine acc | coarse acc | map acc |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        for r in rows:
            lines.append(
                f"| {name} | {r['tau_s']:.2f} | {r['coarse_agrees']:.3f} | {r['map_agrees']:.3f} "
                f"| {r['fine_acc']:.3f} | {r['coarse_acc']:.3f} | {r['map_acc']:.3f} |"
            )
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
        results[name] = fidelity(teacher, student, batches, fine=args.fine, coarse=args.coarse)
        print(format_table({name: results[name]}, args.fine, args.coarse), flush=True)
    print(format_table(results, args.fine, args.coarse))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(dict(fine=args.fine, coarse=args.coarse, results=results), indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
