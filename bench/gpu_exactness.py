"""The GPU check's exactness section: a tiny random Qwen3 in fp32 and bf16, CUDA-graph engine
== eager engine on mixed batches, speculative == autoregressive at T = 0, and the
batch-invariant mode (a 17-token verify bit-identical to 17 one-token steps)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.gpu_target import TINY_TARGET, random_qwen3
from bench.gpu_timing import Guard, say


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

    model = random_qwen3(
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
    inv = res["invariant_verify17_vs_17_steps"]
    say(f"  {dtype}: invariant {inv} spec==AR {res['invariant_speculative_eq_autoregressive']}")
    return res
