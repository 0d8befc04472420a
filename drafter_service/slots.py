"""Per-sequence slots of the serving proposers' static caches (FlashMap / DFlash-style in
flashmap_proposer, DFlash in dflash_proposer, EAGLE-3 in eagle3_proposer, EAGLE-style in eagle).

`SlotTable` is the bookkeeping: seq_id -> cache slot, the free list (slot 0 handed out
first) and a host copy of each slot's context length (no device sync to read it).
`SlotCacheProposer` is the Proposer base the serving proposers share: the model, device,
K/V cache buffers [layers, n_slots, heads, max_context, head_dim], the slot table,
`extend_many` (input checks, slots, max_context for every sequence, then ONE write of all
their new positions by the subclass's `_write_many`), and the sequence-level calls that only
touch the table (release, truncate, context_length, set_steps).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from drafter_service.proposer import Features, Proposer
from flashmap.drafts import ProposeRequest


class ProposerError(RuntimeError):
    """The proposer cannot serve this sequence (callers may fall back to plain decoding)."""


class SlotsExhausted(ProposerError):
    pass


class ContextTooLong(ProposerError):
    pass


class SlotTable:
    def __init__(self, n_slots: int, max_context: int):
        self.n_slots, self.max_context = n_slots, max_context
        self.lengths = np.zeros(n_slots, np.int64)  # host copy: no device sync to read lengths
        self.slot_of: dict[str, int] = {}
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def acquire(self, seq_id: str) -> int:
        """The slot of seq_id, taking a free one (length 0) for a new sequence."""
        slot = self.slot_of.get(seq_id)
        if slot is None:
            if not self._free:
                raise SlotsExhausted(
                    f"all {self.n_slots} drafter slots are in use; release finished "
                    f"sequences or start the drafter with more slots"
                )
            slot = self._free.pop()
            self.slot_of[seq_id] = slot
            self.lengths[slot] = 0
        return slot

    def reserve(self, seq_id: str, m: int) -> tuple[int, int]:
        """(slot, start) for appending m positions to seq_id; ContextTooLong past max_context.
        The caller writes the cache rows start..start+m-1 and then sets lengths[slot]."""
        slot = self.acquire(seq_id)
        start = int(self.lengths[slot])
        if start + m > self.max_context:
            raise ContextTooLong(
                f"sequence {seq_id!r}: context {start + m} exceeds the drafter's "
                f"max_context {self.max_context}"
            )
        return slot, start

    def lookup(self, seq_id: str) -> tuple[int, int]:
        """(slot, length) of seq_id; (-1, 0) for an unknown sequence. Takes no slot."""
        slot = self.slot_of.get(seq_id, -1)
        return slot, 0 if slot < 0 else int(self.lengths[slot])

    def release(self, seq_id: str) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.lengths[slot] = 0
            self._free.append(slot)

    def context_length(self, seq_id: str) -> int:
        return self.lookup(seq_id)[1]

    def truncate(self, seq_id: str, n: int) -> None:
        """Keep only the first n context positions (the cache rows past n stay in place)."""
        have = self.context_length(seq_id)
        if not 0 <= n <= have:
            raise ValueError(f"cannot truncate {seq_id!r} to {n}: it holds {have} positions")
        if seq_id in self.slot_of:
            self.lengths[self.slot_of[seq_id]] = n


class SlotCacheProposer(Proposer):
    """A drafter model served from static per-slot K/V caches of `cache_layers` layers.

    Truncating only moves a slot's length back: each subclass keeps the cache rows below the
    new length valid (they depend on earlier positions only) and masks or overwrites the rest."""

    def __init__(
        self,
        model: torch.nn.Module,
        n_slots: int,
        max_context: int,
        device: str,
        cache: tuple[int, int, int],
        block_size: int,
        context_dim: int,
    ):
        """cache: (layers, heads, head_dim) of the K/V cache; context_dim: the drafter's width
        after its context projection (the other width extend_many takes)."""
        cfg = model.cfg
        self.model = model.to(device).eval()
        self.cfg = cfg
        self.device = torch.device(device)
        self.block_size = block_size
        self.feature_dim = cfg.feature_dim
        self.context_dim = context_dim
        self.vocab_size = cfg.vocab_size
        self.slots = SlotTable(n_slots, max_context)
        dtype = next(model.parameters()).dtype
        layers, heads, head_dim = cache
        shape = (layers, n_slots, heads, max_context, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def n_slots(self) -> int:
        return self.slots.n_slots

    @property
    def max_context(self) -> int:
        return self.slots.max_context

    def release(self, seq_id: str) -> None:
        self.slots.release(seq_id)

    def context_length(self, seq_id: str) -> int:
        return self.slots.context_length(seq_id)

    def truncate(self, seq_id: str, n: int) -> None:
        self.slots.truncate(seq_id, n)

    @torch.inference_mode()
    def extend_many(self, items: list[tuple[str, np.ndarray, Features]]) -> dict[str, Exception]:
        errors: dict[str, Exception] = {}
        by_width: dict[int, list] = {}  # raw and projected features cannot share one tensor
        for seq_id, token_ids, features in items:
            try:
                token_ids = np.asarray(token_ids, np.int64).reshape(-1)
                f = as_tensor(features, self.device)
                m = len(token_ids)
                if (
                    f.ndim != 2
                    or f.shape[0] != m
                    or f.shape[1] not in (self.feature_dim, self.context_dim)
                ):
                    raise ValueError(
                        f"features must be [{m}, {self.feature_dim}] (or [{m}, {self.context_dim}] "
                        f"projected) for {m} tokens, got {list(f.shape)}"
                    )
                slot, start = self.slots.reserve(seq_id, m)
            except (ValueError, ProposerError) as e:
                errors[seq_id] = e
                continue
            if m:
                by_width.setdefault(f.shape[1], []).append((slot, start, token_ids, f))
                self.slots.lengths[slot] = start + m  # a second item of this sequence follows it
        for rows in by_width.values():
            slots = np.concatenate([np.full(len(t), s) for s, _, t, _ in rows])
            pos = np.concatenate([np.arange(p, p + len(t)) for _, p, t, _ in rows])
            try:
                self._write_many(
                    torch.from_numpy(slots).to(self.device),
                    torch.from_numpy(pos).to(self.device),
                    np.concatenate([t for _, _, t, _ in rows]),
                    torch.cat([f for *_, f in rows]),
                )
            except BaseException:
                for slot, start, _, _ in rows:  # nothing of these rows is held
                    self.slots.lengths[slot] = min(self.slots.lengths[slot], start)
                raise
        return errors

    def _write_many(
        self, slots: Tensor, positions: Tensor, token_ids: np.ndarray, features: Tensor
    ) -> None:
        """Cache N new context positions of any sequences in one pass: cache slots and positions
        [N] (device), token ids [N], features [N, F or D] (device). The default writes the
        injected keys / values the model's `context_kv` gives for every layer at once; the
        caller sets the slots' lengths."""
        k, v = self._context_kv(features, positions)  # [layers, N, heads, head_dim]
        # Two index tensors around a slice put their dimension first: the target is [N, layers, heads, d].
        self.k_cache[:, slots, :, positions] = k.transpose(0, 1).to(self.k_cache.dtype)
        self.v_cache[:, slots, :, positions] = v.transpose(0, 1).to(self.v_cache.dtype)

    def _context_kv(self, features: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.context_kv(features, positions)

    # Proposer attribute -> (the model method enable_compile runs through torch.compile,
    # whether its weights are frozen into the compiled program: compiled.Compiled).
    COMPILED: dict[str, tuple[str, bool]] = {}

    def enable_compile(self, steps: tuple[int, ...] = (1,), warmup: bool = True) -> dict:
        """Draft through torch.compile (drafter_service.compiled), the CPU counterpart of CUDA
        graphs: each COMPILED method of the model is compiled, shared by the proposers of that
        model. warmup: compile now, every variant with each step count in `steps` (else the
        first requests pay the compilation). Returns a report."""
        from drafter_service.compiled import compiled_method

        if self.available_steps is not None:
            raise RuntimeError(
                "CUDA graphs are enabled: they already replay the drafter; compile is for CPU"
            )
        for attr, (method, freeze) in self.COMPILED.items():
            setattr(self, attr, compiled_method(self.model, method, freeze))
        t0 = time.perf_counter()
        if warmup:
            self._compile_warmup(steps)
        failed = [getattr(self, a).failed for a in self.COMPILED if getattr(self, a).failed]
        return {
            "compiled": not failed,
            "seconds": round(time.perf_counter() - t0, 1),
            "failed": failed,
        }

    def _compile_warmup(self, steps: tuple[int, ...]) -> None:
        """Draft once through every variant torch.compile makes of the drafter (sizes 0 and 1
        are specialised): one and two sequences, one and three new positions, a sequence
        without context; on throw-away sequences, released after."""
        seqs = ["__compile_warmup_0__", "__compile_warmup_1__"][: min(2, self.n_slots)]
        try:
            for m in (3, 1):
                self.extend_many(
                    [
                        (seq, np.zeros(m, np.int64), np.zeros((m, self.feature_dim), np.float32))
                        for seq in seqs
                    ]
                )
            for n in steps:
                for batch in [seqs[:i] for i in range(1, len(seqs) + 1)] + [
                    ["__compile_warmup_new__"]
                ]:
                    self.propose(
                        [
                            ProposeRequest(
                                seq_id=q, anchor=0, temperature=0.0, seed=0, draft_steps=n
                            )
                            for q in batch
                        ]
                    )
        finally:
            for seq in seqs:
                self.release(seq)


def as_tensor(features: Features, device: torch.device) -> Tensor:
    """Features as one tensor on `device` (pieces concatenated there); float16 and bfloat16 stay
    as they came (the model casts them), numpy float64 becomes float32."""
    if isinstance(features, (list, tuple)):
        parts = [as_tensor(p, device) for p in features]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    if isinstance(features, np.ndarray):
        if features.dtype not in (np.float16, np.float32):
            features = features.astype(np.float32)
        features = torch.from_numpy(np.ascontiguousarray(features))
    return features.to(device, non_blocking=True)
