"""The stack with its CPUs split (StackConfig.pin_cpus, flashmap.cpus) against the same stack
without, and both against the target alone in this process.

Two stacks run side by side on the demo checkpoints, one pinned (the target model's worker
on the first CPU, every other process on the rest) and one not. The prompts are cut into
parts of `--concurrency` requests; for every part six modes run in a shuffled order: the
in-process target on the worker's CPU and unpinned, and speculation off and auto on each
stack. The VM's speed drifts within minutes, so every ratio is a geometric mean of ratios
within a part, with a 95% interval (Student's t on the logs). Every output is checked
against the in-process target.

    OMP_NUM_THREADS=1 python -m bench.cpu_pinning --concurrency 1 --parts 40
    OMP_NUM_THREADS=1 python -m bench.cpu_pinning --concurrency 16 --parts 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys

import numpy as np

MODES = ("in process", "off", "auto")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument(
        "--parts",
        type=int,
        default=40,
        help="parts of `concurrency` prompts, each run in every mode",
    )
    ap.add_argument(
        "--prompts", default="random ids", help="prompt set of bench.bench_stack.prompt_sets"
    )
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from bench.bench_stack import fmt_ci, inprocess_run, prompt_sets, ratio_ci, through_stack
    from flashmap.cpus import on_cpus
    from flashmap.types import DECODE_STEPS
    from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
    from target_service.engine import TargetEngine

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    c = a.concurrency
    target, drafter, _ = default_checkpoints(None, None)
    engine = TargetEngine(target, n_slots=c, max_seq_len=512)
    prompts = prompt_sets(target, engine.vocab_size, c * a.parts)[a.prompts]
    wall: dict[tuple[str, bool], list[float]] = {(m, p): [] for m in MODES for p in (True, False)}
    with contextlib.ExitStack() as running:
        stacks = {
            pin: running.enter_context(
                Stack(
                    StackConfig.on_free_ports(
                        target_dir=target,
                        drafter=drafter,
                        n_slots=max(c, 8),
                        max_seq_len=512,
                        pin_cpus=pin,
                    )
                )
            )
            for pin in (True, False)
        }
        cpus = stacks[True].cpus
        if cpus is None:
            print("fewer than 2 usable CPUs: nothing to pin", file=sys.stderr)
            return 1
        for st in stacks.values():
            through_stack(st.cfg, prompts[:2], 8, 1)  # warm-up
        rng = random.Random(0)
        for i in range(a.parts):
            part, outputs = prompts[i * c : (i + 1) * c], {}
            order = list(wall)
            rng.shuffle(order)
            for mode, pin in order:
                if mode == "in process":
                    with on_cpus(cpus[0] if pin else None):
                        run = inprocess_run(engine, None, part, a.max_new_tokens, c, DECODE_STEPS)
                else:
                    with on_cpus(cpus[1] if pin else None):
                        run = through_stack(
                            stacks[pin].cfg, part, a.max_new_tokens, c, spec_off=mode == "off"
                        )
                outputs[mode, pin] = run["outputs"]
                wall[mode, pin].append(run["seconds"])
            if any(o != outputs["in process", False] for o in outputs.values()):
                raise AssertionError(f"part {i}: an output differs from the in-process target's")
            print(f"part {i + 1}/{a.parts}", file=sys.stderr, flush=True)
    w = {k: np.array(v) for k, v in wall.items()}

    def ci(slow: tuple[str, bool], fast: tuple[str, bool]) -> str:  # tokens/s of `fast` over `slow`
        return fmt_ci(ratio_ci(list(w[slow] / w[fast])))

    print(
        f"{a.prompts}, concurrency {c}, {a.parts} parts, {a.max_new_tokens} new tokens; CPUs: the target's worker "
        f"(and the pinned in-process target) on {sorted(cpus[0])}, the rest on {sorted(cpus[1])}"
    )
    print("\n| | pinned | not pinned | pinned / not pinned |\n|---|---:|---:|---:|")
    for m in MODES:
        print(
            f"| {m}, ms per part | {w[m, True].mean() * 1e3:.0f} | {w[m, False].mean() * 1e3:.0f} | "
            f"{ci((m, False), (m, True))} |"
        )
    for m in ("off", "auto"):
        print(
            f"| {m} / in process (tok/s) | {ci(('in process', True), (m, True))} | "
            f"{ci(('in process', False), (m, False))} | |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
