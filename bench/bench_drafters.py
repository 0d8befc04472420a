"""Paired speed benchmark of a few drafters against the target alone, in one process.

The quick counterpart of `flashmap eval`'s speed columns, for trying drafter settings:
checkpoints given by path with their step count and draft cut, one domain at T = 0, request
seeds as in `flashmap eval`. The timing is the eval's own (`flashmap.measure.run_paired`):
every prompt is decoded by every method back to back, in a rotating order, `repeats` times;
each method keeps its fastest run per prompt, and the speedup is the ratio of the summed
fastest times (equal tokens at T = 0: the outputs are asserted identical).

    python -m bench.bench_drafters --domain code --methods flashmap:checkpoints/demo-flashmap \\
        dflash:checkpoints/demo-dflash --prompts 10 --repeats 5

Prints a table and writes docs/results/bench_drafters.md (append with --append).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from drafter_service.factory import load_model, make_proposer
    from flashmap.measure import machine, run_paired, run_prompts
    from flashmap.prompts import HELDOUT_PROMPTS, read_domain_prompts
    from target_service.engine import TargetEngine

    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_drafters", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", default="checkpoints/demo-target")
    ap.add_argument(
        "--methods",
        nargs="+",
        required=True,
        help="NAME:CHECKPOINT[:STEPS[:MIN_CONFIDENCE]] (FlashMap or DFlash-style drafters; steps "
        "default 1; min confidence: cut greedy drafts before the first less sure slot, default 0)",
    )
    ap.add_argument("--domain", default="code")
    ap.add_argument("--prompts", type=int, default=10, help="N held-out prompts of the domain")
    ap.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first M (flashmap eval uses the first 10: tune settings on the others)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every drafter (FlashMapProposer.enable_compile)",
    )
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "bench_drafters.md"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    prompts = [
        p for p in read_domain_prompts(HELDOUT_PROMPTS, args.target) if p["domain"] == args.domain
    ]
    prompts = prompts[args.offset : args.offset + args.prompts]
    engine = TargetEngine(
        args.target,
        n_slots=1,
        max_seq_len=max(len(p["ids"]) for p in prompts) + args.max_new_tokens + 18,
    )
    runners: dict = {"target alone": (None, 1, 1)}
    for spec in args.methods:
        name, ckpt, *rest = spec.split(":")
        steps = int(rest[0]) if rest else 1
        min_conf = float(rest[1]) if len(rest) > 1 else 0.0
        runners[name] = (
            make_proposer(
                load_model(ckpt, args.target),
                n_slots=1,
                max_context=engine.max_seq_len,
                steps=steps,
                min_confidence=min_conf,
                compile=args.compile,
            ),
            steps,
            1,
        )
    names = list(runners)
    for m in names:  # warm-up: allocations and first-call costs stay out of the timings
        run_prompts(engine, prompts[:1], 0.0, args.max_new_tokens, 0, *runners[m][:2])
    runs = run_paired(engine, prompts, 0.0, args.max_new_tokens, 0, runners, args.repeats)
    for m in names:
        assert runs[m]["outputs"] == runs["target alone"]["outputs"], (
            f"{m}: output differs from the target's"
        )

    base = runs["target alone"]["wall_s"]
    tokens = runs["target alone"]["tokens"]
    lines = [
        f"## {args.domain}, T = 0 ({datetime.date.today().isoformat()})",
        "",
        f"Machine: {machine()}. Command: `python -m bench.bench_drafters "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
        f"{len(prompts)} held-out prompts (from number {args.offset + 1}), {args.max_new_tokens} new tokens each ({tokens} in all), every "
        f"prompt decoded by every method back to back, {args.repeats} rotations, fastest run per prompt kept.",
        "",
        "| method | gamma | seconds | tokens/s | speedup |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in names:
        r = runs[m]
        g = f"{r['gamma']:.2f}" if r["drafts"] else "-"
        s = r["wall_s"]
        lines.append(f"| {m} | {g} | {s:.3f} | {tokens / s:.1f} | {base / s:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.append and out.is_file():
        text = out.read_text() + "\n" + text
    else:
        text = (
            "# Paired drafter benchmark (in-process, CPU)\n\n"
            + (__doc__.split("\n\n")[1])
            + "\n\n"
            + text
        )
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
