"""Pieces the drafter networks share: rotary embedding, and the injected context of every layer
in one pass.

A drafter attends to the committed context through keys and values each layer projects from
the same context vectors c_p (FlashMap's cross-attention, DFlash's KV injection). `StackedKV`
holds every layer's key and value projections as one matrix, so `context_kv` computes the
keys and values of any number of new positions, of every layer, with one matmul, one norm
and one rotation: the cost of extending the context does not grow with the layers or the
sequences in a batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding ("rotate half" layout, as Qwen3 / Llama) of x [..., L, heads, d] at
    integer positions pos [..., L]; angles and products in float32, the result in x's dtype."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float()[..., None, None] * inv_freq  # [..., L, 1, d/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class StackedKV:
    """The key / value projections (and key norms) of several layers as one weight [layers *
    2 * heads * d, width]. Under no-grad it is built once and rebuilt only when a weight
    changes; with grad it is concatenated afresh, so training differentiates through it."""

    def __init__(self, layers: list[tuple[nn.Linear, nn.Linear, nn.Module]]):
        self.layers = layers  # (k_proj, v_proj, k_norm: nn.RMSNorm or nn.Identity) per layer
        self._cache: tuple | None = None

    def __len__(self) -> int:
        return len(self.layers)

    def _params(self) -> list[Tensor]:
        return [p for k, v, n in self.layers for m in (k, v, n) for p in m.parameters()]

    def _build(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        w = torch.cat([torch.cat([k.weight, v.weight]) for k, v, _ in self.layers])
        b = None
        if self.layers[0][0].bias is not None:
            b = torch.cat([torch.cat([k.bias, v.bias]) for k, v, _ in self.layers])
        norm = None
        if isinstance(self.layers[0][2], nn.RMSNorm) and self.layers[0][2].weight is not None:
            norm = torch.stack([n.weight for _, _, n in self.layers])[:, None]  # [layers, 1, d]
        return w, b, norm

    def __call__(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        params = self._params()
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return self._build()
        # data_ptr too: Module.to() swaps a parameter's data without bumping its version.
        key = tuple((id(p), p._version, p.data_ptr(), p.dtype) for p in params)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, self._build())
        return self._cache[1]


def context_kv(
    c: Tensor, positions: Tensor, stacked: StackedKV, heads: int, eps: float, theta: float
) -> tuple[Tensor, Tensor]:
    """Keys and values of context vectors c [N, width] at positions [N], for every layer of
    `stacked`: k, v [layers, N, heads, d]; keys RMS-normalised (when the layers have key norms)
    and rotated."""
    w, b, norm = stacked()
    n = len(stacked)
    kv = F.linear(c.to(w.dtype), w, b).view(c.shape[0], n, 2, heads, -1)  # [N, n, 2, h, d]
    k, v = kv[:, :, 0], kv[:, :, 1]
    if norm is not None:
        k = F.rms_norm(k, (k.shape[-1],), eps=eps) * norm[None]
    k = rope(k.transpose(0, 1), positions[None].expand(n, -1), theta)  # [n, N, h, d]
    return k, v.transpose(0, 1)
