"""One-call GPU check (H200): exactness on CUDA, and the costs that set FlashMap's speedup.

  python3 bench/gpu_check.py --out DIR     (on the GPU machine; ~3-4 minutes, guarded at --budget s)
  python3 bench/gpu_check.py --smoke       (tiny shapes on the CPU, a few seconds: the script's own test)

Sections (each in its own try/except, so one failure keeps the others' numbers; skipped
when the time guard says they would not fit):
  env          device, versions, SM count
  ceilings     device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate,
               on random data (METHOD.md)
  exactness    tiny random Qwen3 (4 layers), fp32 and bf16: CUDA-graph engine == eager engine on
               mixed batches (prefill beside verify rows, rollback, slot reuse, sampling rows);
               speculative == autoregressive at T=0 (untrained FlashMap drafter, its CUDA graphs);
               batch-invariant mode: a 17-token verify and 17 one-token steps bit-identical, and
               speculative == autoregressive token for token
  target       Qwen3-8B shape (36 layers, hidden 4096, GQA 32/8, head_dim 128, intermediate 12288,
               V = 151,936), random bf16 weights, context 512: memory floor (weight bytes / copy
               bandwidth); step (1 token) and verify (17 tokens) at batch 1/4/16, eager and CUDA
               graphs, end to end (engine.verify, host clock) and replay only (CUDA events); the
               GEMMs alone in a graph; each fused op x 36 layers
  drafter      paper size (dim 2048, 6 blocks, 16 heads), bf16, noise on the device: 1 and 2 jumps
               at batch 1/4/16, eager and CUDA graphs
  projection   speedup gamma * t_step / (t_verify + t_draft) for gamma = 3..6

Full numbers go to DIR/gpu_check.json (rewritten after every section) and the log to
DIR/gpu_check.log; a short table with the acceptance checks is printed LAST.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
    eos_token_id=[151645],
)
TINY_TARGET = dict(
    QWEN3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
BATCHES = (1, 4, 16)
K = 16  # drafted tokens per block: a verify is K + 1 = 17 tokens

T0 = time.perf_counter()
LOG: list[str] = []
SMOKE = False  # --smoke: one warm-up, one or two repetitions


def say(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


class Guard:
    """The global time guard: sections that would not fit in what is left are skipped."""

    def __init__(self, budget_s: float):
        self.deadline = T0 + budget_s

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, need_s: float) -> bool:
        return self.left() > need_s


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int, warmup: int = 2, guard: Guard | None = None) -> dict:
    """Median / min of fn() over reps after warm-up: host wall clock (fn's own synchronisation
    included, then a device sync) and, on CUDA, device time between events around fn."""
    if SMOKE:
        warmup, reps = 1, min(reps, 2)
    for _ in range(warmup):
        fn()
    sync(dev)
    wall, device = [], []
    for i in range(reps):
        if guard is not None and i >= 3 and not guard.fits(5):
            break
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            wall.append(time.perf_counter() - t)
            device.append(e0.elapsed_time(e1) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t)
    out = {
        "ms": round(1e3 * float(np.median(wall)), 4),
        "min_ms": round(1e3 * float(np.min(wall)), 4),
        "n": len(wall),
    }
    if device:
        out["device_ms"] = round(1e3 * float(np.median(device)), 4)
    return out


def graph_time(fn, dev, reps: int = 20) -> dict:
    """Capture fn in a CUDA graph (after warm-up) and time its replays with events: the GPU
    time of the work with launch gaps at their smallest. CPU: fn timed eagerly."""
    if dev.type != "cuda":
        return timed(fn, dev, max(2, reps // 10))
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    r = timed(g.replay, dev, reps)
    del g
    return {"ms": r["device_ms"], "wall_ms": r["ms"]}


# ----------------------------------------------------------------------------- sections


def env_section(dev) -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(dev)}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        out["triton"] = f"unavailable ({type(e).__name__})"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(
            name=p.name,
            sms=p.multi_processor_count,
            memory_gb=round(p.total_memory / 1e9, 1),
            capability=f"{p.major}.{p.minor}",
        )
    return out


def ceilings_section(dev, smoke: bool) -> dict:
    n = (1 << 30) if not smoke else (1 << 20)  # bytes per buffer
    bufs = [torch.randn(n // 2, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    state = {"i": 0}

    def copy():  # rotate among two (src, dst) pairs so nothing is served from L2
        i = state["i"] = (state["i"] + 1) % 2
        bufs[2 * i + 1].copy_(bufs[2 * i])

    t = timed(copy, dev, 10 if not smoke else 3)
    sec = t.get("device_ms", t["ms"]) / 1e3
    out = {
        "copy_bytes": 2 * n,
        "copy_ms": round(1e3 * sec, 4),
        "copy_GBps": round(2 * n / sec / 1e9, 1),
    }
    del bufs
    m = 8192 if not smoke else 256
    a, b = (torch.randn(m, m, device=dev, dtype=torch.bfloat16) for _ in range(2))
    t = timed(lambda: a @ b, dev, 10 if not smoke else 3)
    sec = t.get("device_ms", t["ms"]) / 1e3
    out.update(
        matmul_n=m, matmul_ms=round(1e3 * sec, 4), matmul_TFLOPs=round(2 * m**3 / sec / 1e12, 1)
    )
    return out


def _rows_script(eng, rng_seed: int = 0):
    """A serving-like sequence of batches (tests/test_target_graphs.script, sized by the engine)."""
    from flashmap.types import SamplingParams, VerifyRow

    V = eng.vocab_size
    rng = np.random.default_rng(rng_seed)
    t = lambda n: rng.integers(0, V, n)  # noqa: E731
    G, S = SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    sup = lambda tok, k, w=1: (np.asarray(tok)[len(tok) - k :, None] + np.arange(w)) % V  # noqa: E731
    out = []
    for _ in range(3):
        eng.allocate()
    out += eng.verify([VerifyRow(0, 0, t(30), G), VerifyRow(1, 0, t(19), G)])
    a, b, c = t(6), t(1), t(3)
    out += eng.verify(
        [
            VerifyRow(0, 30, a, G, sup(a, 5)),
            VerifyRow(1, 19, b, G),
            VerifyRow(2, 0, c, S, sup(c, 2, 3), 11),
        ]
    )
    a, b = t(17), t(1)
    out += eng.verify([VerifyRow(0, 32, a, S, sup(a, 16, 2), 12), VerifyRow(2, 3, b, G)])
    eng.release(1)
    eng.allocate()
    a, b, c = t(5), t(2), t(1)
    out += eng.verify(
        [VerifyRow(1, 0, a, G, sup(a, 4)), VerifyRow(2, 4, b, G, sup(b, 1)), VerifyRow(0, 49, c, G)]
    )
    return out


def tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 4-layer random Qwen3 checkpoint directory (HF layout) written without transformers
    (its import alone costs ~10 s): weights N(0, 2.5 / sqrt(hidden)) so logits are peaked and
    top-2 gaps far above rounding (target_service.random_checkpoint), norm gains around 1."""
    from safetensors.torch import save_file

    from target_service.random_checkpoint import default_init_std

    model = _random_qwen3(
        TINY_TARGET,
        torch.device("cpu"),
        torch.float32,
        default_init_std(TINY_TARGET["hidden_size"]),
        seed,
    )
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        TINY_TARGET,
        eos_token_id=[TINY_TARGET["vocab_size"] - 1],
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        torch_dtype="float32",
    )
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(
        {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
        str(path / "model.safetensors"),
    )
    return path


def exactness_section(dev, dtype, smoke: bool, guard: Guard) -> dict:
    from drafter_service.factory import load_proposer
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest, SamplingParams, VerifyRow
    from target_service.engine import TargetEngine

    mode = "cuda" if dev.type == "cuda" else "static"
    path = tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny-qwen3")
    n_prompts, max_new = (8, 32) if not smoke else (2, 5)
    res: dict = {}

    n_slots = max(4, n_prompts)

    def engine(graphs: bool, **kw):
        e = TargetEngine(path, n_slots=n_slots, max_seq_len=128, device=str(dev), dtype=dtype)
        if graphs:
            e.enable_graphs(
                mode=mode,
                **({"batch_buckets": (1, 2, 4, 8), "query_buckets": (1, 2, 4, 8, 17)} | kw),
            )
        return e

    eager, graph = engine(False), engine(True)
    res["ops"] = graph.model.ops.describe()
    res["kernel_check"] = graph.kernel_check
    # 1. graph == eager on mixed batches
    a, b = _rows_script(graph), _rows_script(eager)
    res["graph_vs_eager"] = {
        "argmax_equal": f"{sum(np.array_equal(x.argmax, y.argmax) for x, y in zip(a, b))}/{len(b)}",
        "features_max_rel_err": max(
            float(np.abs(x.features - y.features).max() / np.abs(y.features).max())
            for x, y in zip(a, b)
        ),
        "support_probs_max_abs_err": max(
            [
                float(np.abs(x.support_probs - y.support_probs).max())
                for x, y in zip(a, b)
                if y.support_probs.size
            ]
            + [0.0]
        ),
        "residual_equal": f"{sum(np.array_equal(x.residual, y.residual) for x, y in zip(a, b))}/{len(b)}",
    }
    say(f"  {dtype}: graph vs eager {res['graph_vs_eager']}")
    # 2. speculative == autoregressive at T = 0, graphs on (target and drafter)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, int(rng.integers(4, 24))).tolist() for _ in range(n_prompts)]
    reqs = lambda: [GenerationRequest(p, max_new) for p in prompts]  # noqa: E731
    eng = engine(True)
    ar = decode(eng, reqs())
    ar_eager = decode(engine(False), reqs())
    res["autoregressive_graph_vs_eager"] = (
        f"{sum(x.token_ids == y.token_ids for x, y in zip(ar, ar_eager))}/{n_prompts}"
    )
    for steps in (1, 2) if not smoke else (1,):
        if not guard.fits(30):
            break
        prop = load_proposer(
            "init", str(path), device=str(dev), n_slots=n_prompts, max_context=128, steps=steps
        )
        if dev.type == "cuda":
            prop.enable_graphs(steps=(steps,), batch_buckets=(n_prompts,))
        sp = decode(eng, reqs(), prop, steps)
        res[f"speculative_eq_autoregressive_steps{steps}"] = (
            f"{sum(x.token_ids == y.token_ids for x, y in zip(ar, sp))}/{n_prompts}"
        )
        res[f"drafts_steps{steps}"] = sum(r.stats.drafts for r in sp)
    say(
        f"  {dtype}: speculative vs autoregressive {[v for k, v in res.items() if k.startswith('spec')]}"
    )
    # 3. batch-invariant mode
    inv = engine(True, batch_invariant=True, batch_buckets=(n_slots,), query_buckets=(17,))
    G = SamplingParams()
    p, cont = rng.integers(0, 512, 12), rng.integers(0, 512, 17)
    s0, s1 = inv.allocate(), inv.allocate()
    inv.verify([VerifyRow(s0, 0, p, G), VerifyRow(s1, 0, p, G)])
    spec = inv.verify([VerifyRow(s0, 12, cont, G, cont[1:, None])])[0]
    steps_ = [inv.verify([VerifyRow(s1, 12 + i, cont[i : i + 1], G)])[0] for i in range(17)]
    inv.release(s0)
    inv.release(s1)
    feats = np.concatenate([s.features for s in steps_])
    res["invariant_verify17_vs_17_steps"] = {
        "features_bitwise_equal": bool(np.array_equal(spec.features, feats)),
        "max_abs_diff": float(np.abs(spec.features - feats).max()),
        "argmax_equal": spec.argmax.tolist() == [int(s.argmax[0]) for s in steps_],
    }
    ar_inv = decode(inv, reqs())
    prop = load_proposer(
        "init", str(path), device=str(dev), n_slots=n_prompts, max_context=128, steps=1
    )
    sp_inv = decode(inv, reqs(), prop, 1)
    res["invariant_speculative_eq_autoregressive"] = (
        f"{sum(x.token_ids == y.token_ids for x, y in zip(ar_inv, sp_inv))}/{n_prompts}"
    )
    say(
        f"  {dtype}: invariant {res['invariant_verify17_vs_17_steps']} spec==AR {res['invariant_speculative_eq_autoregressive']}"
    )
    return res


def _random_qwen3(cfg_dict: dict, dev, dtype, std: float = 0.02, seed: int = 0):
    from target_service.qwen3 import Qwen3, Qwen3Config

    cfg = Qwen3Config.from_dict(cfg_dict)
    with torch.device("meta"):
        model = Qwen3(cfg)
    model = model.to(dtype).to_empty(device=dev)  # allocated once, in the target dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, std, generator=g)
            else:  # norm gains around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype))
    return model.eval()


def target_section(dev, smoke: bool, guard: Guard, report: dict) -> dict:
    from flashmap.types import SamplingParams, VerifyRow
    from target_service.engine import TargetEngine
    from target_service.kernels import TorchOps

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ctx = 512 if not smoke else 24
    reps = 20 if not smoke else 2
    model = _random_qwen3(QWEN3_8B if not smoke else TINY_TARGET, dev, dtype)
    c = model.config
    n = max(BATCHES)
    engine = TargetEngine.from_model(model, n_slots=n, max_seq_len=ctx + 2 * (K + 1))
    res: dict = {
        "context": ctx,
        "dtype": str(dtype),
        "ops": model.ops.describe(),
        "kernel_check": engine.kernel_check,
    }
    # Bytes a step must read: every weight but the embedding table (B rows of it are gathered).
    weight_bytes = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if not name.startswith("model.embed_tokens")
    )
    kv_token = (
        2
        * c.num_hidden_layers
        * c.num_key_value_heads
        * c.head_dim
        * model.lm_head.weight.element_size()
    )
    res["weight_bytes"] = weight_bytes
    res["kv_bytes_per_token"] = kv_token
    bw = report.get("ceilings", {}).get("copy_GBps")
    if bw:
        res["floor_ms"] = round(weight_bytes / (bw * 1e9) * 1e3, 4)
        res["floor_with_kv_ms"] = {
            b: round((weight_bytes + b * (ctx + K + 1) * kv_token) / (bw * 1e9) * 1e3, 4)
            for b in BATCHES
        }
    say(
        f"  target: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, weights read per step "
        f"{weight_bytes / 1e9:.2f} GB, floor {res.get('floor_ms')} ms, ops {res['ops']}"
    )
    rng = np.random.default_rng(0)
    G = SamplingParams()
    for s in range(0, n, 4):  # prefill every slot to ctx, four at a time
        rows = []
        for slot in range(s, min(n, s + 4)):
            assert engine.allocate() == slot
            rows.append(VerifyRow(slot, 0, rng.integers(0, c.vocab_size, ctx).astype(np.int64), G))
        engine.verify(rows)
    sync(dev)

    def row_sets(b: int, L: int, params=G, width: int = 1, sets: int = 4, more: int = 0):
        out = []
        for _ in range(sets):  # rotate token ids between repetitions
            rows = []
            for slot in range(b):
                tok = rng.integers(0, c.vocab_size, L).astype(np.int64)
                sup = (
                    (tok[1:, None] + np.arange(width)) % c.vocab_size
                    if L > 1
                    else np.zeros((0, width), np.int64)
                )
                rows.append(
                    VerifyRow(
                        slot,
                        ctx,
                        tok,
                        params,
                        sup,
                        int(rng.integers(1 << 30)),
                        rng.integers(1 << 30, size=more),
                    )
                )
            out.append(rows)
        return out

    def bench(label: str):
        lat = {}
        for b in BATCHES:
            # decode8: one call decoding 8 tokens per row (VerifyRow.next_seeds, the serving
            # rounds without drafts), against 8 steps.
            for name, L, params, width, more in (
                ("step", 1, G, 1, 0),
                ("verify17", K + 1, G, 1, 0),
                ("verify17_T1_S4", K + 1, SamplingParams(1.0), 4, 0),
                ("decode8", 1, G, 1, 7),
            ):
                if name == "verify17_T1_S4" and b == 4:
                    continue
                if not guard.fits(20):
                    say(f"  time guard: {label} stops at batch {b}")
                    return lat
                sets = row_sets(b, L, params, width, more=more)
                it = iter(range(10**9))
                r = timed(
                    lambda: engine.verify(sets[next(it) % len(sets)]),
                    dev,
                    reps if label == "graph" else max(3, reps // 2),
                    guard=guard,
                )
                lat[f"{name} b={b}"] = r
                say(f"  {label} {name} b={b}: {r}")
        return lat

    res["eager"] = bench("eager")
    # CUDA graphs (static mode on the CPU); fall back to torch ops if the fused kernels fail here.
    mode = "cuda" if dev.type == "cuda" else "static"
    try:
        res["capture"] = engine.enable_graphs(
            batch_buckets=BATCHES, query_buckets=(1, K + 1), mode=mode
        )
    except Exception as e:  # noqa: BLE001
        res["capture_error"] = f"{type(e).__name__}: {e}"
        say(
            f"  capture with {model.ops.describe()} failed ({res['capture_error']}); retrying with torch ops"
        )
        model.ops = TorchOps()
        res["ops"] = "torch (fallback)"
        res["capture"] = engine.enable_graphs(
            batch_buckets=BATCHES, query_buckets=(1, K + 1), mode=mode
        )
    say(f"  capture: {res['capture']}")
    # The same rows through the graph and eagerly (rolled back in between): agreement at this shape.
    rows = row_sets(4, K + 1, sets=1)[0]
    got = engine.verify(rows)
    graphs, engine.graphs = engine.graphs, None
    want = engine.verify(rows)
    engine.graphs = graphs
    res["graph_vs_eager_b4_verify17"] = {
        "argmax_equal": f"{sum(int(np.sum(x.argmax == y.argmax)) for x, y in zip(got, want))}/{sum(len(y.argmax) for y in want)}",
        "features_max_rel_err": max(
            float(np.abs(x.features - y.features).max() / np.abs(y.features).max())
            for x, y in zip(got, want)
        ),
    }
    say(f"  graph vs eager at this shape: {res['graph_vs_eager_b4_verify17']}")
    res["graph"] = bench("graph")
    # Replay only (device time, no host work): what the GPU spends per pass.
    replay = {}
    for key, st in engine.graphs.graphs.items():
        if st.graph is not None and guard.fits(10):
            r = timed(st.graph.replay, dev, reps)
            replay[f"b={key[0]} q={key[1]}"] = r.get("device_ms", r["ms"])
    res["replay_device_ms"] = replay
    say(f"  replay (device ms): {replay}")
    # The GEMMs of a step alone, in one graph (what the weights cost through cuBLAS at this M),
    # and each fused op x n_layers: where the rest of a step goes.
    res["parts"] = {}
    for b, q in ((1, 1), (1, K + 1), (16, 1), (16, K + 1)):
        if not guard.fits(30):
            break
        try:
            res["parts"][f"b={b} q={q}"] = _parts(model, engine, b, q, ctx, dev)
        except Exception as e:  # noqa: BLE001
            res["parts"][f"b={b} q={q}"] = {"error": f"{type(e).__name__}: {e}"}
        say(f"  parts b={b} q={q}: {res['parts'][f'b={b} q={q}']}")
    engine.disable_graphs()
    del engine, model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _parts(model, engine, b: int, q: int, ctx: int, dev) -> dict:
    """GEMMs only and each fused op over all layers, each captured in a graph (CPU: eager)."""
    c, ops = model.config, model.ops
    layers = model.model.layers
    M, E, dt = b * q, c.hidden_size, model.lm_head.weight.dtype
    x = torch.randn(M, E, device=dev, dtype=dt)
    h = torch.randn(M, c.num_attention_heads * c.head_dim, device=dev, dtype=dt)
    mid = torch.randn(M, c.intermediate_size, device=dev, dtype=dt)

    def gemms():
        for layer in layers:
            F.linear(x, layer.self_attn.wqkv)
            F.linear(h, layer.self_attn.o_proj.weight)
            F.linear(x, layer.mlp.w_gate_up)
            F.linear(mid, layer.mlp.down_proj.weight)
        F.linear(x, model.lm_head.weight)

    w = layers[0].input_layernorm.weight
    qkv = torch.randn(
        M, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, device=dev, dtype=dt
    )
    gu = torch.randn(M, 2 * c.intermediate_size, device=dev, dtype=dt)
    slots = torch.arange(b, device=dev)
    pos = (ctx + torch.arange(q, device=dev)).expand(b, q).contiguous()
    scratch = torch.full_like(
        pos, model.max_seq_len
    )  # write to the scratch position: the cache stays intact
    cache = layers[0].self_attn.kv_cache
    qh = torch.randn(b, q, c.num_attention_heads, c.head_dim, device=dev, dtype=dt)
    n = len(layers)

    def loop(fn):
        return lambda: [fn() for _ in range(n)]

    out = {"gemms": graph_time(gemms, dev)}
    out["add_rms_norm_x2"] = graph_time(
        loop(lambda: (ops.add_rms_norm(x, x, w, 1e-6), ops.add_rms_norm(x, x, w, 1e-6))), dev
    )
    out["qk_norm_rope_write"] = graph_time(
        loop(
            lambda: ops.qk_norm_rope_write(
                qkv,
                layers[0].self_attn.q_norm.weight,
                layers[0].self_attn.k_norm.weight,
                1e-6,
                model.rope_cos,
                model.rope_sin,
                pos.reshape(-1),
                cache.k,
                cache.v,
                slots[:, None].expand(b, q).reshape(-1),
                scratch.reshape(-1),
                c.num_attention_heads,
                c.num_key_value_heads,
            )
        ),
        dev,
    )
    out["attention"] = graph_time(
        loop(lambda: ops.attention(qh, cache.k, cache.v, slots, pos, ctx + q)), dev
    )
    out["silu_mul"] = graph_time(loop(lambda: ops.silu_mul(gu)), dev)
    res = {k: v["ms"] for k, v in out.items()}
    # Other tilings of the attention kernel (BLOCK_M, BLOCK_N, warps): data for tuning it next time.
    from target_service import kernels

    if dev.type == "cuda" and isinstance(ops, kernels.TritonOps) and "attention" in ops.enabled:
        chosen = kernels.attention_blocks
        for cfg in ((64, 64, 4), (128, 32, 8), (64, 128, 8), (128, 128, 8)):
            try:
                kernels.attention_blocks = lambda dtype, cfg=cfg: cfg
                res[f"attention {cfg}"] = graph_time(
                    loop(lambda: ops.attention(qh, cache.k, cache.v, slots, pos, ctx + q)), dev
                )["ms"]
            except Exception as e:  # noqa: BLE001
                res[f"attention {cfg}"] = f"{type(e).__name__}"
            finally:
                kernels.attention_blocks = chosen
    return res


def drafter_section(dev, smoke: bool, guard: Guard) -> dict:
    from drafter_service.config import DrafterConfig
    from drafter_service.flashmap_dit import FlashMapDiT
    from drafter_service.flashmap_proposer import FlashMapProposer, draw_noise, request_generator
    from flashmap.types import ProposeRequest

    big = not smoke
    V, H, layers = (151936, 4096, [1, 9, 17, 25, 33]) if big else (512, 64, [1])
    arch = dict(dim=2048, n_blocks=6, n_heads=16) if big else dict(dim=64, n_blocks=2, n_heads=4)
    cfg = DrafterConfig(
        vocab_size=V,
        target_hidden_size=H,
        target_num_layers=36 if big else 4,
        feature_layers=layers,
        **arch,
    )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ctx = 1024 if big else 64
    reps = 20 if big else 2
    with torch.device(dev):
        embed = torch.randn(V, H, dtype=dtype) * 0.02
        model = FlashMapDiT(cfg, embed, embed).to(dtype)
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
    del prop, model, embed
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def cuda_tests_section(guard: Guard) -> dict:
    """The repository's CUDA tests (they skip on a CPU): graph == eager and lossless with graphs
    on CUDA, the drafter's device noise. In a subprocess, bounded by the time guard."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    limit = max(30.0, min(240.0, guard.left() - 20))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "cuda",
        "tests/test_target_graphs.py",
        "tests/test_drafter_device_noise.py",
    ]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=limit)
        out = {"returncode": p.returncode, "tail": (p.stdout + p.stderr)[-2500:]}
    except subprocess.TimeoutExpired as e:
        out = {
            "returncode": None,
            "error": f"timed out after {limit:.0f} s",
            "tail": (
                (e.stdout or b"").decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else (e.stdout or "")
            )[-2500:],
        }
    out["seconds"] = round(time.perf_counter() - t, 1)
    last = [l for l in out["tail"].splitlines() if l.strip()]
    out["result"] = last[-1] if last else ""
    return out


def projection(report: dict) -> dict:
    t, d = report.get("target", {}), report.get("drafter", {}).get("latency", {})
    lat = t.get("graph") or t.get("eager") or {}
    out = {}
    for b in BATCHES:
        if f"step b={b}" not in lat or f"verify17 b={b}" not in lat:
            continue
        step, ver = lat[f"step b={b}"]["ms"], lat[f"verify17 b={b}"]["ms"]
        for steps in (1, 2):
            dr = d.get(f"graph steps={steps} b={b}") or d.get(f"eager steps={steps} b={b}")
            if dr is None:
                continue
            for gamma in (3, 4, 5, 6):
                out[f"b={b} steps={steps} gamma={gamma}"] = round(
                    gamma * step / (ver + dr["ms"]), 2
                )
    return out


def summary(report: dict) -> list[str]:
    """The short table printed last, with the issue's acceptance checks."""
    lines = ["", "=" * 78, "GPU CHECK SUMMARY"]
    env, ceil, t, d = (report.get(k, {}) for k in ("env", "ceilings", "target", "drafter"))
    lines.append(
        f"device {env.get('name', env.get('device'))}  torch {env.get('torch')}  triton {env.get('triton')}  "
        f"copy {ceil.get('copy_GBps')} GB/s  bf16 mm {ceil.get('matmul_TFLOPs')} TFLOP/s"
    )
    for dt in ("fp32", "bf16"):
        e = report.get(f"exactness_{dt}")
        if e is None:
            continue
        if "error" in e:
            lines.append(f"exact {dt}: ERROR {e['error'][:120]}")
            continue
        ge = e.get("graph_vs_eager", {})
        inv = e.get("invariant_verify17_vs_17_steps", {})
        lines.append(
            f"exact {dt}: graph==eager argmax {ge.get('argmax_equal')} feat err {ge.get('features_max_rel_err', 0):.1e}"
            f" | spec==AR s1 {e.get('speculative_eq_autoregressive_steps1')} s2 "
            f"{e.get('speculative_eq_autoregressive_steps2')} | invariant bitwise {inv.get('features_bitwise_equal')}"
            f" spec==AR {e.get('invariant_speculative_eq_autoregressive')} | ops {e.get('ops')}"
        )
    floor = t.get("floor_ms")
    g, ea, rp = t.get("graph", {}), t.get("eager", {}), t.get("replay_device_ms", {})
    if floor or g:
        lines.append(
            f"target 8B bf16 ctx {t.get('context')}: weights {t.get('weight_bytes', 0) / 1e9:.2f} GB, "
            f"floor {floor} ms, ops {t.get('ops')}, graph vs eager {t.get('graph_vs_eager_b4_verify17')}"
        )
        lines.append(
            f"{'batch':>5} | {'step graph':>10} {'replay':>7} {'eager':>7} | {'verify17 g':>10} {'replay':>7} "
            f"{'eager':>7} | {'T=1,S=4':>7} | {'decode8/8':>9} | step/floor  v/step"
        )
        for b in BATCHES:
            st, vr = g.get(f"step b={b}", {}).get("ms"), g.get(f"verify17 b={b}", {}).get("ms")
            f = lambda v: f"{v:7.2f}" if isinstance(v, (int, float)) else f"{'-':>7}"  # noqa: E731
            ratio = f"{st / floor:10.2f}" if st and floor else f"{'-':>10}"
            vs = f"{vr / st:7.2f}" if st and vr else f"{'-':>7}"
            lines.append(
                f"{b:>5} | {f(st):>10} {f(rp.get(f'b={b} q=1'))} {f(ea.get(f'step b={b}', {}).get('ms'))} | "
                f"{f(vr):>10} {f(rp.get(f'b={b} q=17'))} {f(ea.get(f'verify17 b={b}', {}).get('ms'))} | "
                f"{f(g.get(f'verify17_T1_S4 b={b}', {}).get('ms'))} | "
                f"{f((g.get(f'decode8 b={b}', {}).get('ms') or float('nan')) / 8):>9} | {ratio}  {vs}"
            )
    for key, parts in (t.get("parts") or {}).items():
        if isinstance(parts, dict) and "error" not in parts:
            lines.append(
                f"parts {key} (ms/step, each in a graph): "
                + "  ".join(
                    f"{k.replace('attention ', 'attn')}={v:.3f}"
                    if isinstance(v, float)
                    else f"{k}={v}"
                    for k, v in parts.items()
                )
            )
    lat = d.get("latency", {})
    if lat:
        lines.append(
            "drafter paper size bf16 (ms, wall): "
            + "  ".join(
                f"{m[0]}{s} b={b}: {lat.get(f'{m} steps={s} b={b}', {}).get('ms', float('nan')):.2f}"
                for m in ("graph",)
                for s in (1, 2)
                for b in BATCHES
            )
        )
        lines.append(
            "drafter eager (ms): "
            + "  ".join(
                f"s{s} b={b}: {lat.get(f'eager steps={s} b={b}', {}).get('ms', float('nan')):.2f}"
                for s in (1, 2)
                for b in BATCHES
            )
        )
    proj = report.get("projection", {})
    if proj:
        lines.append(
            "projected speedup b=1 steps=1, gamma 3/4/5/6: "
            + " / ".join(str(proj.get(f"b=1 steps=1 gamma={gm}")) for gm in (3, 4, 5, 6))
            + "   b=16: "
            + " / ".join(str(proj.get(f"b=16 steps=1 gamma={gm}")) for gm in (3, 4, 5, 6))
        )
    checks = []
    st1, v1 = g.get("step b=1", {}).get("ms"), g.get("verify17 b=1", {}).get("ms")
    if st1 and floor:
        checks.append(
            f"step b=1 {st1:.2f} ms <= 1.3 x floor {1.3 * floor:.2f}: {'PASS' if st1 <= 1.3 * floor else 'FAIL'}"
            f" (replay {rp.get('b=1 q=1')})"
        )
    if st1 and v1:
        checks.append(
            f"verify17 b=1 / step = {v1 / st1:.3f} <= 1.15: {'PASS' if v1 <= 1.15 * st1 else 'FAIL'}"
        )
    d1, d16 = (
        lat.get("graph steps=1 b=1", {}).get("ms"),
        lat.get("graph steps=1 b=16", {}).get("ms"),
    )
    if d1:
        checks.append(f"drafter 1 jump b=1 {d1:.3f} ms < 1.5: {'PASS' if d1 < 1.5 else 'FAIL'}")
    if d1 and d16:
        checks.append(
            f"drafter b=16 / b=1 = {d16 / d1:.2f} < 2: {'PASS' if d16 < 2 * d1 else 'FAIL'}"
        )
    lines += ["acceptance: " + c for c in checks]
    ct = report.get("cuda_tests", {})
    if ct:
        lines.append(
            f"CUDA tests (pytest -k cuda): {ct.get('result') or ct.get('error')} ({ct.get('seconds')} s)"
        )
    errs = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    lines.append(f"sections with errors: {errs or 'none'}; total {time.perf_counter() - T0:.0f} s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="directory for gpu_check.json and gpu_check.log"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (tests the script)")
    ap.add_argument(
        "--budget",
        type=float,
        default=400.0,
        help="global time guard, seconds: sections that would not fit are skipped; at budget + 45 s a "
        "watchdog prints the table and exits",
    )
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    a = ap.parse_args(argv)
    global SMOKE
    SMOKE = a.smoke
    if a.smoke:  # tiny shapes: threads only add synchronisation (and 2 shared cores here)
        torch.set_num_threads(1)
    if not a.smoke and not torch.cuda.is_available():
        print("no CUDA device: use --smoke on a CPU", flush=True)
        return 2
    dev = torch.device("cpu" if a.smoke else "cuda")
    guard = Guard(a.budget)
    skip = set(filter(None, a.skip.split(",")))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}

    def save():
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
            (a.out / "gpu_check.log").write_text("\n".join(LOG) + "\n")

    def watchdog():  # a section that hangs (a capture, a kernel) must not lose the table
        say(f"WATCHDOG: {a.budget + 45:.0f} s passed; printing what there is and exiting")
        report["watchdog"] = {"error": "a section was still running at the watchdog"}
        lines = summary(report)
        report["summary"] = lines
        LOG.extend(lines)
        try:
            save()
        finally:
            print("\n".join(lines), flush=True)
            os._exit(3)

    import threading

    timer = threading.Timer(a.budget + 45, watchdog)
    timer.daemon = True
    timer.start()
    sections = [
        ("env", 5, lambda: env_section(dev)),
        ("ceilings", 20, lambda: ceilings_section(dev, a.smoke)),
        ("exactness_fp32", 60, lambda: exactness_section(dev, torch.float32, a.smoke, guard)),
        ("exactness_bf16", 60, lambda: exactness_section(dev, torch.bfloat16, a.smoke, guard)),
        ("target", 90, lambda: target_section(dev, a.smoke, guard, report)),
        ("drafter", 40, lambda: drafter_section(dev, a.smoke, guard)),
        ("cuda_tests", 60, lambda: cuda_tests_section(guard)),
    ]
    for name, need, fn in sections:
        if name in skip or (name == "cuda_tests" and a.smoke):
            continue
        if not guard.fits(need if not a.smoke else 1):
            report[name] = {"error": f"skipped: {guard.left():.0f} s left, section needs ~{need} s"}
            say(f"{name}: skipped (time guard)")
            continue
        say(f"{name} ...")
        try:
            report[name] = fn()
            say(f"{name} done")
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            report[name] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
            say(f"{name} FAILED: {report[name]['error']}")
            print(report[name]["traceback"], flush=True)
        finally:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        save()
    try:
        report["projection"] = projection(report)
    except Exception as e:  # noqa: BLE001
        report["projection"] = {"error": f"{type(e).__name__}: {e}"}
    timer.cancel()
    lines = summary(report)
    report["summary"] = lines
    LOG.extend(lines)
    save()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
