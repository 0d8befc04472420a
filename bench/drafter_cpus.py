"""Where the drafter's forward thread runs: the services' CPUs only, or every CPU.

One stack (demo checkpoints, its CPUs split by flashmap.cpus) and a second orchestrator with
fixed K. The drafter's forward thread is found as the one of its threads that gained the most
CPU time over a few warm-up chunks, and is moved between CPU sets by this script
(sched_setaffinity on its thread id) before each run. The prompts are cut into chunks; every
chunk runs the in-process target alone and, for each CPU set, fixed K ("full") and the
controller ("auto"), in an order reversed every chunk. Ratios are paired per chunk: geometric
mean with a 95% interval (Student's t on the logs). Every output is checked against the
in-process target.

    python -m bench.drafter_cpus [--concurrency 1] [--prompts 64] [--chunks 16] [--prompt-set "held-out text"]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU ticks so far of each thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[11]) + int(fields[12])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--prompt-set", default="held-out text")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from bench.bench_stack import chunks_of, fmt_ci, prompt_sets, ratio_ci, run_mode, warm_up
    from drafter_service.factory import load_proposer
    from flashmap.cpus import format_cpu_list
    from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
    from target_service.engine import TargetEngine

    torch.set_num_threads(1)
    c = a.concurrency
    target, drafter, _ = default_checkpoints(None, None)
    engine = TargetEngine(target, n_slots=max(c, 8), max_seq_len=512)
    prompts = prompt_sets(target, engine.vocab_size, a.prompts)[a.prompt_set]
    parts = chunks_of(prompts, c, a.chunks)
    cfg = StackConfig.on_free_ports(
        target_dir=target,
        drafter=drafter,
        n_slots=max(c, 8),
        max_seq_len=512,
        speculation="auto",
        pin_cpus=True,
    )
    proposer = load_proposer(drafter, target, n_slots=max(c, 8), max_context=engine.max_seq_len)
    with Stack(cfg) as stack:
        if stack.cpus is None:
            print("fewer than 2 usable CPUs: nothing to place")
            return 1
        _, full = stack.extra_orchestrator("orchestrator-full", speculation="full")
        warm_up(cfg, full, engine, proposer, prompts)
        pid = stack.drafter_proc.pid
        before = thread_ticks(pid)
        for part in parts[:3]:
            run_mode(
                "full", part, a.max_new_tokens, c, cfg.decode_steps, engine, cfg, full, stack.cpus
            )
        after = thread_ticks(pid)
        forward = max(after, key=lambda t: after[t] - before.get(t, 0))
        sets = {"services": stack.cpus[1], "every": stack.cpus[0] | stack.cpus[1]}
        runs = [("ip", "")] + [(m, where) for where in sets for m in ("full", "auto")]
        rows = []
        for k, part in enumerate(parts):
            got = {}
            for mode, where in runs if k % 2 == 0 else runs[::-1]:
                if where:
                    os.sched_setaffinity(forward, sets[where])
                got[mode, where] = run_mode(
                    "target" if mode == "ip" else mode,
                    part,
                    a.max_new_tokens,
                    c,
                    cfg.decode_steps,
                    engine,
                    cfg,
                    full,
                    stack.cpus,
                )
            for r in runs:
                assert got[r]["outputs"] == got["ip", ""]["outputs"], (
                    f"{r}: output differs from the target alone"
                )
            rows.append({r: got[r]["seconds"] for r in runs})
            print(f"chunk {k + 1}/{len(parts)}", flush=True)
    print(
        f"\nConcurrency {c}, {a.prompt_set}, {a.prompts} prompts in {len(parts)} chunks, {a.max_new_tokens} new "
        f"tokens; the drafter's forward on the services' CPUs ({format_cpu_list(sets['services'])}) or on every "
        f"CPU ({format_cpu_list(sets['every'])})\n"
    )
    print("| mode | forward on | tokens/s / in-process target [95% CI] |\n|---|---|---:|")
    for mode, where in runs[1:]:
        print(
            f"| {mode} | {where} | {fmt_ci(ratio_ci([x['ip', ''] / x[mode, where] for x in rows]))} |"
        )
    print("\n| mode | every CPU / services' CPUs [95% CI] |\n|---|---:|")
    for m in ("full", "auto"):
        print(f"| {m} | {fmt_ci(ratio_ci([x[m, 'services'] / x[m, 'every'] for x in rows]))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
