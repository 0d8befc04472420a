"""The GPU check's training section (`python -m bench.gpu --only training`): memory and time of
one training step of the paper-size FlashMap drafter (dim 2048, 6 blocks, 16 heads, K = 16)
with a Qwen3-8B-shape target (random bf16 weights) computing the batch's features online,
as training.train_drafter runs it on token data.

A step: the target's verify pass over the step's sequences (one prefill row each, features of
every position, TargetEngine.verify as training.online_features calls it), then the flow
stage's loss on 8 anchors per sequence (noisy one-hot blocks x_t = (1-t) eps + t onehot, the
DiT's clean-block logits, cross-entropy; what training.flow.flow_loss computes, minus the
slot weights and the tau map, which cost nothing) forward and backward under bf16 autocast,
and an AdamW step on fp32 weights. The drafter's frozen embedding / LM head are the target's
tensors. Measured at this project's default batch on one GPU (256 blocks = 32 sequences of 8
anchors; the paper gives no batch size) and at the per-GPU share of 8 GPUs (32 blocks = 4
sequences); sequences of --train-len tokens.

The 8-GPU step is estimated from the per-GPU share: its time plus a ring all-reduce of the
fp32 gradients at an assumed NVLink bus bandwidth (ALLREDUCE_GBPS). Bench code never imports
training/: the loss is written out here.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.gpu_drafter import build_drafter
from bench.gpu_target import QWEN3_8B, TINY_TARGET, random_qwen3
from bench.gpu_timing import Guard, K, say, sync

ANCHORS_PER_SEQ = 8
ALLREDUCE_GBPS = 300.0  # assumed all-reduce bus bandwidth of 8 H200s over NVLink (an estimate)
PAPER_STEPS = {"flow": 39_000, "distill": 23_000}


def _flow_step(model, opt, features, tokens, lengths, gen, amp: bool):
    """One flow-stage step on features [S, T, F] (bf16) and tokens [S, T + K + 1]: 8 anchors per
    sequence at the given lengths (the anchor positions), loss, backward, AdamW."""
    V, dev = model.cfg.vocab_size, features.device
    S = features.shape[0]
    seq = torch.arange(S, device=dev).repeat_interleave(ANCHORS_PER_SEQ)  # [N]
    anchor_pos = lengths  # [N]
    anchor = tokens[seq, anchor_pos]
    target = tokens[seq[:, None], anchor_pos[:, None] + 1 + torch.arange(K, device=dev)]  # [N, K]
    N = len(seq)
    t = torch.rand(N, generator=gen, device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
        full = torch.full((S,), features.shape[1], device=dev)
        ctx = model.context(features, full).select(seq, anchor_pos)
        x = (1 - t).view(N, 1, 1) * torch.randn(N, K, V, generator=gen, device=dev)
        x = x.scatter_add_(-1, target[..., None], t.view(N, 1, 1).expand(N, K, 1).contiguous())
        logits = model(x, t, t, anchor, ctx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _timed(fn, dev, reps: int) -> float:
    """Median seconds of fn() over reps after one warm-up call."""
    fn()
    sync(dev)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def training_section(dev, smoke: bool, guard: Guard, train_len: int = 2048) -> dict:
    from flashmap.types import SamplingParams, VerifyRow
    from target_service.engine import TargetEngine

    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    L = train_len if not smoke else 48
    configs = {"1 GPU, batch 256": 32, "8 GPUs, per GPU 32": 4} if not smoke else {"smoke": 2}
    reps = 3 if not smoke else 1
    target = random_qwen3(QWEN3_8B if not smoke else TINY_TARGET, dev, dtype).requires_grad_(False)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    drafter = build_drafter(
        dev,
        torch.float32,  # fp32 master weights; the step runs under bf16 autocast
        smoke,
        embed=target.model.embed_tokens.weight.detach(),
        lm_head=target.lm_head.weight.detach(),
        feature_layers=[1, 9, 17, 25, 33] if not smoke else [1],
        target_num_layers=target.config.num_hidden_layers,
    ).train()
    params = sum(p.numel() for p in drafter.parameters())
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=cuda)
    res: dict = {
        "train_len": L,
        "drafter_params": params,
        "target_weight_GB": round(
            sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9, 2
        ),
        "configs": {},
    }
    say(f"  training: drafter {params / 1e6:.0f}M params, sequences of {L} tokens")
    V = target.config.vocab_size
    gen = torch.Generator(device=dev).manual_seed(0)
    rng = np.random.default_rng(0)
    for name, S in configs.items():
        if not guard.fits(40 if not smoke else 1):
            res["configs"][name] = {"error": "skipped: time guard"}
            continue
        engine = TargetEngine.from_model(
            target, n_slots=S, max_seq_len=L + K + 2, features_dtype=dtype
        )
        tokens = torch.as_tensor(rng.integers(0, V, (S, L + K + 1)), device=dev)
        lengths = torch.as_tensor(
            np.sort(rng.integers(L // 2, L, (S, ANCHORS_PER_SEQ)), 1).reshape(-1), device=dev
        )
        feats = {}

        def features():
            slots = [engine.allocate() for _ in range(S)]
            try:
                rows = [
                    VerifyRow(s, 0, tokens[i, :L].cpu().numpy(), SamplingParams())
                    for i, s in enumerate(slots)
                ]
                out = engine.verify(rows, features_on_device=True)
            finally:
                for s in slots:
                    engine.release(s)
            feats["x"] = torch.stack([r.features for r in out])  # [S, L, F]

        def step():
            _flow_step(drafter, opt, feats["x"], tokens, lengths, gen, cuda)

        def forward_only():
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                full = torch.full((S,), L, device=dev)
                seq = torch.arange(S, device=dev).repeat_interleave(ANCHORS_PER_SEQ)
                ctx = drafter.context(feats["x"], full).select(seq, lengths)
                x = torch.randn(len(seq), K, V, generator=gen, device=dev)
                drafter(x, 0.5, 0.5, tokens[seq, lengths], ctx)

        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            t_feat = _timed(features, dev, reps)
            t_step = _timed(step, dev, reps)
            t_fwd = _timed(forward_only, dev, reps)
            row = {
                "sequences": S,
                "blocks": S * ANCHORS_PER_SEQ,
                "target_features_ms": round(1e3 * t_feat, 1),
                "drafter_step_ms": round(1e3 * t_step, 1),
                "drafter_forward_ms": round(1e3 * t_fwd, 1),
                "flow_step_ms": round(1e3 * (t_feat + t_step), 1),
                # distillation: the student's step plus about two forward passes of the
                # teacher / EMA (zero-length rows: the teacher; the others: two EMA jumps)
                "distill_step_ms_est": round(1e3 * (t_feat + t_step + 2 * t_fwd), 1),
            }
            if cuda:
                row["peak_GB"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 1)
            res["configs"][name] = row
            say(f"  training {name}: {row}")
        except torch.OutOfMemoryError as e:  # noqa: PERF203
            res["configs"][name] = {"error": f"out of memory: {str(e)[:200]}"}
            say(f"  training {name}: out of memory")
        finally:
            engine = feats = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    res["estimate"] = estimate(res)
    return res


def estimate(res: dict) -> dict:
    """Per-step times of 1 and 8 GPUs and the paper's 39K + 23K steps, from the measured rows."""
    out = {}
    c1 = res["configs"].get("1 GPU, batch 256", {})
    c8 = res["configs"].get("8 GPUs, per GPU 32", {})
    # ring all-reduce of fp32 gradients: 2 (n - 1) / n x bytes over the bus bandwidth
    ar_s = 2 * 7 / 8 * 4 * res["drafter_params"] / (ALLREDUCE_GBPS * 1e9)
    for label, row, extra in (("1 GPU", c1, 0.0), ("8 GPUs", c8, ar_s)):
        if "flow_step_ms" not in row:
            continue
        flow = row["flow_step_ms"] / 1e3 + extra
        distill = row["distill_step_ms_est"] / 1e3 + extra
        hours = (PAPER_STEPS["flow"] * flow + PAPER_STEPS["distill"] * distill) / 3600
        out[label] = {
            "flow_step_s": round(flow, 3),
            "distill_step_s": round(distill, 3),
            "paper_steps_hours": round(hours, 1),
        }
    out["allreduce_ms_assumed"] = round(1e3 * ar_s, 1)
    return out


def training_summary(report: dict) -> list[str]:
    tr = report.get("training")
    if not tr:
        return []
    if "error" in tr:
        return [f"training: ERROR {tr['error'][:120]}"]
    lines = [
        f"training step, paper drafter ({tr['drafter_params'] / 1e6:.0f}M) + 8B target online, "
        f"sequences of {tr['train_len']} tokens:"
    ]
    for name, row in tr["configs"].items():
        lines.append(f"  {name}: {row}")
    for label, e in tr.get("estimate", {}).items():
        lines.append(f"  estimate {label}: {e}")
    return lines
