"""What a verify costs on this machine: the engine's packed pass (target_service.packing)
against one pass padded to the longest row, over the row mixes a serving round has.

    python -m bench.verify_cost --threads 1

Per row mix (16 rows by default, contexts of 100 tokens; a prompt row is prefilled from
position 0): the packed and the padded time (medians of --repeats), their ratio, and the line
seconds = c0 + c1 * tokens fitted to the packed times of the decode rounds over the rows'
total tokens (what the speculation controller's verify fit learns online). Each time is what
`TargetEngine.verify` costs: validation, forward, statistics, features. `--group-tokens`
compares values of target_service.packing.GROUP_TOKENS (printed, not in the report).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from bench.common import RESULTS, parser, set_threads, write_report
from flashmap.types import SamplingParams, VerifyRow


def _rows(engine, slots, spare: int, ctx: int, lengths: list[int], rng) -> list[VerifyRow]:
    """Rows of these lengths; one longer than a block is a prompt, prefilled from 0 in the spare slot."""
    rows = []
    for s, n in zip(slots, lengths):
        t = rng.integers(3, engine.vocab_size, n)
        prompt = n > 17
        rows.append(
            VerifyRow(
                spare if prompt else s,
                0 if prompt else ctx,
                t,
                SamplingParams(),
                support_ids=t[len(t) - min(n, 17) + 1 :, None],
            )
        )
    return rows


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = parser(
        "bench.verify_cost",
        __doc__,
        target=None,
        repeats=15,
        threads=1,
        out=RESULTS / "verify_cost.md",
    )
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument(
        "--group-tokens", default="", help="comma-separated GROUP_TOKENS values to compare"
    )
    args = ap.parse_args(argv)
    set_threads(args.threads)
    import torch

    from flashmap_cli.stack import default_checkpoints
    from target_service.engine import TargetEngine
    from target_service.packing import padded_inputs
    from target_service.verification import verification_stats

    target, _, notes = default_checkpoints(args.target, "init")
    rng = np.random.default_rng(0)
    engine = TargetEngine(target, n_slots=args.rows + 1)
    slots = [engine.allocate() for _ in range(args.rows)]
    spare = engine.allocate()
    engine.verify(
        [
            VerifyRow(s, 0, rng.integers(3, engine.vocab_size, args.context), SamplingParams())
            for s in slots
        ]
    )
    n, p = args.rows, args.prompt

    def padded(rows):  # what engine.verify does, with one padded pass instead of the packed one
        rows = engine._validate(rows)
        lengths = [len(r.tokens) for r in rows]
        batch = [torch.as_tensor(a) for a in padded_inputs(rows, max(lengths))]
        with torch.inference_mode():
            logits, features = engine.model(
                *batch, engine._feature_layers, max(r.start_pos + n for r, n in zip(rows, lengths))
            )
            verification_stats(logits, rows)
        np.split(features.numpy(), np.cumsum(lengths)[:-1])

    mixes = {
        f"{n} x 1": [1] * n,
        f"{n} x 17": [17] * n,
        f"1 x 17 + {n - 1} x 1": [17] + [1] * (n - 1),
        f"4 x 17 + {n - 4} x 1": [17] * 4 + [1] * (n - 4),
        f"4 x 5 + {n - 4} x 1": [5] * 4 + [1] * (n - 4),
        f"prompt {p} + {n - 1} x 1": [p] + [1] * (n - 1),
        f"prompt {p} + 4 x 17 + {n - 5} x 1": [p] + [17] * 4 + [1] * (n - 5),
        "1 x 1": [1],
        "1 x 17": [17],
    }
    table = [
        "| rows | tokens | packed ms | padded ms | padded / packed |",
        "|---|---:|---:|---:|---:|",
    ]
    xs, ys = [], []
    for name, lengths in mixes.items():
        rows = _rows(engine, slots, spare, args.context, lengths, rng)
        packed_s = _median_s(lambda: engine.verify(rows), args.repeats)
        padded_s = _median_s(lambda: padded(rows), args.repeats)
        if max(lengths) <= 17:
            xs.append(sum(lengths))
            ys.append(packed_s)
        table.append(
            f"| {name} | {sum(lengths)} | {packed_s * 1e3:.2f} | {padded_s * 1e3:.2f} | "
            f"{padded_s / packed_s:.2f} |"
        )
        print(table[-1], flush=True)
    c1, c0 = np.polyfit(xs, ys, 1)
    about = (
        f"{n} rows at a context of {args.context} tokens, a {p}-token prompt prefilled from "
        f"position 0; medians of {args.repeats}; target `{os.path.relpath(target)}`. Fit over "
        f"the packed decode rounds: {c0 * 1e3:.2f} ms + {c1 * 1e6:.1f} us per query token."
        + "".join(f" Note: {x}" for x in notes)
    )
    print(
        write_report(
            args.out,
            "Verify cost: packed against padded (CPU)",
            table,
            about,
            "bench.verify_cost",
            argv,
        )
    )
    for gt in [float(v) for v in args.group_tokens.split(",") if v]:
        engine.group_tokens = gt
        times = [
            _median_s(
                lambda: engine.verify(_rows(engine, slots, spare, args.context, lengths, rng)),
                args.repeats,
            )
            for lengths in mixes.values()
        ]
        print(f"group_tokens {gt:g}: " + " ".join(f"{t * 1e3:.2f}" for t in times) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
