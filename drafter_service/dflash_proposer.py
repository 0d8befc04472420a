"""Serving proposer of a published DFlash drafter (drafter_service.dflash).

Each sequence has a slot in static caches of the injected context keys / values of every
layer ([n_layers, n_slots, kv_heads, max_context, head_dim]), written for every sequence's
new positions in one pass (SlotCacheProposer.extend_many over DFlashDrafter.context_kv);
`propose` drafts one block per request with one batched forward. There is no flow: the step
count is accepted and ignored, and a block's draws are the proposal's
(drafter_service.proposals). Truncating leaves cache rows past the new length in place:
masked now, overwritten by the next extend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafter_service.cuda_graphs import BucketGraphs
from drafter_service.dflash import DFlashDrafter
from drafter_service.flashmap_proposer import request_generator
from drafter_service.proposals import block_drafts
from drafter_service.slots import SlotCacheProposer
from flashmap.drafts import Draft, ProposeRequest


class DFlashProposer(SlotCacheProposer):
    def __init__(
        self, model: DFlashDrafter, n_slots: int = 64, max_context: int = 4096, device: str = "cpu"
    ):
        c = model.cfg
        cache = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        super().__init__(
            model, n_slots, max_context, device, cache, model.block_size, c.hidden_size
        )
        self.graphs: BucketGraphs | None = None  # after enable_graphs()

    @property
    def bytes_per_context_token(self) -> int:
        return 2 * self.k_cache[:, 0, :, 0].numel() * self.k_cache.element_size()

    def _block(self, anchor: Tensor, slot: Tensor, lengths: Tensor, window: int) -> tuple[Tensor]:
        """Logits [B, K, V] of the blocks after `anchor`, reading `window` cached positions."""
        k = self.k_cache[:, slot, :, :window]  # [n_layers, B, kv, W, d]
        v = self.v_cache[:, slot, :, :window]
        return (self.model.block_logits(anchor, lengths, list(k), list(v), lengths),)

    def enable_graphs(self, steps: tuple[int, ...] = (1, 2), mode: str = "cuda", **buckets) -> dict:
        """Capture the block's pass per (batch bucket, context bucket) (cuda_graphs.BucketGraphs)."""
        self.graphs = BucketGraphs(
            self._block, self.n_slots, self.max_context, self.device, mode=mode, **buckets
        )
        return self.graphs.capture()

    @torch.inference_mode()
    def propose(
        self, requests: list[ProposeRequest], draft_steps: int | None = None
    ) -> list[Draft]:
        if not requests:
            return []
        for r in requests:
            if r.temperature < 0 or (r.temperature > 0 and r.top_m < 1):
                raise ValueError(f"request {r.seq_id!r}: need temperature >= 0 and top_m >= 1")
        rows = [self.slots.lookup(r.seq_id) for r in requests]
        lengths = [length for _, length in rows]
        slot = torch.tensor([max(s, 0) for s, _ in rows], device=self.device)  # [B]
        lengths_t = torch.tensor(lengths, device=self.device)
        anchor = torch.tensor([int(r.anchor) for r in requests], device=self.device)
        out = self.graphs.run(anchor, slot, lengths_t, max(lengths)) if self.graphs else None
        (logits,) = out or self._block(anchor, slot, lengths_t, max(lengths + [1]))
        return block_drafts(
            logits,
            [r.temperature for r in requests],
            [r.top_m for r in requests],
            [request_generator(r.seed) for r in requests],
        )
