"""How bench.gpu_e2e measures a row: the requests it decodes, the host's work per steady-state
round (HostWork: torch ops dispatched, copies between host and device, scalar reads; on CUDA
also the profiler's memcpy and synchronize calls), the target's and the drafter's captured
passes replayed alone, and whether a row's tokens equal a reference's.
"""

from __future__ import annotations

import numpy as np
import torch

from bench.gpu_timing import HostWork, RoundClock, cuda_calls_per_round, replay_ms

COUNTED_ROUNDS = 3  # steady-state rounds the host-work counters cover (after one warm round)


def requests_for(prompts: np.ndarray, b: int, max_new: int):
    from flashmap.types import GenerationRequest

    return [GenerationRequest(prompts[i].tolist(), max_new, request_id=f"r{i}") for i in range(b)]


def host_work(engine, requests, proposer, steps, dev) -> dict:
    """Decode `requests`, counting the host's work (HostWork; on CUDA also the profiler's memcpy
    and synchronize calls) over COUNTED_ROUNDS rounds after the prefill and one warm round."""
    from flashmap.inprocess import decode

    mode, n, prof, err = HostWork(), [0], [None], {}
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        prof[0] = profile(activities=[ProfilerActivity.CUDA])

    def arm(on: bool):
        mode.armed = on
        try:
            if prof[0] is not None:
                prof[0].start() if on else prof[0].stop()
        except Exception as e:  # noqa: BLE001 - the aten counts stand without the profiler's
            err["profiler_error"], prof[0] = f"{type(e).__name__}: {e}", None

    def on_end(i):  # after verify call i (0: the prefill)
        if i == 1:
            arm(True)
        elif mode.armed:
            n[0] += 1
            if n[0] == COUNTED_ROUNDS:
                arm(False)

    with mode, RoundClock(engine, on_end):
        decode(engine, requests, proposer, steps)
    if mode.armed:  # the run ended first
        arm(False)
    if not n[0]:
        return {"counted_rounds": 0}
    out = mode.per_round(n[0]) | err
    try:
        if prof[0] is not None:
            out.update(cuda_calls_per_round(prof[0], n[0]))
    except Exception as e:  # noqa: BLE001
        out["profiler_error"] = f"{type(e).__name__}: {e}"
    return out


def target_kernel_ms(engine, b: int, q: int, at: int, dev, reps: int) -> float:
    """The engine's captured pass of b rows x q tokens at context `at`, alone. It writes the K/V
    of positions at..at+q-1 of slots 0..b-1: call it between decode loops (the slots are free)."""
    g = engine.graphs
    key = g.key_for(b, q, at + q)
    if key is None:
        raise RuntimeError(f"no target graph for {b} rows x {q} tokens")
    tokens, positions = np.zeros((b, q), np.int64), np.repeat((at + np.arange(q))[None], b, 0)
    run = lambda: g.run(key, tokens, positions, np.arange(b))  # noqa: E731
    return replay_ms(g.graphs[key], run, dev, reps)


def drafter_kernel_ms(prop, b: int, steps: int, at: int, dev, reps: int) -> float:
    """The drafter's captured flow of `steps` jumps for b rows with `at` context positions, alone."""
    from drafter_service.cuda_graphs import bucket_of

    g, E = prop.graphs, prop.model.embed
    y = torch.randn(b, prop.block_size, E.shape[1], device=E.device, dtype=E.dtype)
    anchor = torch.zeros(b, dtype=torch.long, device=E.device)
    key = (steps, bucket_of(b, g.batch_buckets), bucket_of(at, g.context_buckets))
    if key not in g.graphs:
        raise RuntimeError(f"no drafter graph for {steps} jumps x {b} rows")
    run = lambda: g.run(y, anchor, list(range(b)), [at] * b, steps)  # noqa: E731
    return replay_ms(g.graphs[key], run, dev, reps)


def same(got: list[list[int]], want: list[list[int]] | None) -> list[int] | None:
    """[requests whose tokens equal want's, requests], or None without a reference."""
    return None if want is None else [sum(x == y for x, y in zip(got, want)), len(got)]
