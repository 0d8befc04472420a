"""The GPU check's target sections: the device's ceilings (copy bandwidth, bf16 matmul rate) and
the Qwen3-8B-shape target with random bf16 weights: memory floor, step / verify / multi-token
decode at batch 1, 4 and 16, eager and in CUDA graphs, replay only, and the GEMMs and each
fused op alone."""

from __future__ import annotations

import gc

import numpy as np
import torch
import torch.nn.functional as F

from bench.gpu_timing import BATCHES, Guard, K, graph_time, say, sync, timed

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
    bufs.clear()  # freed before the matmul's buffers
    m = 8192 if not smoke else 256
    a, b = (torch.randn(m, m, device=dev, dtype=torch.bfloat16) for _ in range(2))
    t = timed(lambda: a @ b, dev, 10 if not smoke else 3)
    sec = t.get("device_ms", t["ms"]) / 1e3
    out.update(
        matmul_n=m, matmul_ms=round(1e3 * sec, 4), matmul_TFLOPs=round(2 * m**3 / sec / 1e12, 1)
    )
    return out


def random_qwen3(cfg_dict: dict, dev, dtype, std: float = 0.02, seed: int = 0):
    from target_service.qwen3 import Qwen3, Qwen3Config

    cfg = Qwen3Config.from_dict(cfg_dict)
    with torch.device("meta"):
        model = Qwen3(cfg)
    model = model.to(dtype).to_empty(device=dev)  # allocated once, in the target dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, std, generator=g)
            else:  # norm gains around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype))
    return model.eval()


def target_section(dev, smoke: bool, guard: Guard, report: dict) -> dict:
    from flashmap.types import SamplingParams, VerifyRow
    from target_service.engine import TargetEngine
    from target_service.torch_ops import TorchOps

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ctx = 512 if not smoke else 24
    reps = 20 if not smoke else 2
    model = random_qwen3(QWEN3_8B if not smoke else TINY_TARGET, dev, dtype)
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
        "argmax_equal": f"{sum(int(np.sum(x.argmax == y.argmax)) for x, y in zip(got, want))}"
        f"/{sum(len(y.argmax) for y in want)}",
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
    engine = model = None  # freed before the next section
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
    from target_service import triton_ops

    if dev.type == "cuda" and isinstance(ops, triton_ops.TritonOps) and "attention" in ops.enabled:
        chosen = triton_ops.attention_blocks
        for cfg in ((64, 64, 4), (128, 32, 8), (64, 128, 8), (128, 128, 8)):
            try:
                triton_ops.attention_blocks = lambda dtype, cfg=cfg: cfg
                res[f"attention {cfg}"] = graph_time(
                    loop(lambda: ops.attention(qh, cache.k, cache.v, slots, pos, ctx + q)), dev
                )["ms"]
            except Exception as e:  # noqa: BLE001
                res[f"attention {cfg}"] = f"{type(e).__name__}"
            finally:
                triton_ops.attention_blocks = chosen
    return res
