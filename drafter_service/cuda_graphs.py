"""CUDA graphs of the drafter's flow integration, one per (step count, batch bucket, context bucket).

Drafting is a handful of small kernels per DiT block and flow step: at batch 1 on a GPU
the launch overhead dominates, so the whole integration (1 or 2 jumps) is captured
once at start-up and replayed. A graph needs static shapes, so a batch is padded to
its bucket (padding rows: slot 0, no context, discarded) and the cross-attention reads
a fixed context window (the bucket above the longest row), masked by the true
lengths. Times are device tensors baked into each graph. Shapes with no graph (a
bucket beyond the largest, a step count not captured) run eagerly: same function,
same numbers.

`mode="static"` runs the very same padded, fixed-window function without capture;
that is how the CPU tests check it against the dynamic path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger("flashmap.drafter.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_BUCKETS = (256, 1024, 4096, 16384)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class _Static:
    y: Tensor  # [b, K, H] embedded noise
    anchor: Tensor  # [b]
    slots: Tensor  # [b]
    lengths: Tensor  # [b]
    hard: Tensor  # [b] bool: rows that carry the argmax estimate between steps
    out: Tensor | None = None  # [b, K, V] logits written by the graph
    graph: torch.cuda.CUDAGraph | None = None
    times: list[Tensor] | None = None  # the flow grid as [b] device tensors


class FlowGraphs:
    def __init__(
        self,
        proposer,
        steps: tuple[int, ...] = (1, 2),
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
        context_buckets: tuple[int, ...] = CONTEXT_BUCKETS,
        mode: str = "cuda",
    ):
        if mode not in ("cuda", "static"):
            raise ValueError(f"mode must be 'cuda' or 'static', got {mode!r}")
        self.p = proposer
        self.mode = mode
        self.steps = tuple(sorted(set(steps)))
        self.batch_buckets = tuple(b for b in batch_buckets if b <= proposer.n_slots) or (
            proposer.n_slots,
        )
        ctx = tuple(c for c in context_buckets if c < proposer.max_context)
        self.context_buckets = ctx + (proposer.max_context,)
        self.graphs: dict[tuple[int, int, int], _Static] = {}
        self._pool = None

    def _times(self, steps: int, b: int) -> tuple[list[float], list[Tensor]]:
        grid = [float(g) for g in self.p.model.time_grid(steps)]  # the drafter's own time map
        return grid, [torch.full((b,), g, device=self.p.device) for g in grid]

    def _fn(self, st: _Static, steps: int, window: int, times: list[Tensor]) -> Tensor:
        ctx = self.p._context_tensors(st.slots, st.lengths, window)
        hard = st.hard if self.p.greedy_estimate == "argmax" else None  # else every row soft
        return self.p._integrate(st.y, st.anchor, ctx, steps, times, hard=hard)

    def _static(self, b: int) -> _Static:
        K, E, dev = self.p.block_size, self.p.model.embed, self.p.device
        z = lambda: torch.zeros(b, dtype=torch.long, device=dev)  # noqa: E731
        y = torch.zeros(b, K, E.shape[1], dtype=E.dtype, device=dev)
        return _Static(y, z(), z(), z(), torch.zeros(b, dtype=torch.bool, device=dev))

    @torch.inference_mode()
    def capture(self) -> dict:
        """Capture every (steps, batch bucket, context bucket); returns and logs time and memory."""
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_allocated(self.p.device) if self.mode == "cuda" else 0
        if self.mode == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        for steps in self.steps:
            for b in self.batch_buckets:
                for w in self.context_buckets:
                    st = self._static(b)
                    _, times = self._times(steps, b)
                    if self.mode == "cuda":
                        side = torch.cuda.Stream(self.p.device)
                        side.wait_stream(torch.cuda.current_stream(self.p.device))
                        with torch.cuda.stream(
                            side
                        ):  # warm-up outside capture (allocator, kernels)
                            for _ in range(2):
                                self._fn(st, steps, w, times)
                        torch.cuda.current_stream(self.p.device).wait_stream(side)
                        st.graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(st.graph, pool=self._pool):
                            st.out = self._fn(st, steps, w, times)
                    st.times = times
                    self.graphs[(steps, b, w)] = st
        if self.mode == "cuda":
            torch.cuda.synchronize(self.p.device)
        report = {
            "graphs": len(self.graphs),
            "seconds": round(time.perf_counter() - t0, 3),
            "memory_bytes": (torch.cuda.memory_allocated(self.p.device) - mem0)
            if self.mode == "cuda"
            else 0,
            "steps": list(self.steps),
            "batch_buckets": list(self.batch_buckets),
            "context_buckets": list(self.context_buckets),
        }
        log.info("drafter graphs captured (%s): %s", self.mode, report)
        return report

    @torch.inference_mode()
    def run(
        self,
        y: Tensor,
        anchor: Tensor,
        slots: list[int],
        lengths: list[int],
        steps: int,
        hard: Tensor | None = None,
    ) -> Tensor | None:
        """Logits [B, K, V] from the embedded noise y [B, K, H] through a graph, or None when no
        graph fits (the caller runs eagerly). hard [B] bool: the proposer's argmax rows."""
        B = y.shape[0]
        b, w = bucket_of(B, self.batch_buckets), bucket_of(max(lengths + [1]), self.context_buckets)
        st = self.graphs.get((steps, b, w)) if b is not None and w is not None else None
        if st is None:
            return None
        st.y.zero_()
        st.anchor.zero_()
        st.slots.zero_()
        st.lengths.zero_()
        if self.p.greedy_estimate == "argmax":  # only then does the graph read st.hard
            st.hard.zero_()
            if hard is not None:
                st.hard[:B].copy_(hard)
        st.y[:B].copy_(y)
        st.anchor[:B].copy_(anchor)
        st.slots[:B].copy_(torch.tensor([max(s, 0) for s in slots]))
        st.lengths[:B].copy_(torch.tensor(lengths))
        if self.mode == "cuda":
            st.graph.replay()
            return st.out[:B].clone()
        return self._fn(st, steps, w, st.times)[:B]


