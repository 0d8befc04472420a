"""CUDA graphs of the target's decode / verify pass, one per (batch bucket, query bucket[, context bucket]).

Why: eagerly, a large target's step on a fast GPU is launch-bound: the host takes longer to
issue the step's kernels than the GPU takes to run them. Captured once per shape and
replayed, a step costs one launch from the host (the gpt-fast / SGLang approach).

What is captured is `qwen3.padded_step` (the model's one forward over a [b, q] block), over static buffers:
tokens and positions [b, q] (position -1 = padding) and slots [b]. A batch of B rows of at
most L tokens runs in the graph of the smallest buckets b >= B, q >= L; padding rows and
columns write their K/V to the slots' scratch position and are never read. Logits of all
b * q positions, their argmax and the feature-layer states are static outputs; the engine
copies back only the argmax and the features of its real rows (and computes sampling
statistics on the device from the logits, when a row samples).

The fused attention kernel reads each slot's cache up to each query's own position (the
bound is data on the device), so graphs need no context-length bucket. With the torch
attention (CPU, or a kernel that failed its self-check) attention reads a kv_len window:
then the context bucket (smallest >= the batch's kv_len) is part of the key.

Batch-invariant mode: one graph only, the largest (b, q) (and the full context window
for torch attention), so every decode and verify runs the very same kernels on the very
same shapes, and a row's logits do not depend on how many tokens or rows share the pass:
a verify of K+1 tokens gives bit-identical logits to K+1 one-token decodes (what it costs:
every step pays for the largest shape). Prefill (rows longer than q) runs eagerly, apart.

mode="static" runs the same padded function without capture (no CUDA needed): the CPU
tests check shapes, bucketing, padding and slot mapping against the eager path with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from target_service.qwen3 import Qwen3, cast_features, padded_step

log = logging.getLogger("flashmap.target.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
QUERY_BUCKETS = (1, 2, 4, 8, 17)  # 17 = anchor + a block of 16 drafts
CONTEXT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class _Static:
    """One graph's buffers. meta is [b*q tokens | b*q positions | b slots] int64, so the host
    fills one pinned array and one copy moves it."""

    meta: Tensor
    tokens: Tensor  # [b, q] view of meta
    positions: Tensor  # [b, q] view of meta, -1 = padding
    slots: Tensor  # [b] view of meta
    logits: Tensor | None = None  # [b*q, V] fp32
    argmax: Tensor | None = None  # [b*q] int64
    features: Tensor | None = None  # [b*q, F] fp32
    graph: torch.cuda.CUDAGraph | None = None
    host_meta: Tensor | None = None  # pinned staging for meta


class TargetGraphs:
    def __init__(
        self,
        model: Qwen3,
        feature_layers: tuple[int, ...],
        n_slots: int,
        batch_buckets: tuple[int, ...] | None = None,
        query_buckets: tuple[int, ...] | None = None,
        context_buckets: tuple[int, ...] | None = None,
        mode: str = "cuda",
        batch_invariant: bool = False,
        features_dtype: torch.dtype = torch.float32,
    ):
        if mode not in ("cuda", "static"):
            raise ValueError(f"mode must be 'cuda' or 'static', got {mode!r}")
        self.model, self.mode, self.batch_invariant = model, mode, batch_invariant
        self.feature_layers = tuple(feature_layers)
        self.features_dtype = features_dtype  # of the features run() hands back
        self.device = model.lm_head.weight.device
        T = model.max_seq_len
        bb = tuple(sorted({b for b in (batch_buckets or BATCH_BUCKETS) if 1 <= b <= n_slots})) or (
            n_slots,
        )
        qb = tuple(sorted({q for q in (query_buckets or QUERY_BUCKETS) if 1 <= q <= T})) or (
            min(T, 17),
        )
        windowed = model.ops.windowed_attention(model.config.head_dim)
        if windowed:
            cb = tuple(sorted({c for c in (context_buckets or CONTEXT_BUCKETS) if c < T})) + (T,)
        else:
            cb = (None,)  # the fused kernel reads each query's own length: no window
        if batch_invariant:  # one shape for every pass (see the module docstring)
            bb, qb, cb = bb[-1:], qb[-1:], cb[-1:]
        self.batch_buckets, self.query_buckets, self.context_buckets = bb, qb, cb
        self.graphs: dict[tuple[int, int, int | None], _Static] = {}
        self._pool = None

    # ------------------------------------------------------------------ shapes
    def key_for(self, n_rows: int, max_len: int, kv_len: int) -> tuple[int, int, int | None] | None:
        """The graph that runs B rows of at most max_len tokens reaching cache length kv_len,
        or None (run eagerly)."""
        b, q = bucket_of(n_rows, self.batch_buckets), bucket_of(max_len, self.query_buckets)
        c = (
            self.context_buckets[0]
            if self.context_buckets == (None,)
            else bucket_of(kv_len, self.context_buckets)
        )
        if b is None or q is None or (c is None and self.context_buckets != (None,)):
            return None
        return (b, q, c) if (b, q, c) in self.graphs else None

    def _static(self, b: int, q: int) -> _Static:
        meta = torch.zeros(2 * b * q + b, dtype=torch.long, device=self.device)
        st = _Static(
            meta, meta[: b * q].view(b, q), meta[b * q : 2 * b * q].view(b, q), meta[2 * b * q :]
        )
        st.positions.fill_(-1)
        if self.mode == "cuda":
            st.host_meta = torch.empty(meta.shape, dtype=torch.long, pin_memory=True)
        return st

    def _step(self, st: _Static, kv_len: int | None) -> tuple[Tensor, Tensor, Tensor]:
        """forward_step over the static buffers: (logits [b*q, V], argmax [b*q], features [b*q, F])."""
        valid = st.positions >= 0
        pos = st.positions.clamp_min(0)  # RoPE and attention bound of padding: position 0
        write_pos = torch.where(valid, st.positions, self.model.max_seq_len)  # padding -> scratch
        window = self.model.max_seq_len if kv_len is None else kv_len
        logits, features = padded_step(
            self.model,
            st.tokens,
            pos,
            st.slots,
            write_pos,
            pos,
            None,
            None,
            self.feature_layers,
            window,
        )
        return logits, logits.argmax(-1), features

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> dict:
        """Build (and in cuda mode capture) every bucket; returns and logs time and memory."""
        t0 = time.perf_counter()
        cuda = self.mode == "cuda"
        mem0 = torch.cuda.memory_allocated(self.device) if cuda else 0
        if cuda:
            self._pool = torch.cuda.graph_pool_handle()
        # Largest shapes first: their intermediates size the shared pool once.
        for b in sorted(self.batch_buckets, reverse=True):
            for q in sorted(self.query_buckets, reverse=True):
                for c in self.context_buckets:
                    st = self._static(b, q)
                    if cuda:
                        side = torch.cuda.Stream(self.device)
                        side.wait_stream(torch.cuda.current_stream(self.device))
                        # Warm-up outside capture (allocator, kernels, autotune).
                        with torch.cuda.stream(side):
                            for _ in range(2):
                                self._step(st, c)
                        torch.cuda.current_stream(self.device).wait_stream(side)
                        st.graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(st.graph, pool=self._pool):
                            st.logits, st.argmax, st.features = self._step(st, c)
                    self.graphs[(b, q, c)] = st
        if cuda:
            torch.cuda.synchronize(self.device)
        report = {
            "graphs": len(self.graphs),
            "seconds": round(time.perf_counter() - t0, 3),
            "mode": self.mode,
            "memory_bytes": (torch.cuda.memory_allocated(self.device) - mem0) if cuda else 0,
            "batch_buckets": list(self.batch_buckets),
            "query_buckets": list(self.query_buckets),
            "context_buckets": [c for c in self.context_buckets],
            "batch_invariant": self.batch_invariant,
            "ops": self.model.ops.describe(),
        }
        log.info("target graphs (%s): %s", self.mode, report)
        return report

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(
        self,
        key: tuple[int, int, int | None],
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
    ) -> tuple[Tensor, np.ndarray, Tensor]:
        """One pass of B <= b rows: tokens, positions [B, q'] (q' <= q, position -1 = padding),
        slots [B]. Returns the device logits [b*q, V], the argmax [B*q] on the host and the
        features [B*q, F] on the device, in features_dtype (row r's position j at r*q + j; the
        engine keeps them there and copies off what a row asks for). The device tensors are
        valid until the next run."""
        st = self.graphs[key]
        b, q, c = key
        B, L = tokens.shape
        host = (
            st.host_meta
            if st.host_meta is not None
            else torch.empty(st.meta.shape, dtype=torch.long)
        )
        h = host.numpy()
        tok, pos = h[: b * q].reshape(b, q), h[b * q : 2 * b * q].reshape(b, q)
        tok.fill(0)
        pos.fill(-1)
        tok[:B, :L], pos[:B, :L] = tokens, positions
        h[2 * b * q :] = (
            0  # padding rows: slot 0, every position padding (only its scratch is written)
        )
        h[2 * b * q : 2 * b * q + B] = slots
        st.meta.copy_(host, non_blocking=True)
        if st.graph is not None:
            st.graph.replay()
            logits, argmax, features = st.logits, st.argmax, st.features
        else:
            logits, argmax, features = self._step(st, c)
        n = B * q
        if self.device.type == "cuda":
            # A fresh pinned buffer: the argmax handed out is a view of it and outlives this call.
            a_host = torch.empty(n, dtype=torch.long, pin_memory=True)
            a_host.copy_(argmax[:n], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            a_host = argmax[:n].clone()
        return logits, a_host.numpy(), cast_features(features[:n], self.features_dtype)
