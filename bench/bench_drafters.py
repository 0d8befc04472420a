"""Paired speed benchmark of a few drafters against the target alone, in one process.

The quick counterpart of `flashmap eval`'s speed columns, for trying drafter settings:
checkpoints given by path with their step count and draft cut, one domain at T = 0, every
prompt with request seed 0. Every prompt is decoded by every method back to back, in a
rotating order, `repeats` times; each method keeps its fastest run per prompt, and the
speedup is the ratio of the summed fastest times (equal tokens at T = 0: the outputs are
asserted identical).

    python -m bench.bench_drafters --domain code --methods flashmap:checkpoints/demo-flashmap \\
        dflash:checkpoints/demo-dflash --prompts 10 --repeats 5

Prints a table and writes docs/results/bench_drafters.md (append with --append).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from drafter_service.checkpoint import load_drafter
    from drafter_service.flashmap_proposer import FlashMapProposer
    from flashmap.inprocess import decode
    from target_service.engine import TargetEngine
    from training.evaluate import DEFAULT_PROMPTS, machine, make_requests, read_domain_prompts

    ap = argparse.ArgumentParser(prog="python -m bench.bench_drafters", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="checkpoints/demo-target")
    ap.add_argument("--methods", nargs="+", required=True,
                    help="NAME:CHECKPOINT[:STEPS[:MIN_CONFIDENCE]] (FlashMap or DFlash-style drafters; steps "
                         "default 1; min confidence: cut greedy drafts before the first less sure slot, default 0)")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--prompts", type=int, default=10, help="N held-out prompts of the domain")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip the first M (flashmap eval uses the first 10: tune settings on the others)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile every drafter (FlashMapProposer.enable_compile)")
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "bench_drafters.md"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    prompts = [p for p in read_domain_prompts(DEFAULT_PROMPTS, args.target) if p["domain"] == args.domain]
    prompts = prompts[args.offset:args.offset + args.prompts]
    engine = TargetEngine(args.target, n_slots=1, max_seq_len=max(len(p["ids"]) for p in prompts)
                          + args.max_new_tokens + 18)
    methods: dict = {"target alone": (None, 1)}
    for spec in args.methods:
        name, ckpt, *rest = spec.split(":")
        model = load_drafter(ckpt, args.target)
        steps = int(rest[0]) if rest else 1
        min_conf = float(rest[1]) if len(rest) > 1 else 0.0
        proposer = FlashMapProposer(model, n_slots=1, max_context=engine.max_seq_len, steps=steps,
                                    min_confidence=min_conf)
        if args.compile:
            proposer.enable_compile(steps=(steps,))
        methods[name] = (proposer, steps)

    def run(method: str, i: int):
        proposer, steps = methods[method]
        (req,) = make_requests([prompts[i]], 0.0, args.max_new_tokens, 0, engine.eos_token_ids)
        t0 = time.perf_counter()
        (res,) = decode(engine, [req], proposer, steps)
        return time.perf_counter() - t0, res

    names = list(methods)
    for m in names:  # warm-up: allocations and first-call costs stay out of the timings
        run(m, 0)
    best = {m: np.full(len(prompts), np.inf) for m in names}
    outputs, gamma_num, gamma_den = {}, {m: 0 for m in names}, {m: 0 for m in names}
    for r in range(args.repeats):
        for i in range(len(prompts)):
            for m in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
                wall, res = run(m, i)
                best[m][i] = min(best[m][i], wall)
                outputs.setdefault(i, res.token_ids)
                assert res.token_ids == outputs[i], f"{m}: output differs from the others on prompt {i}"
                if r == 0:
                    gamma_num[m] += res.stats.accepted
                    gamma_den[m] += res.stats.drafts
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    base = best["target alone"].sum()
    tokens = sum(len(t) for t in outputs.values())
    lines = [f"## {args.domain}, T = 0 ({datetime.date.today().isoformat()})", "",
             f"Machine: {machine()}. Command: `python -m bench.bench_drafters "
             + " ".join(argv if argv is not None else sys.argv[1:]) + "`", "",
             f"{len(prompts)} held-out prompts (from number {args.offset + 1}), {args.max_new_tokens} new tokens each ({tokens} in all), every "
             f"prompt decoded by every method back to back, {args.repeats} rotations, fastest run per prompt kept.", "",
             "| method | gamma | seconds | tokens/s | speedup |", "|---|---:|---:|---:|---:|"]
    for m in names:
        g = f"{1 + gamma_num[m] / gamma_den[m]:.2f}" if gamma_den[m] else "-"
        s = best[m].sum()
        lines.append(f"| {m} | {g} | {s:.3f} | {tokens / s:.1f} | {base / s:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.append and out.is_file():
        text = out.read_text() + "\n" + text
    else:
        text = "# Paired drafter benchmark (in-process, CPU)\n\n" + (__doc__.split("\n\n")[1]) + "\n\n" + text
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
