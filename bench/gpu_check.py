"""One-call GPU check (H200): exactness on CUDA, and the costs that set FlashMap's speedup.

1. Exactness on the GPU: tiny random target, speculative (untrained drafter, CUDA graphs)
   vs autoregressive at temperature 0, fp32 and bf16 (bf16 mismatches are counted: a
   (K+1)-row verify and a one-row step may round differently: DESIGN.md).
2. Drafter at the paper's size (dim 2048, 6 blocks, 16 heads, V=151,936, Qwen3-8B
   features), bf16, random weights: graph capture time and memory; draft latency per
   batch size for 1 and 2 jumps, eager vs CUDA graph.
3. Target at Qwen3-8B size (36 layers, hidden 4096, GQA 32/8, V=151,936), bf16, random
   weights, our engine: verify latency of [anchor + 16 drafts] vs a one-token step at
   context 512, per batch size. Projected speedup for a mean acceptance length gamma:
   gamma * t_step / (t_verify + t_draft).

  python bench/gpu_check.py --out DIR        (on the GPU machine)
  python bench/gpu_check.py --smoke          (tiny sizes on CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from drafter_service.config import DrafterConfig  # noqa: E402
from drafter_service.flashmap_dit import FlashMapDiT  # noqa: E402
from drafter_service.flashmap_proposer import FlashMapProposer  # noqa: E402
from flashmap.types import ProposeRequest  # noqa: E402
from drafter_service.factory import load_proposer  # noqa: E402
from flashmap.inprocess import decode  # noqa: E402
from flashmap.types import SamplingParams, VerifyRow  # noqa: E402
from flashmap.types import GenerationRequest  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from target_service.qwen3 import Qwen3, Qwen3Config  # noqa: E402
from target_service.random_checkpoint import make_random_qwen3  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960, eos_token_id=[151645])


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int) -> float:
    """Median seconds of fn() over reps, after one warm-up."""
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def exactness(dev, dtype, n_prompts: int, max_new: int) -> dict:
    path = make_random_qwen3(Path(tempfile.mkdtemp()) / "t", with_tokenizer=False, num_hidden_layers=4)
    engine = TargetEngine(path, n_slots=n_prompts, device=str(dev), dtype=dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.vocab_size, int(rng.integers(4, 24))).tolist() for _ in range(n_prompts)]
    reqs = lambda: [GenerationRequest(p, max_new) for p in prompts]  # noqa: E731
    ar = decode(engine, reqs())
    out = {}
    for steps in (1, 2):
        prop = load_proposer("init", str(path), device=str(dev), n_slots=n_prompts, max_context=engine.max_seq_len, steps=steps)
        if dev.type == "cuda":
            out[f"graph_capture_steps{steps}"] = prop.enable_graphs(steps=(steps,), batch_buckets=(n_prompts,))
        sp = decode(engine, reqs(), prop, steps)
        same = sum(a.token_ids == b.token_ids for a, b in zip(ar, sp))
        out[f"identical_sequences_steps{steps}"] = f"{same}/{n_prompts}"
    return out


def drafter_costs(dev, big: bool, batches, reps: int, ctx: int) -> dict:
    V, H, layers = (151936, 4096, [1, 9, 17, 25, 33]) if big else (512, 64, [1])
    arch = dict(dim=2048, n_blocks=6, n_heads=16) if big else dict(dim=64, n_blocks=2, n_heads=4)
    cfg = DrafterConfig(vocab_size=V, target_hidden_size=H, target_num_layers=36 if big else 4, feature_layers=layers, **arch)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        embed = torch.randn(V, H, dtype=dtype) * 0.02
        model = FlashMapDiT(cfg, embed, embed).to(dtype)
    params = sum(p.numel() for p in model.parameters())
    n = max(batches)
    prop = FlashMapProposer(model, n_slots=n, max_context=ctx, device=str(dev))
    rng = np.random.default_rng(0)
    for i in range(n):
        prop.extend(f"s{i}", rng.integers(0, V, ctx // 2), rng.standard_normal((ctx // 2, cfg.feature_dim), np.float32))
    res = {"params": params, "context": ctx // 2, "latency_ms": {}}
    for mode in ("eager", "graph"):
        if mode == "graph":
            if dev.type != "cuda":
                break
            res["capture"] = prop.enable_graphs(steps=(1, 2), batch_buckets=tuple(batches), context_buckets=(ctx,))
        for steps in (1, 2):
            for b in batches:
                reqs = [ProposeRequest(f"s{i}", anchor=i, seed=i) for i in range(b)]
                res["latency_ms"][f"{mode} steps={steps} batch={b}"] = 1e3 * timed(lambda: prop.propose(reqs, steps), dev, reps)
    return res


def target_costs(dev, big: bool, batches, reps: int, ctx: int, k: int = 16) -> dict:
    cfg = Qwen3Config.from_dict(QWEN3_8B if big else dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=4, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=16))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = Qwen3(cfg).to(dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    n = max(batches)
    engine = TargetEngine.from_model(model, n_slots=n, max_seq_len=ctx + 2 * k)
    rng = np.random.default_rng(0)
    g = SamplingParams()
    for s in range(n):
        assert engine.allocate() == s
        engine.verify([VerifyRow(s, 0, rng.integers(0, cfg.vocab_size, ctx).astype(np.int64), g)])
    res = {"layers": cfg.num_hidden_layers, "context": ctx, "latency_ms": {}}
    if dev.type == "cuda":  # where a one-token step spends its time (top ops by CUDA time)
        row = [VerifyRow(0, ctx, rng.integers(0, cfg.vocab_size, 1).astype(np.int64), g)]
        engine.verify(row)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.verify(row)
            sync(dev)
        res["profile_step_batch1"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    for b in batches:
        for name, L, stats_params in (("step (1 token)", 1, g), (f"verify ({k + 1} tokens, T=0)", k + 1, g),
                                      (f"verify ({k + 1} tokens, T=1, |S|=4)", k + 1, SamplingParams(1.0))):
            sup = np.zeros((L - 1, 4 if stats_params.temperature else 1), np.int64) if L > 1 else np.zeros((0, 1), np.int64)
            rows = [VerifyRow(s, ctx, rng.integers(0, cfg.vocab_size, L).astype(np.int64), stats_params,
                              sup + np.arange(sup.shape[1]), 1) for s in range(b)]
            res["latency_ms"][f"{name} batch={b}"] = 1e3 * timed(lambda: engine.verify(rows), dev, reps)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    big = not a.smoke
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__}
    t0 = time.perf_counter()
    for name, fn in (
        ("exactness_fp32", lambda: exactness(dev, torch.float32, 8, 32)),
        ("exactness_bf16", lambda: exactness(dev, torch.bfloat16, 8, 32)),
        ("drafter", lambda: drafter_costs(dev, big, (1, 4, 16), 10 if big else 2, 1024 if big else 64)),
        ("target", lambda: target_costs(dev, big, (1, 4, 16), 10 if big else 2, 512 if big else 32)),
    ):
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{time.perf_counter() - t0:.0f}s] {name}: {json.dumps(report[name])}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if "latency_ms" in report.get("drafter", {}) and "latency_ms" in report.get("target", {}):
        d, t = report["drafter"]["latency_ms"], report["target"]["latency_ms"]
        proj = {}
        for b in (1, 4, 16):
            step = t[f"step (1 token) batch={b}"]
            ver = t[f"verify (17 tokens, T=0) batch={b}"]
            for steps in (1, 2):
                dr = d.get(f"graph steps={steps} batch={b}", d[f"eager steps={steps} batch={b}"])
                for gamma in (3.0, 4.0, 5.0, 6.0):
                    proj[f"batch={b} steps={steps} gamma={gamma}"] = round(gamma * step / (ver + dr), 2)
        report["projected_speedup"] = proj
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
