"""The Qwen3 step's non-GEMM ops in plain torch (`TorchOps`): the reference every fused kernel
must match (target_service.triton_ops), and the implementation on the CPU and for any op the
kernels do not cover.

Each op rounds the way Hugging Face's Qwen3 does (fp32 statistics, a cast to the activation
dtype where it casts). Attention gathers the rows' slots of the KV cache and reads a window of
kv_len positions (`windowed_attention`).

Shapes: M = B * L flattened tokens, E hidden, H / KV heads, D head_dim, I intermediate,
T = cache positions per slot (max_seq_len + 1 scratch position, see qwen3.KVCache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF Qwen3 RMSNorm: statistics in fp32, cast back, then the gain in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    """The reference implementation (CPU, and any op the device kernels do not cover)."""

    name = "torch"

    def describe(self) -> str:
        return self.name

    def windowed_attention(self, head_dim: int) -> bool:
        """True when `attention` reads a kv_len window of the cache (so a CUDA graph needs a
        context-length bucket); False when it reads each query's own length on the device."""
        return True

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # [M, E] -> [M, E]
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """s = residual + x; returns (s, RMSNorm(s)), both [M, E]."""
        s = residual + x
        return s, rms_norm_ref(s, weight, eps)

    def qk_norm_rope_write(
        self,
        qkv: Tensor,
        q_w: Tensor,
        k_w: Tensor,
        eps: float,
        cos: Tensor,
        sin: Tensor,
        rope_pos: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        write_slot: Tensor,
        write_pos: Tensor,
        n_heads: int,
        n_kv: int,
    ) -> Tensor:
        """qkv [M, (H + 2 KV) D] from the fused projection: RMSNorm q and k per head, RoPE at
        rope_pos [M] (tables cos, sin [T, D] fp32), write k, v at (write_slot, write_pos) [M] of
        cache [n_slots, KV, T, D]; returns q [M, H, D]."""
        M, D = qkv.shape[0], cache_k.shape[-1]
        q, k, v = qkv.split([n_heads * D, n_kv * D, n_kv * D], dim=-1)
        c, s = (
            cos[rope_pos][:, None].to(qkv.dtype),
            sin[rope_pos][:, None].to(qkv.dtype),
        )  # [M, 1, D]
        q = rms_norm_ref(q.reshape(M, n_heads, D), q_w, eps)
        k = rms_norm_ref(k.reshape(M, n_kv, D), k_w, eps)
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        # One flat row per (slot, kv head, position): index_copy_ needs no host sync, so this
        # is capturable; padding tokens all land on the slot's scratch position.
        T = cache_k.shape[2]
        heads = torch.arange(n_kv, device=qkv.device)
        idx = ((write_slot[:, None] * n_kv + heads) * T + write_pos[:, None]).reshape(
            -1
        )  # [M * KV]
        cache_k.view(-1, D).index_copy_(0, idx, k.reshape(-1, D))
        cache_v.view(-1, D).index_copy_(0, idx, v.reshape(-1, D))
        return q

    def attention(
        self,
        q: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        slots: Tensor,
        q_limit: Tensor,
        kv_len: int,
        mask: Tensor | None = None,
    ) -> Tensor:
        """q [B, L, H, D] over the cache rows of `slots` [B]: query (b, l) sees cache positions
        <= q_limit[b, l] (or the explicit mask [B, 1, L, kv_len]); returns [B, L, H * D]."""
        B, L, H, D = q.shape
        keys = cache_k[:, :, :kv_len].index_select(0, slots)  # [B, KV, S, D]
        values = cache_v[:, :, :kv_len].index_select(0, slots)
        if mask is None:
            mask = (torch.arange(kv_len, device=q.device) <= q_limit[..., None])[
                :, None
            ]  # [B, 1, L, S]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(B, L, H * D)

    def silu_mul(self, gate_up: Tensor) -> Tensor:  # [M, 2I] -> [M, I]
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u
