"""Where the stack's threads run besides the target model's worker: on the rest of the CPUs
only ("rest"), or on every CPU ("every", the stack's default; flashmap.cpus).

One stack (demo checkpoints, its worker pinned to its own CPU) and a second orchestrator with
fixed K. Before each run this script moves every thread of Triton's server, its stub (all but
the worker: the stub's thread that gained the most CPU time over two warm-up chunks), the
drafter and both orchestrators to one of the two sets (sched_setaffinity on their thread
ids; threads started later inherit their parent thread's set). The prompts are cut into
chunks; every chunk runs the in-process target alone and each mode on each set, in an order
reversed every chunk. Ratios are paired per chunk: geometric mean with a 95% interval
(Student's t on the logs). Every output is checked against the in-process target.

    python -m bench.placement [--concurrency 1] [--modes off,full,auto] [--prompts 64] [--chunks 16] \\
        [--prompt-set "held-out text"]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

MODES = ("off", "full", "auto")


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU ticks so far of each thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[11]) + int(fields[12])
    return out


def children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def place(pids: list[int], cpus: set[int], keep: int) -> None:
    """Every thread of `pids` but `keep` on `cpus` (threads that end meanwhile are skipped)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            if int(task.name) != keep:
                try:
                    os.sched_setaffinity(int(task.name), cpus)
                except (ProcessLookupError, FileNotFoundError):
                    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--prompt-set", default="held-out text")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if not set(modes) <= set(MODES):
        ap.error(f"--modes: a comma list of {', '.join(MODES)}")
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
    cfg = StackConfig.on_free_ports(target_dir=target, drafter=drafter, n_slots=max(c, 8), max_seq_len=512,
                                    speculation="auto", pin_cpus=True)
    proposer = load_proposer(drafter, target, n_slots=max(c, 8), max_context=engine.max_seq_len)
    with Stack(cfg) as stack:
        if stack.cpus is None:
            print("fewer than 2 usable CPUs: nothing to place")
            return 1
        full_proc, full = stack.extra_orchestrator("orchestrator-full", speculation="full")
        warm_up(cfg, full, engine, proposer, prompts)
        server = stack.triton.process.pid
        (stub,) = children(server)
        before = thread_ticks(stub)
        for part in parts[:2]:
            run_mode("off", part, a.max_new_tokens, c, cfg.decode_steps, engine, cfg, full, stack.cpus)
        after = thread_ticks(stub)
        worker = max(after, key=lambda t: after[t] - before.get(t, 0))
        pids = [server, stub, stack.drafter_proc.pid, stack.orch_proc.pid, full_proc.pid]
        sets = {"rest": stack.cpus[1], "every": stack.every_cpu}
        runs = [("ip", "")] + [(m, where) for where in sets for m in modes]
        rows = []
        for k, part in enumerate(parts):
            got = {}
            for mode, where in runs if k % 2 == 0 else runs[::-1]:
                if where:
                    place(pids, sets[where], keep=worker)
                got[mode, where] = run_mode("target" if mode == "ip" else mode, part, a.max_new_tokens, c,
                                            cfg.decode_steps, engine, cfg, full, stack.cpus)
            for r in runs:
                assert got[r]["outputs"] == got["ip", ""]["outputs"], f"{r}: output differs from the target alone"
            rows.append({r: got[r]["seconds"] for r in runs})
            print(f"chunk {k + 1}/{len(parts)}", flush=True)
    print(f"\nConcurrency {c}, {a.prompt_set}, {a.prompts} prompts in {len(parts)} chunks, {a.max_new_tokens} new "
          f"tokens; the worker on CPU {format_cpu_list(stack.cpus[0])}, the other threads on the rest "
          f"({format_cpu_list(sets['rest'])}) or on every CPU ({format_cpu_list(sets['every'])})\n")
    print("| mode | other threads on | tokens/s / in-process target [95% CI] |\n|---|---|---:|")
    for mode, where in runs[1:]:
        print(f"| {mode} | {where} | {fmt_ci(ratio_ci([x['ip', ''] / x[mode, where] for x in rows]))} |")
    print("\n| mode | every CPU / the rest [95% CI] |\n|---|---:|")
    for m in modes:
        print(f"| {m} | {fmt_ci(ratio_ci([x[m, 'rest'] / x[m, 'every'] for x in rows]))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
