"""Pieces the drafter networks share: rotary embedding (a base theta, or a published config's
scaled RoPE), and the injected context of every layer in one pass.

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

from flashmap.checkpoint import CheckpointError
from flashmap.rope_config import RopeParameters

# Kinds whose frequencies are fixed (not a function of the sequence length) and whose
# cos / sin are the default's times one factor: transformers' init functions give both.
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn")


class Rotary:
    """The RoPE of a published config: the default kind's frequencies from theta, or a scaled
    kind's inverse frequencies [d/2] and cos / sin factor from transformers' own init functions
    (`ROPE_INIT_FUNCTIONS`, as its Llama / Qwen3 rotary embeddings compute them). The
    frequencies stay float32 whatever the model's dtype, one copy per device (made on first
    use, which the proposers' warm-up runs before any CUDA graph capture)."""

    def __init__(
        self, params: RopeParameters, head_dim: int, max_position_embeddings: int, where: str
    ):
        self.params = params
        self.inv_freq: Tensor | None = None
        self.scale = 1.0
        self._on: dict[torch.device, Tensor] = {}
        if params.rope_type == "default":
            return
        if params.rope_type not in SCALED_ROPE_TYPES:
            raise CheckpointError(
                f"{where}: rope_type {params.rope_type!r} (rope_parameters / rope_scaling) is "
                f"not supported; supported: default, {', '.join(SCALED_ROPE_TYPES)}"
            )
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        try:  # the config class validates the kind's fields as transformers loads them
            cfg = Qwen3Config(
                hidden_size=head_dim,
                head_dim=head_dim,
                num_attention_heads=1,
                num_key_value_heads=1,
                max_position_embeddings=max_position_embeddings,
                rope_parameters=params.as_dict(),
            )
            inv_freq, scale = ROPE_INIT_FUNCTIONS[params.rope_type](cfg, torch.device("cpu"))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            msg = str(e).strip("'\"").replace("\n", " ")
            raise CheckpointError(
                f"{where}: rope_parameters of rope_type {params.rope_type!r}: {msg}"
            ) from None
        self.inv_freq, self.scale = inv_freq.float(), float(scale)

    def frequencies(self, device: torch.device) -> Tensor:
        """The scaled kind's inverse frequencies [d/2] float32 on device."""
        f = self._on.get(device)
        if f is None:
            f = self._on[device] = self.inv_freq.to(device)
        return f


def rope(x: Tensor, pos: Tensor, theta: float | Rotary) -> Tensor:
    """Rotary embedding ("rotate half" layout, as Qwen3 / Llama) of x [..., L, heads, d] at
    integer positions pos [..., L], with base theta or a published config's Rotary; angles and
    products in float32, the result in x's dtype."""
    d = x.shape[-1]
    if isinstance(theta, Rotary) and theta.inv_freq is not None:
        inv_freq, scale = theta.frequencies(x.device), theta.scale
    else:
        base = theta.params.theta if isinstance(theta, Rotary) else theta
        inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
        scale = 1.0
    ang = pos.float()[..., None, None] * inv_freq  # [..., L, 1, d/2]
    cos, sin = ang.cos(), ang.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
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
    c: Tensor, positions: Tensor, stacked: StackedKV, heads: int, eps: float, theta: float | Rotary
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
