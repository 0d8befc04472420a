"""The Qwen3 step's non-GEMM ops as fused Triton kernels (`TritonOps`; the kernels themselves
are in target_service.triton_kernels, imported on first use).

At batch 1 a decode step is the weight reads of a few GEMMs per layer, and the eager model
puts many small elementwise kernels between them (RMSNorm alone is 7: cast, pow, mean, add,
rsqrt, mul, cast); inside a CUDA graph each still costs a launch slot. Fused, a layer is 9
kernels: add+RMSNorm, QKV GEMM, q/k-norm+RoPE+KV-write, attention, o GEMM, add+RMSNorm,
gate/up GEMM, SiLU*up, down GEMM. Each kernel rounds the way its torch op
(target_service.torch_ops) does, so the two agree to rounding; an op not enabled, or a shape a
kernel does not take, runs the torch op.

Attention reads the slot KV cache in place (the slot and each query's visible length come
from device tensors): no gather of [B, KV, S, D] per layer, and no context-length bucket is
needed, since the loop bound is read on the device. Each query row is computed by the same
program shape with keys visited in fixed blocks from position 0, so a row's result does not
depend on how many other rows share the launch (fully masked key blocks add exact zeros): the
basis of the batch-invariant mode.

Shapes as in target_service.torch_ops.
"""

from __future__ import annotations

import math

import torch

from target_service.torch_ops import TorchOps

_KERNELS = None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no kernels
        return False
    return True


def _kernels():
    """The kernel module, imported on first use."""
    global _KERNELS
    if _KERNELS is None:
        from target_service import triton_kernels

        _KERNELS = triton_kernels
    return _KERNELS


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def attention_blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the attention kernel: fixed per dtype, never chosen
    from the batch, so every row is computed by the same program shape (batch invariance).
    128 query rows cover a Qwen3-8B verify (17 tokens x 4 query heads per KV head = 68 rows)
    in one program, so each slot's K/V is read once per layer."""
    return (64, 32, 4) if dtype == torch.float32 else (128, 64, 8)


class TritonOps(TorchOps):
    """Triton kernels for the ops in `enabled`; everything else falls back to TorchOps."""

    name = "triton"
    ALL = ("rms_norm", "qk_norm_rope_write", "attention", "silu_mul")

    def __init__(self, enabled: tuple[str, ...] = ALL):
        self.enabled = set(enabled)
        self.k = _kernels()

    def describe(self) -> str:
        return "triton(" + ",".join(op for op in self.ALL if op in self.enabled) + ")"

    def windowed_attention(self, head_dim: int) -> bool:
        return not ("attention" in self.enabled and _attention_fits(head_dim))

    def rms_norm(self, x, weight, eps):
        if "rms_norm" not in self.enabled:
            return super().rms_norm(x, weight, eps)
        return self._norm(x, None, weight, eps)[1]

    def add_rms_norm(self, x, residual, weight, eps):
        if "rms_norm" not in self.enabled:
            return super().add_rms_norm(x, residual, weight, eps)
        return self._norm(x, residual, weight, eps)

    def _norm(self, x, residual, weight, eps):
        M, N = x.shape
        y = torch.empty_like(x)
        s = torch.empty_like(x) if residual is not None else y
        r = residual if residual is not None else x
        block = _pow2(N)
        self.k.rms_norm_kernel[(M,)](
            x,
            r,
            weight,
            y,
            s,
            x.stride(0),
            r.stride(0),
            y.stride(0),
            s.stride(0),
            N,
            eps,
            HAS_RES=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
        return s, y

    def qk_norm_rope_write(
        self,
        qkv,
        q_w,
        k_w,
        eps,
        cos,
        sin,
        rope_pos,
        cache_k,
        cache_v,
        write_slot,
        write_pos,
        n_heads,
        n_kv,
    ):
        D = cache_k.shape[-1]
        if "qk_norm_rope_write" not in self.enabled or D % 2 or D & (D - 1) or qkv.stride(-1) != 1:
            return super().qk_norm_rope_write(
                qkv,
                q_w,
                k_w,
                eps,
                cos,
                sin,
                rope_pos,
                cache_k,
                cache_v,
                write_slot,
                write_pos,
                n_heads,
                n_kv,
            )
        M = qkv.shape[0]
        q = torch.empty(M, n_heads, D, dtype=qkv.dtype, device=qkv.device)
        # The kernel indexes these [M] vectors with stride 1; a one-row batch's are broadcast
        # views with stride 0, which it would read and write out of bounds.
        rope_pos, write_slot, write_pos = (
            rope_pos.contiguous(),
            write_slot.contiguous(),
            write_pos.contiguous(),
        )
        self.k.qk_rope_kernel[(M, n_heads + 2 * n_kv)](
            qkv,
            q_w,
            k_w,
            cos,
            sin,
            rope_pos,
            write_slot,
            write_pos,
            q,
            cache_k,
            cache_v,
            qkv.stride(0),
            q.stride(0),
            q.stride(1),
            cache_k.stride(0),
            cache_k.stride(1),
            cache_k.stride(2),
            cos.stride(0),
            eps,
            H=n_heads,
            KV=n_kv,
            HALF=D // 2,
            num_warps=1,
        )
        return q

    def attention(self, q, cache_k, cache_v, slots, q_limit, kv_len, mask=None):
        B, L, H, D = q.shape
        KV = cache_k.shape[1]
        if (
            "attention" not in self.enabled
            or mask is not None
            or not _attention_fits(D)
            or q.stride(-1) != 1
        ):
            return super().attention(q, cache_k, cache_v, slots, q_limit, kv_len, mask)
        G = H // KV
        slots, q_limit = (
            slots.contiguous(),
            q_limit.contiguous(),
        )  # indexed with stride 1 (see qk_norm_rope_write)
        bm, bn, warps = attention_blocks(q.dtype)
        out = torch.empty(B, L, H, D, dtype=q.dtype, device=q.device)
        grid = (B, KV, triton_cdiv(L * G, bm))
        self.k.attention_kernel[grid](
            q,
            cache_k,
            cache_v,
            slots,
            q_limit,
            out,
            L,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            cache_k.stride(0),
            cache_k.stride(1),
            cache_k.stride(2),
            q_limit.stride(0),
            math.log2(math.e) / math.sqrt(D),
            G=G,
            D=D,
            BLOCK_M=bm,
            BLOCK_N=bn,
            IEEE=q.dtype == torch.float32,
            num_warps=warps,
            num_stages=2,
        )
        return out.view(B, L, H * D)

    def silu_mul(self, gate_up):
        if "silu_mul" not in self.enabled:
            return super().silu_mul(gate_up)
        M, I2 = gate_up.shape
        out = torch.empty(M, I2 // 2, dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        self.k.silu_mul_kernel[(M, triton_cdiv(I2 // 2, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), I2 // 2, BLOCK=block, num_warps=4
        )
        return out


def _attention_fits(head_dim: int) -> bool:
    """tl.dot needs a power-of-two head_dim of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
