"""The lead step (flashmap.rounds.lead_round) against plain drafted rounds, through the stack.

One Triton and one drafter serve two orchestrators with --speculation full: one plain, one
with --lead-step. Held-out text prompts (greedy, 48 new tokens) at each concurrency go through
both, and through the stack with speculation off, alternated every chunk of the prompts
(bench.bench_stack.alternated's scheme); every output is checked against the target alone in
process. Prints tokens/s, the paired ratio lead / full with a 95% interval, and the drafted
rounds' split.

    python -m bench.lead_step [--concurrency 1,4] [--repeats 4] [--chunks 4] [--prompts 32]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    from flashmap_cli.stack import threads_per_service

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_service()))
    import torch

    from bench.bench_stack import chunks_of, fmt_ci, inprocess, prompt_sets, ratio_ci, stack_summary, through_stack
    from flashmap_cli.stack import Stack, StackConfig, default_checkpoints, stop_process
    from target_service.engine import TargetEngine

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target, drafter, _ = default_checkpoints(None, None)
    levels = [int(x) for x in a.concurrency.split(",")]
    engine = TargetEngine(target, n_slots=max(levels), max_seq_len=256)
    prompts = prompt_sets(target, engine.vocab_size, a.prompts)["held-out text"]
    cfg = StackConfig.on_free_ports(target_dir=target, drafter=drafter, n_slots=max(levels), max_seq_len=256,
                                    speculation="full")
    modes = ("off", "full", "lead")
    with Stack(cfg) as stack:
        lead_proc, lead = stack.extra_orchestrator("orchestrator-lead", lead_step=True)
        for c in (cfg, lead):
            through_stack(c, prompts[:2], 8, 1)  # warm-up
        for conc in levels:
            expected = inprocess(engine, None, prompts, a.max_new_tokens, conc, cfg.decode_steps)[0]
            runs = {m: [] for m in modes}
            order = 0
            for _ in range(a.repeats):
                parts = {m: [] for m in modes}
                for part in chunks_of(prompts, conc, a.chunks):
                    for m in modes if order % 2 == 0 else modes[::-1]:
                        parts[m].append(through_stack(lead if m == "lead" else cfg, part, a.max_new_tokens, conc,
                                                      spec_off=m == "off"))
                    order += 1
                for m in modes:
                    runs[m].append(stack_summary(parts[m]))
            for m in modes:
                assert all(r["outputs"] == expected for r in runs[m]), f"{m}: output differs from the target alone"
            tok = {m: sum(r["tok_s"] for r in runs[m]) / a.repeats for m in modes}
            vs_full = ratio_ci([x["tok_s"] / y["tok_s"] for x, y in zip(runs["lead"], runs["full"])])
            vs_off = ratio_ci([x["tok_s"] / y["tok_s"] for x, y in zip(runs["lead"], runs["off"])])
            print(f"held-out text c={conc}: off {tok['off']:.0f} tok/s, full {tok['full']:.0f}, lead {tok['lead']:.0f}; "
                  f"lead / full {fmt_ci(vs_full)}, lead / off {fmt_ci(vs_off)}", flush=True)
            for m in ("full", "lead"):
                r = runs[m]
                print(f"  {m}: round {sum(x['round_ms'] for x in r) / len(r):.2f} ms, draft call "
                      f"{sum(x['draft_ms'] for x in r) / len(r):.2f}, verify calls {sum(x['verify_ms'] for x in r) / len(r):.2f}, "
                      f"tokens per drafted block {sum(x['gamma'] for x in r) / len(r):.2f}", flush=True)
        stop_process(lead_proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
