"""Torch threads per service against throughput: the in-process target beside the stack.

On a small CPU box the three processes (Triton's Python stub, the drafter, the orchestrator)
share the cores. This runs, for one setting of OpenMP threads and wait policy, the target
alone in process and through Triton, the stack with speculation off (random ids) and with
the full block (held-out text) at concurrency 1, and the target alone at concurrency 16, on
the demo checkpoints (48 new tokens, 16 prompts; 32 at concurrency 16), `--repeats` times;
every output is checked against the in-process target. Run it once per setting: the services
take theirs from the environment when they start.

    python -m bench.threads_per_service --threads 1
    python -m bench.threads_per_service --threads 2
    python -m bench.threads_per_service --threads 2 --wait-policy PASSIVE
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of this process and of every service",
    )
    ap.add_argument(
        "--wait-policy", default="", help="OMP_WAIT_POLICY (ACTIVE, PASSIVE; default: libgomp's)"
    )
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(
        a.threads
    )  # before torch starts its pool; the services inherit it
    if a.wait_policy:
        os.environ["OMP_WAIT_POLICY"] = a.wait_policy
    import torch

    from bench.bench_stack import (
        inprocess,
        prompt_sets,
        stack_summary,
        through_stack,
        tok_s,
        triton_alone,
    )
    from drafter_service.factory import load_proposer
    from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
    from target_service.engine import TargetEngine

    torch.set_num_threads(a.threads)
    target, drafter, _ = default_checkpoints(None, None)
    engine = TargetEngine(target, n_slots=32, max_seq_len=256)
    proposer = load_proposer(drafter, target, n_slots=32, max_context=256)
    sets = prompt_sets(target, engine.vocab_size, 32)
    rand, text = sets["random ids"], sets["held-out text"]
    cfg = StackConfig.on_free_ports(
        target_dir=target, drafter=drafter, n_slots=32, max_seq_len=256, speculation="full"
    )

    def alone(p, c):
        run = triton_alone(cfg, p, 48, c)
        return run["outputs"], tok_s(run)

    def stack(p, c, off=False):
        run = stack_summary([through_stack(cfg, p, 48, c, spec_off=off)])
        return run["outputs"], run["tok_s"]

    cells = {  # name -> (prompts, concurrency, run: (prompts, concurrency) -> (outputs, tokens/s))
        "target c=1 (random)": (
            rand[:16],
            1,
            lambda p, c: inprocess(engine, None, p, 48, c, cfg.decode_steps),
        ),
        "Triton alone c=1 (random)": (rand[:16], 1, alone),
        "stack off c=1 (random)": (rand[:16], 1, lambda p, c: stack(p, c, off=True)),
        "fixed K c=1 (text)": (
            text[:16],
            1,
            lambda p, c: inprocess(engine, proposer, p, 48, c, cfg.decode_steps),
        ),
        "stack full c=1 (text)": (text[:16], 1, stack),
        "target c=16 (text)": (
            text,
            16,
            lambda p, c: inprocess(engine, None, p, 48, c, cfg.decode_steps),
        ),
        "Triton alone c=16 (text)": (text, 16, alone),
    }
    expected = {
        name: inprocess(engine, None, p, 48, c, cfg.decode_steps)[0]
        for name, (p, c, _) in cells.items()
    }
    results: dict[str, list[float]] = {name: [] for name in cells}
    with Stack(cfg):
        through_stack(cfg, text[:2], 8, 1)  # warm-up
        for rep in range(a.repeats):
            for name, (prompts, c, run) in cells.items():
                outputs, speed = run(prompts, c)
                assert outputs == expected[name], f"{name}: output differs from the target alone"
                results[name].append(speed)
            print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr, flush=True)
    policy = a.wait_policy or "default"
    print(f"OMP_NUM_THREADS={a.threads}, OMP_WAIT_POLICY={policy}: tokens/s per repeat")
    for name, speeds in results.items():
        print(f"  {name:28s} " + " ".join(f"{s:6.0f}" for s in speeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
