"""The GPU tools' clock (bench/gpu.py, bench/gpu_e2e.py): the time guard and watchdog, the log,
timing on the host clock and with CUDA events (eagerly, or replayed from a CUDA graph), and
what a decode loop's rounds cost: their boundaries (`RoundClock`) and the host's work in them
(`HostWork`: torch ops dispatched, copies between host and device, scalar reads)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def watchdog(seconds: float, finish) -> threading.Timer:
    """After `seconds` (a section that hangs: a capture, a kernel), call finish() to write what
    was measured, then exit with status 3. Cancel the returned timer when the run ends."""

    def fire():
        say(f"WATCHDOG: {seconds:.0f} s passed; writing what there is and exiting")
        try:
            finish()
        finally:
            os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def add_options(ap, files: str, budget: float, skip: str) -> None:
    """The options of a GPU tool: --out DIR (for `files`), --smoke, --budget, --skip."""
    from pathlib import Path

    ap.add_argument("--out", type=Path, default=None, help=f"directory for {files}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (tests the tool)")
    ap.add_argument(
        "--budget",
        type=float,
        default=budget,
        help="time guard, seconds: what would not fit in what is left is skipped; at budget + "
        "45 s a watchdog writes what there is and exits",
    )
    ap.add_argument("--skip", default="", help=f"comma-separated, to skip: {skip}")


def device_for(a, tool: str):
    """The device of a run (--smoke: the CPU, tiny shapes, one torch thread; else CUDA), or None
    after saying why when there is no GPU."""
    global SMOKE
    SMOKE = a.smoke
    if a.smoke:  # tiny shapes: threads only add synchronisation (and 2 shared cores here)
        torch.set_num_threads(1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(
            f"{tool}: no CUDA device here; it measures on a GPU (run it on one with --out DIR); "
            "--smoke runs it at tiny sizes on the CPU.",
            flush=True,
        )
        return None
    return torch.device("cuda")


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


# ----------------------------------------------------------------------------- decode loops


class RoundClock:
    """Clocks the in-process loop's target calls (`flashmap.inprocess.LocalTarget.verify`) over
    `engine` for the length of a `with`: each round verifies once, whether its rows are plain
    (one engine.verify) or trees (engine.verify_tree per row), and the first call is the prefill,
    so the calls' end times are the rounds' boundaries. on_end(i) runs after call i."""

    def __init__(self, engine, on_end=None):
        self.engine, self.on_end = engine, on_end
        self.calls: list[tuple[float, float]] = []

    def __enter__(self):
        from flashmap.inprocess import LocalTarget

        inner, clock = LocalTarget.verify, self

        async def verify(target, *args, **kwargs):
            t = time.perf_counter()
            out = await inner(target, *args, **kwargs)
            if target.engine is clock.engine:
                clock.calls.append((t, time.perf_counter()))
                if clock.on_end is not None:
                    clock.on_end(len(clock.calls) - 1)
            return out

        self._inner = inner
        LocalTarget.verify = verify  # the class's, restored on exit
        return self

    def __exit__(self, *exc):
        from flashmap.inprocess import LocalTarget

        LocalTarget.verify = self._inner

    def summary(self) -> dict:
        """The rounds after the prefill: how many, their time, the time in the verify calls."""
        ends = np.array([e for _, e in self.calls])
        took = np.array([e - s for s, e in self.calls])
        if len(ends) < 2:
            return {"rounds": 0}
        rounds = np.diff(ends)
        ms = lambda x: round(1e3 * float(x), 4)  # noqa: E731
        return {
            "rounds": len(rounds),
            "steady_s": float(ends[-1] - ends[0]),
            "wall_ms_per_round": ms(rounds.mean()),
            "median_round_ms": ms(np.median(rounds)),
            "verify_call_ms_per_round": ms(took[1:].mean()),
            "prefill_ms": ms(took[0]),
        }


class HostWork(TorchDispatchMode):
    """While armed: the aten ops the host dispatches (a graph replay is none), the copies among
    them whose source and destination devices differ (with bytes) and the scalar reads
    (`.item()`, `bool(t)`: each one waits for a GPU)."""

    WAYS = {("cpu", "cuda"): "h2d", ("cuda", "cpu"): "d2h"}

    def __init__(self):
        super().__init__()
        self.armed = False
        self.ops: Counter = Counter()
        self.copies: Counter = Counter()  # h2d, d2h, h2d_bytes, d2h_bytes, scalar_reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.armed:
            name = func.overloadpacket.__name__
            self.ops[name] += 1
            if name == "_local_scalar_dense":
                self.copies["scalar_reads"] += 1
            elif name in ("_to_copy", "copy_"):
                src, dst = (args[0], out) if name == "_to_copy" else (args[1], args[0])
                if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
                    way = self.WAYS.get((src.device.type, dst.device.type))
                    if way:
                        self.copies[way] += 1
                        self.copies[f"{way}_bytes"] += src.numel() * src.element_size()
        return out

    def per_round(self, n: int) -> dict:
        """The counts over n rounds, per round."""
        c = self.copies
        return {
            "counted_rounds": n,
            "ops_per_round": round(sum(self.ops.values()) / n, 1),
            "top_ops_per_round": {k: round(v / n, 1) for k, v in self.ops.most_common(12)},
            "aten_h2d_per_round": round(c["h2d"] / n, 2),
            "aten_d2h_per_round": round(c["d2h"] / n, 2),
            "aten_h2d_bytes_per_round": round(c["h2d_bytes"] / n),
            "aten_d2h_bytes_per_round": round(c["d2h_bytes"] / n),
            "scalar_reads_per_round": round(c["scalar_reads"] / n, 2),
        }


def cuda_calls_per_round(prof, n: int) -> dict:
    """From a CUDA profiler's events: memcpy host -> device, device -> host and synchronize
    calls per round."""
    names = Counter(e.name for e in prof.events())
    count = lambda key: sum(v for k, v in names.items() if key in k)  # noqa: E731
    return {
        "memcpy_h2d_per_round": round(count("HtoD") / n, 2),
        "memcpy_d2h_per_round": round(count("DtoH") / n, 2),
        "synchronize_per_round": round(count("Synchronize") / n, 2),
    }


def replay_ms(st, run, dev, reps: int) -> float:
    """A captured pass alone once run() has filled its static inputs: on CUDA the replay of
    st.graph (CUDA events); without a graph (static mode, CPU) run() itself on the host clock."""
    run()
    if st.graph is not None:
        return timed(st.graph.replay, dev, reps)["device_ms"]
    return timed(run, dev, reps)["ms"]
