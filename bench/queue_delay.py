"""Triton's sequence-batcher wait (max_queue_delay_microseconds) against stack throughput.

For each wait, a fresh stack (demo checkpoints, speculation full) serves 32 random-id prompts
(48 new tokens) at concurrency 1 and 16, with speculation off and with the full block; prints
tokens/s beside the verify call, Triton's queue wait and model time per request.

    python -m bench.queue_delay --delays 1000,100,0
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.bench_stack import stack_summary, through_stack
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--delays", default="1000,100,0", help="microseconds, comma-separated")
    a = ap.parse_args(argv)
    target, drafter, _ = default_checkpoints(None, None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(8, 32))).tolist() for _ in range(32)]
    for delay in (int(x) for x in a.delays.split(",")):
        cfg = StackConfig.on_free_ports(
            target_dir=target,
            drafter=drafter,
            n_slots=16,
            max_seq_len=512,
            speculation="full",
            max_queue_delay_us=delay,
        )
        with Stack(cfg):
            through_stack(cfg, prompts[:2], 8, 1)  # warm-up
            for c in (1, 16):
                off = stack_summary([through_stack(cfg, prompts, 48, c, spec_off=True)])
                full = stack_summary([through_stack(cfg, prompts, 48, c)])
                print(
                    f"delay {delay} us c={c}: off {off['tok_s']:.0f} tok/s (verify {off['verify_ms']:.2f} ms, "
                    f"queue {off['triton_queue_ms']:.2f}, model {off['triton_compute_ms']:.2f}), full "
                    f"{full['tok_s']:.0f} (round {full['round_ms']:.2f} ms, queue {full['triton_queue_ms']:.2f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
