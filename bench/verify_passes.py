"""What a verify pass costs on this machine: a fixed part and a part per padded query token,
and what splitting a round's rows into two passes (flashmap.passes) saves.

    python -m bench.verify_passes --target checkpoints/demo-target --threads 1

Prints the least-squares line seconds = c0 + c1 * tokens over one-pass verifies of 16 rows
(1..17 tokens each, contexts of 100 tokens), c0 / c1 (the fixed cost in tokens: what
`flashmap.passes.DEFAULT_PASS_TOKENS` should be near), and for rounds where a few rows
verify a 17-token draft among 1-token rows the time of one padded pass against two passes.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from flashmap.types import SamplingParams, VerifyRow


def _time(engine, slots, ctx: int, lengths: list[int], reps: int, rng) -> float:
    times = []
    for _ in range(reps):
        rows = []
        for s, n in zip(slots, lengths):
            t = rng.integers(3, engine.vocab_size, n)
            rows.append(VerifyRow(s, ctx, t, SamplingParams(), support_ids=t[1:, None]))
        t0 = time.perf_counter()
        engine.verify(rows)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    from target_service.engine import TargetEngine

    ap = argparse.ArgumentParser(prog="python -m bench.verify_passes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="checkpoints/demo-target")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    engine = TargetEngine(args.target, n_slots=args.rows)
    slots = [engine.allocate() for _ in range(args.rows)]
    engine.verify([VerifyRow(s, 0, rng.integers(3, engine.vocab_size, args.context), SamplingParams())
                   for s in slots])
    engine.pass_tokens = None  # one pass per verify while fitting the line
    xs, ys = [], []
    for n in (1, 2, 5, 9, 17):
        for b in (1, 4, args.rows):
            xs.append(b * n)
            ys.append(_time(engine, slots[:b], args.context, [n] * b, args.reps, rng))
    c1, c0 = np.polyfit(xs, ys, 1)
    print(f"one pass: {c0 * 1e3:.2f} ms + {c1 * 1e6:.1f} us per padded query token; fixed cost = {c0 / c1:.1f} tokens")
    print(f"{'drafting rows':>13} {'one pass ms':>12} {'two passes ms':>14} {'ratio':>6}")
    for k in (1, 2, 4):
        lengths = [17] * k + [1] * (args.rows - k)
        engine.pass_tokens = None
        one = _time(engine, slots, args.context, lengths, args.reps, rng)
        engine.pass_tokens = 0.0  # always split when it saves padding
        two = _time(engine, slots, args.context, lengths, args.reps, rng)
        print(f"{k:>13} {one * 1e3:12.2f} {two * 1e3:14.2f} {one / two:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
