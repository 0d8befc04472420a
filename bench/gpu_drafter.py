"""The GPU check's drafter section: the paper-size FlashMap drafter (dim 2048, 6 blocks, 16
heads) in bf16 with noise drawn on the device: 1 and 2 jumps at batch 1, 4 and 16, eager and
from CUDA graphs, and whether a draft is the same alone and in a batch."""

from __future__ import annotations

import gc

import numpy as np
import torch

from bench.gpu_timing import BATCHES, Guard, K, say, timed

PAPER_DRAFTER = dict(dim=2048, n_blocks=6, n_heads=16)  # the paper's (DrafterConfig's defaults)
TINY_DRAFTER = dict(dim=64, n_blocks=2, n_heads=4)  # --smoke


def build_drafter(
    dev,
    dtype,
    smoke: bool,
    embed=None,
    lm_head=None,
    feature_layers=None,
    target_num_layers: int | None = None,
):
    """A FlashMap drafter with random weights, built on dev in dtype: the paper's size (tiny with
    smoke) over a target's frozen embedding / LM head [V, H] (shared, not copied; random
    N(0, 0.02) of the Qwen3-8B shape, or of the tiny target's with smoke, when None). Its
    embedded time map is measured on E's device as it is built."""
    from drafter_service.config import DrafterConfig
    from drafter_service.flashmap_dit import FlashMapDiT

    if embed is None:
        V, H = (512, 64) if smoke else (151936, 4096)
        embed = torch.randn(V, H, dtype=dtype, device=dev) * 0.02
        feature_layers, target_num_layers = ([1], 4) if smoke else ([1, 9, 17, 25, 33], 36)
    cfg = DrafterConfig(
        vocab_size=embed.shape[0],
        target_hidden_size=embed.shape[1],
        target_num_layers=target_num_layers,
        feature_layers=list(feature_layers),
        **(TINY_DRAFTER if smoke else PAPER_DRAFTER),
    )
    with torch.device(dev):
        return FlashMapDiT(cfg, embed, embed if lm_head is None else lm_head).to(dtype)


def drafter_section(dev, smoke: bool, guard: Guard) -> dict:
    from drafter_service.flashmap_proposer import FlashMapProposer, draw_noise, request_generator
    from flashmap.drafts import ProposeRequest

    big = not smoke
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ctx = 1024 if big else 64
    reps = 20 if big else 2
    model = build_drafter(dev, dtype, smoke)
    cfg, V, H = model.cfg, model.cfg.vocab_size, model.cfg.target_hidden_size
    n = max(BATCHES)
    prop = FlashMapProposer(model, n_slots=n, max_context=ctx, device=str(dev))
    rng = np.random.default_rng(0)
    for i in range(n):
        prop.extend(
            f"s{i}",
            rng.integers(0, V, ctx // 2),
            rng.standard_normal((ctx // 2, cfg.feature_dim), np.float32),
        )
    res = {
        "params": sum(p.numel() for p in model.parameters()),
        "context": ctx // 2,
        "latency": {},
        "noise_on_device": not prop._host_noise,
    }
    # The noise alone: 16 per-request draws on the device.
    gens = lambda: [request_generator(i, 0, prop.device) for i in range(n)]  # noqa: E731
    r = min(V, H)
    res["noise_draw_b16"] = timed(
        lambda: torch.stack([draw_noise(g, K, r)[0] for g in gens()]), dev, 10
    )
    for mode in ("eager", "graph"):
        if mode == "graph":
            if dev.type != "cuda":
                break
            res["capture"] = prop.enable_graphs(
                steps=(1, 2), batch_buckets=tuple(BATCHES), context_buckets=(ctx,)
            )
        for steps in (1, 2):
            for b in BATCHES:
                if not guard.fits(15):
                    say("  time guard: drafter stops")
                    return res
                seeds = iter(range(10**9))
                reqs = lambda: [
                    ProposeRequest(f"s{i}", anchor=int(rng.integers(V)), seed=next(seeds))  # noqa: E731
                    for i in range(b)
                ]
                t = timed(
                    lambda: prop.propose(reqs(), steps),
                    dev,
                    reps if mode == "graph" else max(3, reps // 2),
                )
                res["latency"][f"{mode} steps={steps} b={b}"] = t
                say(f"  drafter {mode} steps={steps} b={b}: {t}")
    # Reproducible per seed on this device, and independent of the batch it is drafted in.
    one = prop.propose([ProposeRequest("s3", anchor=7, seed=99)], 1)[0].tokens
    again = prop.propose(
        [ProposeRequest(f"s{i}", anchor=7, seed=99 if i == 3 else i) for i in range(n)], 1
    )[3].tokens
    # (bf16 with graphs: batch 1 and 16 run different shapes, so rounding may still change a token)
    res["same_draft_alone_and_in_batch16"] = bool(np.array_equal(one, again))
    prop = model = None  # freed before the next section
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res
