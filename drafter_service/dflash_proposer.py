"""Serving proposer of a published DFlash drafter (drafter_service.dflash).

Each sequence has a slot in static caches of the injected context keys / values of every
layer ([n_layers, n_slots, kv_heads, max_context, head_dim]). `extend_many` writes the new
positions of any number of sequences with one context projection (one matmul over all
layers' stacked k/v weights) and one indexed write; `propose` drafts one block per request
with one batched forward. There is no flow: the step count is accepted and ignored, and the
block's draws are the proposal's (drafter_service.proposals). Truncating leaves cache rows
past the new length in place: masked now, overwritten by the next extend.
"""

from __future__ import annotations

import numpy as np
import torch

from drafter_service.dflash import DFlashDrafter
from drafter_service.flashmap_proposer import request_generator
from drafter_service.proposals import block_drafts
from drafter_service.proposer import Proposer
from drafter_service.slots import SlotTable
from flashmap.types import Draft, ProposeRequest


class DFlashProposer(Proposer):
    def __init__(
        self, model: DFlashDrafter, n_slots: int = 64, max_context: int = 4096, device: str = "cpu"
    ):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        c = model.cfg
        self.cfg = c
        self.block_size = model.block_size
        self.feature_dim = c.feature_dim
        self.vocab_size = c.vocab_size
        self.slots = SlotTable(n_slots, max_context)
        dtype = next(model.parameters()).dtype
        shape = (c.num_hidden_layers, n_slots, c.num_key_value_heads, max_context, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def n_slots(self) -> int:
        return self.slots.n_slots

    @property
    def bytes_per_context_token(self) -> int:
        c = self.cfg
        return (
            2
            * c.num_hidden_layers
            * c.num_key_value_heads
            * c.head_dim
            * self.k_cache.element_size()
        )

    def release(self, seq_id: str) -> None:
        self.slots.release(seq_id)

    def context_length(self, seq_id: str) -> int:
        return self.slots.context_length(seq_id)

    def truncate(self, seq_id: str, length: int) -> None:
        self.slots.truncate(seq_id, length)

    def extend(self, seq_id: str, token_ids: np.ndarray, features) -> None:
        self.extend_many([(seq_id, token_ids, features)])

    @torch.inference_mode()
    def extend_many(self, items: list[tuple[str, np.ndarray, object]]) -> None:
        """Append committed positions of several sequences: (seq_id, token_ids [m],
        features [m, F]) each, features as numpy or a tensor on any device."""
        slots, positions, feats = [], [], []
        for seq_id, token_ids, f in items:
            m = len(token_ids)
            if tuple(f.shape) != (m, self.feature_dim):
                raise ValueError(
                    f"features must be [{m}, {self.feature_dim}] for {m} tokens, got {tuple(f.shape)}"
                )
            slot, start = self.slots.reserve(seq_id, m)
            slots.append(np.full(m, slot))
            positions.append(np.arange(start, start + m))
            feats.append(torch.as_tensor(f))
        if not sum(len(p) for p in positions):
            return
        pos = torch.from_numpy(np.concatenate(positions)).to(self.device)  # [N]
        slot = torch.from_numpy(np.concatenate(slots)).to(self.device)  # [N]
        x = torch.cat([f.to(self.device) for f in feats])  # [N, F]
        k, v = self.model.context_kv(x, pos)  # [n_layers, N, kv, d]
        # Two advanced indices around a slice put their dim first: the target is [N, n_layers, kv, d].
        self.k_cache[:, slot, :, pos] = k.transpose(0, 1).to(self.k_cache.dtype)
        self.v_cache[:, slot, :, pos] = v.transpose(0, 1).to(self.v_cache.dtype)
        for (seq_id, _, _), p in zip(items, positions):
            if len(p):
                self.slots.lengths[self.slots.slot_of[seq_id]] = int(p[-1]) + 1

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest], steps: int | None = None) -> list[Draft]:
        if not requests:
            return []
        for r in requests:
            if r.temperature < 0 or (r.temperature > 0 and r.top_m < 1):
                raise ValueError(f"request {r.seq_id!r}: need temperature >= 0 and top_m >= 1")
        rows = [self.slots.lookup(r.seq_id) for r in requests]
        lengths = [length for _, length in rows]
        window = max(lengths + [1])
        slot = torch.tensor([max(s, 0) for s, _ in rows], device=self.device)  # [B]
        lengths_t = torch.tensor(lengths, device=self.device)
        anchor = torch.tensor([int(r.anchor) for r in requests], device=self.device)
        k = self.k_cache[:, slot, :, :window]  # [n_layers, B, kv, W, d]
        v = self.v_cache[:, slot, :, :window]
        logits = self.model.block_logits(anchor, lengths_t, list(k), list(v), lengths_t)
        return block_drafts(
            logits,
            [r.temperature for r in requests],
            [r.top_m for r in requests],
            [request_generator(r.seed) for r in requests],
        )
