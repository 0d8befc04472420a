"""The GPU check's clock: the time guard, the log, and timing on the host clock and with CUDA
events (eagerly, or replayed from a CUDA graph)."""

from __future__ import annotations

import time

import numpy as np
import torch

BATCHES = (1, 4, 16)
K = 16  # drafted tokens per block: a verify is K + 1 = 17 tokens

T0 = time.perf_counter()
LOG: list[str] = []
SMOKE = False  # --smoke: one warm-up, one or two repetitions


def say(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


class Guard:
    """The global time guard: sections that would not fit in what is left are skipped."""

    def __init__(self, budget_s: float):
        self.deadline = T0 + budget_s

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, need_s: float) -> bool:
        return self.left() > need_s


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int, warmup: int = 2, guard: Guard | None = None) -> dict:
    """Median / min of fn() over reps after warm-up: host wall clock (fn's own synchronisation
    included, then a device sync) and, on CUDA, device time between events around fn."""
    if SMOKE:
        warmup, reps = 1, min(reps, 2)
    for _ in range(warmup):
        fn()
    sync(dev)
    wall, device = [], []
    for i in range(reps):
        if guard is not None and i >= 3 and not guard.fits(5):
            break
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            wall.append(time.perf_counter() - t)
            device.append(e0.elapsed_time(e1) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t)
    out = {
        "ms": round(1e3 * float(np.median(wall)), 4),
        "min_ms": round(1e3 * float(np.min(wall)), 4),
        "n": len(wall),
    }
    if device:
        out["device_ms"] = round(1e3 * float(np.median(device)), 4)
    return out


def graph_time(fn, dev, reps: int = 20) -> dict:
    """Capture fn in a CUDA graph (after warm-up) and time its replays with events: the GPU
    time of the work with launch gaps at their smallest. CPU: fn timed eagerly."""
    if dev.type != "cuda":
        return timed(fn, dev, max(2, reps // 10))
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    r = timed(g.replay, dev, reps)
    del g
    return {"ms": r["device_ms"], "wall_ms": r["ms"]}
