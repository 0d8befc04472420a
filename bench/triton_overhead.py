"""Where a plain decode step through Triton goes, against the same engine in one process.

    python -m bench.triton_overhead [--target DIR] [--blocks 8] [--steps 40] [--rows 1] [--decode-steps 1]

Starts Triton alone (no drafter, no orchestrator) and a TargetEngine in this process, then
alternates blocks of `steps` decode steps of `rows` sequences: the local
`TargetEngine.verify`, then the same through Triton (one packed request per call; a call
decodes `decode-steps` tokens per row, VerifyRow.next_seeds). Blocks
alternate so that the VM's drifting speed hits both sides alike. Per block: the local
verify, the client's call, and the model's run of a batch inside Triton
(`flashmap_target_batch_run_seconds_total`, from Triton's metrics), medians in ms, and the
ratio of the model's run to the local verify.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
import torch

from flashmap.metrics import scrape, totals
from flashmap.types import SamplingParams, VerifyRow
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
from orchestrator.target_client import TargetClient
from target_service.engine import TargetEngine


async def _measure(cfg: StackConfig, engine: TargetEngine, blocks: int, steps: int, rows: int,
                   decode_steps: int) -> dict[str, list]:
    client = TargetClient(f"{cfg.host}:{cfg.triton_grpc_port}", key=cfg.target_key)
    metrics = f"http://{cfg.host}:{cfg.triton_metrics_port}/metrics"
    params, prompt = SamplingParams(), np.arange(3, 23)
    ids = list(range(1000, 1000 + rows))
    first = await client.verify_rows([(i, VerifyRow(i, 0, prompt, params), [], True, False) for i in ids])
    slots = [engine.allocate() for _ in ids]
    engine.verify([VerifyRow(s, 0, prompt, params) for s in slots])
    remote = [len(prompt), [int(r[0].argmax[-1]) for r in first]]  # next position, last token per row
    local = [len(prompt), [5] * rows]
    more = np.zeros(decode_steps - 1, np.int64)  # greedy: the further steps' seeds are unused
    out: dict[str, list] = {"local verify": [], "Triton call": [], "Triton model": []}
    for _ in range(blocks):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            res = engine.verify([VerifyRow(s, local[0], np.array([t]), params, next_seeds=more)
                                 for s, t in zip(slots, local[1])])
            times.append(time.perf_counter() - t0)
            local = [local[0] + decode_steps, [int(r.argmax[-1]) for r in res]]
        out["local verify"].append(np.median(times))
        before, times = totals(scrape(metrics, 10)), []
        for _ in range(steps):
            t0 = time.perf_counter()
            res = await client.verify_rows([(i, VerifyRow(i, remote[0], np.array([t]), params, next_seeds=more),
                                             [], False, False) for i, t in zip(ids, remote[1])])
            times.append(time.perf_counter() - t0)
            remote = [remote[0] + decode_steps, [int(r[0].argmax[-1]) for r in res]]
        after = totals(scrape(metrics, 10))
        n = after["flashmap_target_batches_total"] - before["flashmap_target_batches_total"]
        out["Triton call"].append(np.median(times))
        out["Triton model"].append((after["flashmap_target_batch_run_seconds_total"]
                                    - before["flashmap_target_batch_run_seconds_total"]) / n)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=1, help="tokens per row in one call")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, _, _ = default_checkpoints(a.target, "init")
    max_seq_len = 32 + a.blocks * a.steps * a.decode_steps
    cfg = StackConfig.on_free_ports(target_dir=target, drafter="init", n_slots=a.rows, max_seq_len=max_seq_len,
                                    with_drafter=False)
    engine = TargetEngine(target, n_slots=a.rows, max_seq_len=max_seq_len)
    with Stack(cfg):
        out = asyncio.run(_measure(cfg, engine, a.blocks, a.steps, a.rows, a.decode_steps))
    print(f"{a.rows} row(s), {a.decode_steps} token(s) per call, medians of {a.steps} calls per block, ms:")
    for name, v in out.items():
        print(f"  {name:13s} " + " ".join(f"{x * 1e3:6.2f}" for x in v))
    ratio = np.array(out["Triton model"]) / np.array(out["local verify"])
    print("  model / local " + " ".join(f"{x:6.2f}" for x in ratio) + f"   (median {np.median(ratio):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
