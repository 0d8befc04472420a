"""The building blocks of the FlashMap DiT (drafter_service.flashmap_dit): attention (as
self-attention over the block and as cross-attention to the context), the DiT block with
adaLN-Zero, the sinusoidal embedding of flow times, and the context's per-block K/V
(`CrossContext`).

A DiT block is self-attention over [anchor, slots] (bidirectional, learned positions),
cross-attention to the projected context (RoPE at absolute positions) and an MLP, each wrapped
in adaLN-Zero (shift, scale, gate) from the jump's conditioning vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from drafter_service.config import DrafterConfig
from drafter_service.layers import rope


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of flow times in [0, 1] (scaled by 1000 as in DiT): [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half
    )
    args = 1000.0 * t.float()[:, None] * freqs[None]  # [B, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def apply_rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding at absolute positions: x [B, h, L, d], pos [B, L] -> [B, h, L, d]
    (layers.rope in the heads-first layout)."""
    return rope(x.transpose(1, 2), pos, theta).transpose(1, 2)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: x [B, L, D], shift/scale [B, D]."""
    return x * (1 + scale[:, None]) + shift[:, None]


@dataclass
class CrossContext:
    """Projected context for one batch of blocks.

    kv: per DiT block (k, v), each [B, h, T, d]; keys already RoPE-rotated at their
    absolute positions 0..T-1. lengths [B] int64: valid context positions per row, which
    is also the anchor's position (the context is strictly before the anchor).
    """

    kv: list[tuple[Tensor, Tensor]]
    lengths: Tensor

    def select(self, index: Tensor, lengths: Tensor | None = None) -> CrossContext:
        """Rows `index` of this context, optionally cut to shorter `lengths` (training: many
        anchors of one sequence share one encoded context)."""
        lengths = self.lengths[index] if lengths is None else lengths
        return CrossContext([(k[index], v[index]) for k, v in self.kv], lengths)


class Attention(nn.Module):
    """Multi-head attention; used as self-attention (no RoPE, learned positions) and as
    cross-attention to the context (RoPE at absolute positions)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self._init_projections(cfg)

    def _init_projections(self, cfg: DrafterConfig) -> None:
        """Register wq, wk, wv, wo, q_norm, k_norm (a subclass may register modules before them)."""
        D, self.n_heads, self.theta = cfg.dim, cfg.n_heads, cfg.rope_theta
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)
        norm = (lambda: nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def _heads(self, x: Tensor) -> Tensor:  # [B, L, D] -> [B, h, L, d]
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, -1).transpose(1, 2)

    def project_kv(self, src: Tensor, pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """src [B, T, D] -> k, v [B, h, T, d]; keys rotated at pos [B, T] when given."""
        k = self.k_norm(self._heads(self.wk(src)))
        if pos is not None:
            k = apply_rope(k, pos, self.theta)
        return k, self._heads(self.wv(src))

    def query(self, x: Tensor, pos: Tensor | None = None) -> Tensor:
        """x [B, L, D] -> q [B, h, L, d]; rotated at pos [B, L] when given."""
        q = self.q_norm(self._heads(self.wq(x)))
        return q if pos is None else apply_rope(q, pos, self.theta)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """Queries q [B, h, L, d] over k, v [B, h, T, d] -> output projection [B, L, D];
        mask broadcastable to [B, h, L, T] bool (True = attend)."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, L, d]
        return self.wo(o.transpose(1, 2).flatten(2))  # [B, L, D]

    def forward(
        self,
        x: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        q_pos: Tensor | None = None,
    ) -> Tensor:
        """x [B, L, D] attends to k, v [B, h, T, d]; mask [B, 1, 1, T] bool (True = attend)."""
        return self.attend(self.query(x, q_pos), k, v, mask)


class DiTBlock(nn.Module):
    """Self-attention, cross-attention, MLP; each with adaLN-Zero (shift, scale, gate)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        D = cfg.dim
        self.norm1, self.norm2, self.norm3 = (
            nn.RMSNorm(D, eps=cfg.norm_eps, elementwise_affine=False) for _ in range(3)
        )
        self.self_attn = Attention(cfg)
        self.cross_attn = Attention(cfg)
        self.mlp = nn.Sequential(
            nn.Linear(D, cfg.mlp_hidden, bias=False),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.mlp_hidden, D, bias=False),
        )
        self.adaln = nn.Linear(D, 9 * D)  # zero-initialised: gates start at 0, block = identity

    def modulation(self, c: Tensor) -> Tensor:
        """Conditioning c [B, D] -> the nine adaLN vectors, concatenated [B, 9D]."""
        return self.adaln(F.silu(c))

    def forward(
        self,
        h: Tensor,
        mod: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        q_pos: Tensor,
        has_ctx: Tensor,
    ) -> Tensor:
        """h [B, K+1, D], mod [B, 9D] this block's `modulation`, k/v [B, h, T, d] this block's
        context, has_ctx [B, 1, 1]: 0 for rows without context (their cross-attention is skipped)."""
        sh1, sc1, g1, sh2, sc2, g2, sh3, sc3, g3 = mod.chunk(9, dim=-1)  # 9 x [B, D]
        y = modulate(self.norm1(h), sh1, sc1)
        h = h + g1[:, None] * self.self_attn(y, *self.self_attn.project_kv(y))
        if k.shape[2] > 0:
            y = modulate(self.norm2(h), sh2, sc2)
            h = h + g2[:, None] * has_ctx * self.cross_attn(y, k, v, mask, q_pos)
        y = modulate(self.norm3(h), sh3, sc3)
        return h + g3[:, None] * self.mlp(y)