class BucketGraphs:
    """CUDA graphs of a drafting pass that reads nothing but per-row anchors, cache slots and
    context lengths (a published DFlash block, EAGLE-3's tree search), one per (batch bucket,
    context bucket). fn(anchor, slots, lengths [b], window) -> output tensors [b, ...]; a batch is
    padded to its bucket (slot 0, no context, discarded) and the context read through the
    bucket's window. mode "static" runs the same padded function eagerly (CPU tests)."""

    def __init__(
        self,
        fn,
        n_slots: int,
        max_context: int,
        device: torch.device,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
        context_buckets: tuple[int, ...] = CONTEXT_BUCKETS,
        mode: str = "cuda",
    ):
        if mode not in ("cuda", "static"):
            raise ValueError(f"mode must be 'cuda' or 'static', got {mode!r}")
        self.fn, self.device, self.mode = fn, torch.device(device), mode
        self.batch_buckets = tuple(b for b in batch_buckets if b <= n_slots) or (n_slots,)
        self.context_buckets = tuple(c for c in context_buckets if c < max_context) + (max_context,)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (b, w) -> (inputs, outputs, graph)

    @torch.inference_mode()
    def capture(self) -> dict:
        t0 = time.perf_counter()
        cuda = self.mode == "cuda"
        mem0 = torch.cuda.memory_allocated(self.device) if cuda else 0
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for b in self.batch_buckets:
            for w in self.context_buckets:
                inputs = [torch.zeros(b, dtype=torch.long, device=self.device) for _ in range(3)]
                out, graph = None, None
                if cuda:
                    side = torch.cuda.Stream(self.device)
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):  # warm-up outside capture (allocator, kernels)
                        for _ in range(2):
                            self.fn(*inputs, w)
                    torch.cuda.current_stream(self.device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.fn(*inputs, w)
                self.graphs[(b, w)] = (inputs, out, graph)
        if cuda:
            torch.cuda.synchronize(self.device)
        report = {
            "graphs": len(self.graphs),
            "seconds": round(time.perf_counter() - t0, 3),
            "memory_bytes": torch.cuda.memory_allocated(self.device) - mem0 if cuda else 0,
            "batch_buckets": list(self.batch_buckets),
            "context_buckets": list(self.context_buckets),
        }
        log.info("drafter graphs captured (%s): %s", self.mode, report)
        return report

    @torch.inference_mode()
    def run(self, anchor: Tensor, slots: Tensor, lengths: Tensor, longest: int) -> tuple | None:
        """The outputs for B rows through a graph, or None when no bucket fits (run eagerly).
        longest: the longest context among the rows (a host int: no device read)."""
        B = anchor.shape[0]
        b = bucket_of(B, self.batch_buckets)
        w = bucket_of(max(longest, 1), self.context_buckets)
        if b is None or w is None:
            return None
        inputs, out, graph = self.graphs[(b, w)]
        for static, x in zip(inputs, (anchor, slots, lengths)):
            static.zero_()
            static[:B].copy_(x)
        if graph is None:
            return tuple(o[:B] for o in self.fn(*inputs, w))
        graph.replay()
        return tuple(o[:B].clone() for o in out)
