"""Which implementation of the Qwen3 step's non-GEMM ops runs, and the check that it may.

`select_ops` gives the fused Triton kernels (target_service.triton_ops) on CUDA when Triton
imports, plain torch (target_service.torch_ops) otherwise. `self_check` runs every Triton op
against its torch definition on the device, at the model's shapes, before the kernels are
used, and falls back to torch per op if one fails to compile or disagrees.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from target_service.torch_ops import TorchOps
from target_service.triton_ops import TritonOps, triton_available

log = logging.getLogger("flashmap.target.kernels")


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
