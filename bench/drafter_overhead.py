"""Where a draft call goes: the orchestrator's call to the drafter service against the same
work in this process.

    python -m bench.drafter_overhead [--drafter DIR] [--calls 200] [--repeats 3] [--new 5]

Starts the drafter service (and Triton, which the stack starts with it) and loads the same
checkpoint in this process, then alternates, call by call, the two ways of drafting a block
for a sequence that gains `--new` context positions per round (a round's accepted tokens;
every 20 calls a new sequence with a 40-position prompt): `extend` + `propose_blocks` here,
and `DrafterClient.draft` with the same tokens and features (random float16, the width the
drafter takes). Per repeat, medians in ms: the local work, the client's call, the drafter's
own batch (DraftResponse.timing.forward_s: context, draft and answer in its worker), and the
call minus the batch (the messages, both event loops and the hop to the worker).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np


async def _calls(cfg, proposer, n: int, new: int, rng) -> np.ndarray:
    """[calls, 3] seconds: local, call, the drafter's batch."""
    from drafter_service.proposer import ProposeRequest
    from flashmap.v1 import drafter_pb2
    from flashmap.wire import features_to_tensor
    from orchestrator.drafter_client import DrafterClient

    client = DrafterClient(cfg.drafter_url, token=cfg.drafter_token)
    await client.ensure_connected()
    out, length = [], 0
    for i in range(n):
        sid, first = f"bench-{i // 20}", i % 20 == 0
        m = 40 if first else new
        ids, feats = (
            rng.integers(3, proposer.vocab_size, m),
            rng.standard_normal((m, proposer.feature_dim)).astype(np.float16),
        )
        t0 = time.perf_counter()
        proposer.extend(sid, ids, feats)
        proposer.propose_blocks([ProposeRequest(sid, 7, 0.0, 4, i, 1)], 1, 1)
        local = time.perf_counter() - t0
        msg = drafter_pb2.SequenceDraft(
            seq_id=sid,
            context_start=0 if first else length,
            new_token_ids=ids.tolist(),
            new_features=features_to_tensor(feats),
            anchor=7,
            steps=1,
            num_blocks=1,
            temperature=0.0,
            top_m=4,
            seed=i,
            max_tokens=proposer.block_size,
        )
        t0 = time.perf_counter()
        resp, why = await client.draft([msg], 10.0)
        call = time.perf_counter() - t0
        if resp is None or resp.blocks[0].error:
            raise RuntimeError(f"draft call failed: {why or resp.blocks[0].error}")
        length = m if first else length + m
        if i % 20 == 19:
            await client.release([sid])
            proposer.release(sid)
        if not first:  # a prompt's call is not a round
            out.append((local, call, resp.timing.forward_s))
    await client.close()
    return np.array(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=5, help="context positions a round adds")
    a = ap.parse_args(argv)
    from flashmap_cli.stack import Stack, StackConfig, default_checkpoints, threads_per_service

    os.environ.setdefault(
        "OMP_NUM_THREADS", str(threads_per_service())
    )  # the services' threads, here too
    import torch

    from drafter_service.factory import load_proposer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target, drafter, _ = default_checkpoints(a.target, a.drafter)
    cfg = StackConfig.on_free_ports(target_dir=target, drafter=drafter, n_slots=4, max_seq_len=512)
    # As the service loads it (flashmap_cli.stack.Stack.start_drafter): the same slots and context.
    proposer = load_proposer(
        drafter, target, n_slots=cfg.drafter_slots, max_context=cfg.max_seq_len
    )
    rng = np.random.default_rng(0)
    with Stack(cfg):
        asyncio.run(_calls(cfg, proposer, 40, a.new, rng))  # warm both sides
        print(
            f"medians of {a.calls} calls, ms: local extend + propose | call | drafter's batch | call - batch"
        )
        for _ in range(a.repeats):
            ms = 1e3 * asyncio.run(_calls(cfg, proposer, a.calls, a.new, rng))
            local, call, batch = np.median(ms, axis=0)
            print(
                f"  {local:6.2f} | {call:6.2f} | {batch:6.2f} | {np.median(ms[:, 1] - ms[:, 2]):5.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
