"""The Qwen3 step's non-GEMM ops: plain torch everywhere, fused Triton kernels on CUDA.

Why: at batch 1 a decode step is the weight reads of a few GEMMs per layer, and the eager
model puts many small elementwise kernels between them (RMSNorm alone is 7: cast, pow,
mean, add, rsqrt, mul, cast). Inside a CUDA graph each still costs a launch slot, and
together they are a sizeable share of the step's memory-bound floor. Fused, a layer is 9
kernels: add+RMSNorm, QKV GEMM, q/k-norm+RoPE+KV-write, attention, o GEMM, add+RMSNorm,
gate/up GEMM, SiLU*up, down GEMM.

Every op has one torch definition (`TorchOps`, the reference and the CPU path) and,
where it pays, a Triton kernel (`TritonOps`) that rounds the way the torch one does
(fp32 statistics, a cast to the activation dtype where torch casts), so the two agree
to rounding; `self_check` verifies that on the device before the kernels are used and
falls back to torch per op if one fails to compile or disagrees.

Attention reads the slot KV cache in place (the slot and each query's visible length
come from device tensors): no gather of [B, KV, S, D] per layer, and no context-length
bucket is needed, since the loop bound is read on the device. Each query row is
computed by the same program shape with keys visited in fixed blocks from position 0,
so a row's result does not depend on how many other rows share the launch (fully
masked key blocks add exact zeros): the basis of the batch-invariant mode.

Shapes: M = B * L flattened tokens, E hidden, H / KV heads, D head_dim, I intermediate,
T = cache positions per slot (max_seq_len + 1 scratch position, see qwen3.KVCache).
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("flashmap.target.kernels")


# ----------------------------------------------------------------------------- torch reference


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


# ----------------------------------------------------------------------------- Triton kernels

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
        # views with stride 0 (an H200 run wrote out of bounds through one).
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


# ----------------------------------------------------------------------------- selection and self-check


def select_ops(device: torch.device, use_triton: bool | None = None) -> TorchOps:
    """TritonOps on CUDA when Triton imports (FLASHMAP_TRITON=0 turns it off), else TorchOps.
    use_triton=True forces the kernels (a CPU test under TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = device.type == "cuda" and os.environ.get("FLASHMAP_TRITON", "1") != "0"
    if use_triton and triton_available():
        return TritonOps()
    return TorchOps()


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.inference_mode()
def self_check(
    ops: TorchOps,
    *,
    dtype: torch.dtype,
    device: torch.device,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    hidden: int,
    intermediate: int,
    tol: float | None = None,
    seed: int = 0,
) -> dict:
    """Run every Triton op against TorchOps on random inputs of the model's shapes (a batch of
    3 rows x 5 tokens at mixed positions and padding); disable any op that raises
    or differs by more than tol (relative to the largest reference entry; attention also on a
    150-token prefill row, several query blocks). Returns
    {op: max relative error or an error string}; ops.enabled shrinks to the ops that passed."""
    if not isinstance(ops, TritonOps):
        return {}
    # bf16: a few ulps of the largest entry (2^-7 each); an indexing error is O(1).
    tol = tol if tol is not None else (1e-5 if dtype == torch.float32 else 5e-2)
    ref = TorchOps()
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    report: dict = {}
    D, T, n_slots = head_dim, 160, 4
    for op in TritonOps.ALL:
        try:
            if op == "rms_norm":
                x, r, w = rnd(7, hidden), rnd(7, hidden), rnd(hidden)
                err = max(
                    _rel(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)),
                    *(
                        _rel(a, b)
                        for a, b in zip(
                            ops.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)
                        )
                    ),
                )
            elif op == "silu_mul":
                gu = rnd(7, 2 * intermediate)
                err = _rel(ops.silu_mul(gu), ref.silu_mul(gu))
            else:
                cos, sin = (torch.randn(T, D, generator=g).to(device) for _ in range(2))
                B, L = 3, 5
                pos = torch.tensor(
                    [[7, 8, 9, 10, 11], [0, 1, 2, 3, 4], [100, 101, 102, 0, 0]], device=device
                )
                valid = torch.tensor([[1] * 5, [1] * 5, [1, 1, 1, 0, 0]], device=device).bool()
                slots = torch.tensor([2, 0, 3], device=device)
                wslot = slots[:, None].expand(B, L).reshape(-1)
                wpos = torch.where(valid, pos, T - 1).reshape(-1)  # padding -> the scratch position
                qkv = rnd(B * L, (n_heads + 2 * n_kv) * D)
                qw, kw = rnd(D), rnd(D)
                cache = [rnd(n_slots, n_kv, T, D) for _ in range(2)]
                if op == "qk_norm_rope_write":
                    outs = []
                    for o in (ops, ref):
                        ck, cv = (c.clone() for c in cache)
                        q = o.qk_norm_rope_write(
                            qkv,
                            qw,
                            kw,
                            1e-6,
                            cos,
                            sin,
                            pos.reshape(-1),
                            ck,
                            cv,
                            wslot,
                            wpos,
                            n_heads,
                            n_kv,
                        )
                        outs.append(
                            (q, ck[:, :, : T - 1], cv[:, :, : T - 1])
                        )  # the scratch holds any padding
                else:
                    ck, cv = cache
                    q = ref.qk_norm_rope_write(
                        qkv,
                        qw,
                        kw,
                        1e-6,
                        cos,
                        sin,
                        pos.reshape(-1),
                        ck,
                        cv,
                        wslot,
                        wpos,
                        n_heads,
                        n_kv,
                    ).view(B, L, n_heads, D)
                    lim = torch.where(valid, pos, 0)
                    outs = [(o.attention(q, ck, cv, slots, lim, T - 1),) for o in (ops, ref)]
                    # A prefill-sized row: several query blocks per (row, KV head), keys past 128.
                    qp = rnd(1, 150, n_heads, D)
                    lim = torch.arange(150, device=device)[None]
                    outs = [
                        a + (o.attention(qp, ck, cv, slots[:1], lim, T - 1),)
                        for a, o in zip(outs, (ops, ref))
                    ]
                err = max(_rel(a, b) for a, b in zip(*outs))
            ok = err <= tol
            report[op] = err
        except Exception as e:  # noqa: BLE001 - a kernel that does not build is switched off, not fatal
            report[op], ok = f"{type(e).__name__}: {e}"[:300], False
        if not ok:
            ops.enabled.discard(op)
            log.warning("Triton op %s disabled (self-check: %s)", op, report[op])
    return report
