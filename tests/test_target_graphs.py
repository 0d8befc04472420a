"""The target's CUDA-graph path without a GPU: the same static-shape forward run without capture
(TargetGraphs mode="static") against the eager engine path, bucketing, padding and slot
mapping, the batch-invariant mode, and the fused Triton kernels under Triton's interpreter.

All fp32 unless said otherwise, tiny random checkpoints. Graph and eager paths run the same
model code on different padded shapes (CPU attention reads a context-bucket window), so
they agree to fp32 rounding: argmax equal, features and probabilities to 1e-5. In
batch-invariant mode every pass has one shape and the comparisons are bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashmap.types import SamplingParams, VerifyRow
from target_service.engine import TargetEngine
from target_service.qwen3 import Qwen3, cast_features
from target_service.random_checkpoint import make_random_qwen3

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
V = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_qwen3(tmp_path_factory.mktemp("t"), with_tokenizer=False, seed=5)


@pytest.fixture(scope="module")
def ckpt_small(tmp_path_factory):
    """Two layers, the shapes the interpreter runs (it is slow)."""
    return make_random_qwen3(
        tmp_path_factory.mktemp("s"), with_tokenizer=False, seed=6, num_hidden_layers=2
    )


def engine(
    ckpt,
    graphs: str | None = None,
    dtype=torch.float32,
    n_slots=4,
    max_seq_len=96,
    feature_layers=(0, 1, 3),
    features_dtype=torch.float32,
    **kw,
) -> TargetEngine:
    eng = TargetEngine.from_model(
        Qwen3.from_pretrained(ckpt, dtype=dtype),
        n_slots=n_slots,
        max_seq_len=max_seq_len,
        feature_layers=None if feature_layers is None else list(feature_layers),
        features_dtype=features_dtype,
    )
    if graphs:
        eng.enable_graphs(mode="static", **kw)
        calls = []
        run = eng.graphs.run
        eng.graphs.run = lambda key, *a: (calls.append(key), run(key, *a))[
            1
        ]  # record which graph ran
        eng.graph_calls = calls
    return eng


def rel_err(a, b) -> float:
    return float(
        np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-30)
    )


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, V, n)


def row(slot, start, tokens, k=0, params=GREEDY, seed=0, width=1, logprobs=-1):
    tokens = np.asarray(tokens, np.int64)
    support = (
        (tokens[len(tokens) - k :, None] + np.arange(width)) % V
        if k
        else np.zeros((0, width), np.int64)
    )
    return VerifyRow(slot, start, tokens, params, support, seed, logprobs=logprobs)


def script(eng: TargetEngine) -> list:
    """A serving-like sequence of batches; returns every VerifyResult in order."""
    out = []
    for _ in range(3):
        eng.allocate()
    # Prefill of two prompts (longer than the largest query bucket: eager in both engines).
    out += eng.verify([row(0, 0, toks(30, 1)), row(1, 0, toks(19, 2))])
    # Mixed: a 6-token verify, a 1-token decode, a 3-token prefill of a fresh slot, a sampling row
    # (two of them with log-probabilities).
    out += eng.verify(
        [
            row(0, 30, toks(6, 3), k=5, logprobs=3),
            row(1, 19, toks(1, 4), logprobs=0),
            row(2, 0, toks(3, 5), k=2, params=SAMPLED, seed=11, width=3, logprobs=2),
        ]
    )
    # Roll slot 0 back by 4 (its stale entries lie inside the attended window) and verify
    # 17 tokens next to a decode: 2 rows padded to the 2-row bucket, 17 to the 17 bucket.
    out += eng.verify(
        [row(0, 32, toks(17, 6), k=16, params=SAMPLED, seed=12, width=2), row(2, 3, toks(1, 7))]
    )
    # Release slot 1 and give it to a new sequence: its stale cache must not leak in.
    eng.release(1)
    assert eng.allocate() == 1
    out += eng.verify(
        [row(1, 0, toks(5, 8), k=4), row(2, 4, toks(2, 9), k=1), row(0, 49, toks(1, 10))]
    )
    # Three rows -> the 4-row bucket (one padding row), rows of lengths 1, 8, 3.
    out += eng.verify(
        [row(2, 6, toks(1, 11)), row(0, 50, toks(8, 12), k=7), row(1, 5, toks(3, 13), k=2)]
    )
    assert [eng.length(s) for s in range(3)] == [58, 8, 7]
    return out


def assert_same(got, want, bitwise=False):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g.argmax, w.argmax, err_msg=f"result {i}")
        np.testing.assert_array_equal(g.residual, w.residual, err_msg=f"result {i}")
        assert g.features.shape == w.features.shape and g.features.dtype == np.float32
        assert (
            g.support_probs.shape == w.support_probs.shape
            and g.complement.shape == w.complement.shape
        )
        assert g.logprobs.shape == w.logprobs.shape and g.top_ids.shape == w.top_ids.shape
        np.testing.assert_array_equal(g.top_ids, w.top_ids, err_msg=f"result {i}")
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, err_msg=f"result {i}")
        if bitwise:
            np.testing.assert_array_equal(g.features, w.features, err_msg=f"result {i}")
            np.testing.assert_array_equal(g.support_probs, w.support_probs, err_msg=f"result {i}")
        else:
            assert not w.features.size or rel_err(g.features, w.features) < 1e-5, f"result {i}"
            np.testing.assert_allclose(
                g.support_probs, w.support_probs, rtol=1e-5, atol=1e-7, err_msg=f"result {i}"
            )
            np.testing.assert_allclose(
                g.complement, w.complement, rtol=1e-5, atol=1e-7, err_msg=f"result {i}"
            )


def test_static_graph_path_equals_eager_on_mixed_batches(ckpt):
    eager = script(engine(ckpt))
    eng = engine(
        ckpt,
        graphs="static",
        batch_buckets=(1, 2, 4),
        query_buckets=(1, 4, 8, 17),
        context_buckets=(40,),
    )
    graph = script(eng)
    assert_same(graph, eager)
    # The prefill ran eagerly; every later batch through its bucket (b, q, context window).
    assert eng.graph_calls == [(4, 8, 40), (2, 17, 96), (4, 8, 96), (4, 8, 96)]


def test_multi_step_rows_run_every_step_through_the_graphs(ckpt):
    """Rows with next_seeds (a decode of 4 and a sampling decode of 3 without features, beside a
    1-token row): each further step replays the 1-token bucket, and every result equals the
    eager engine's."""

    def run(eng):
        for _ in range(3):
            eng.allocate()
        eng.verify([row(0, 0, toks(12, 21)), row(1, 0, toks(9, 22)), row(2, 0, toks(7, 23))])
        return eng.verify(
            [
                dataclasses.replace(row(0, 12, toks(1, 24)), next_seeds=np.array([1, 2, 3])),
                dataclasses.replace(
                    row(1, 9, toks(1, 25), params=SAMPLED, seed=4),
                    next_seeds=np.array([5, 6]),
                    features=False,
                ),
                row(2, 7, toks(1, 26)),
            ]
        )

    eager = run(engine(ckpt))
    eng = engine(
        ckpt, graphs="static", batch_buckets=(1, 2, 4), query_buckets=(1, 4), context_buckets=(40,)
    )
    graph = run(eng)
    assert_same(graph, eager)
    assert [len(r.argmax) for r in graph] == [4, 3, 1]
    assert [len(r.features) for r in graph] == [4, 0, 1]
    assert eng.graph_calls == [
        (4, 1, 40),
        (2, 1, 40),
        (2, 1, 40),
        (1, 1, 40),
    ]  # the prefill ran eagerly


@pytest.mark.parametrize("graphs", [None, "static"])
def test_only_the_features_a_row_asks_for_leave_the_engine(ckpt, graphs):
    """In one batch (eager, packed; or one graph bucket, padded) a row without features gets
    none while the rows beside it get theirs; the engine keeps them all, and the next row of
    that sequence fetches them (features_from), equal to what a row with features returned."""

    def run(eng, lean: bool):
        for _ in range(3):
            eng.allocate()
        eng.verify([row(0, 0, toks(12, 31)), row(1, 0, toks(9, 32)), row(2, 0, toks(7, 33))])
        batch = eng.verify(
            [
                row(0, 12, toks(4, 34), k=3),
                dataclasses.replace(row(1, 9, toks(4, 35), k=3), features=not lean),
                row(2, 7, toks(1, 36)),
            ]
        )
        fetch = eng.verify(
            [dataclasses.replace(row(1, 13, toks(1, 37)), features_from=9 if lean else -1)]
        )[0]
        return batch, fetch

    kw = (
        dict(batch_buckets=(1, 2, 4), query_buckets=(1, 4), context_buckets=(40,)) if graphs else {}
    )
    (full, full_next), (lean, lean_next) = (
        run(engine(ckpt, graphs, **kw), False),
        run(engine(ckpt, graphs, **kw), True),
    )
    assert [len(r.features) for r in lean] == [4, 0, 1]
    for a, b in ((lean[0], full[0]), (lean[2], full[2])):
        np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(
        lean_next.features, np.concatenate([full[1].features, full_next.features])
    )


def test_float16_features_are_the_float32_ones_cast(ckpt):
    """features_dtype=float16 (Triton's FEATURES configured TYPE_FP16): the eager path hands back
    exactly torch's cast of its float32 features, the graph path the same to its rounding;
    argmax and residuals do not change."""
    want = script(engine(ckpt))
    eager = script(engine(ckpt, features_dtype=torch.float16))
    graph = script(
        engine(
            ckpt,
            "static",
            features_dtype=torch.float16,
            batch_buckets=(1, 2, 4),
            query_buckets=(1, 4, 8, 17),
            context_buckets=(40,),
        )
    )
    for i, (e, g, w) in enumerate(zip(eager, graph, want)):
        assert (
            e.features.dtype == g.features.dtype == np.float16
            and e.features.shape == w.features.shape
        )
        np.testing.assert_array_equal(
            e.features, torch.from_numpy(w.features).half().numpy(), err_msg=f"result {i}"
        )
        np.testing.assert_allclose(
            g.features.astype(np.float32), w.features, rtol=2e-3, atol=1e-3, err_msg=f"result {i}"
        )
        for r in (e, g):
            np.testing.assert_array_equal(r.argmax, w.argmax, err_msg=f"result {i}")
            np.testing.assert_array_equal(r.residual, w.residual, err_msg=f"result {i}")
    # An outlier past float16's range saturates rather than becoming inf.
    assert cast_features(torch.tensor([1e6, -1e6, 3.0]), torch.float16).tolist() == [
        65504.0,
        -65504.0,
        3.0,
    ]


def test_bucket_selection(ckpt):
    eng = engine(
        ckpt,
        graphs="static",
        batch_buckets=(1, 2, 4, 8),
        query_buckets=(1, 4, 17),
        context_buckets=(16, 64),
    )
    g = eng.graphs
    assert g.batch_buckets == (1, 2, 4) and g.query_buckets == (1, 4, 17)  # no bucket above n_slots
    assert g.context_buckets == (16, 64, 96)  # ... and the whole cache last
    assert len(g.graphs) == 3 * 3 * 3
    assert g.key_for(1, 1, 1) == (1, 1, 16)
    assert g.key_for(3, 2, 17) == (4, 4, 64)
    assert g.key_for(2, 17, 96) == (2, 17, 96)
    assert g.key_for(2, 18, 20) is None  # a prefill-sized row: eager
    assert g.key_for(5, 1, 5) is None  # more rows than the largest bucket: eager
    inv = engine(ckpt, graphs="static", batch_invariant=True, query_buckets=(1, 4, 17)).graphs
    assert list(inv.graphs) == [(4, 17, 96)]  # one shape for everything
    assert inv.key_for(1, 1, 3) == (4, 17, 96)


def test_padding_writes_only_the_scratch_position(ckpt):
    eng = engine(
        ckpt, graphs="static", batch_buckets=(4,), query_buckets=(8,), context_buckets=(96,)
    )
    for _ in range(4):
        eng.allocate()
    eng.verify([row(s, 0, toks(5 + s, 20 + s)) for s in range(4)])  # every slot holds 5-8 tokens
    caches = [
        (l.self_attn.kv_cache.k.clone(), l.self_attn.kv_cache.v.clone())
        for l in eng.model.model.layers
    ]
    eng.graph_calls.clear()
    # Two rows (slots 3 and 1) in the [4, 8] graph: 2 padding rows (slot 0 in the graph) and
    # padding columns. Only positions 4..6 of slot 3, 5 of slot 1 and scratch may change.
    eng.verify([row(3, 4, toks(3, 30), k=2), row(1, 5, toks(1, 31))])
    assert eng.graph_calls == [(4, 8, 96)]
    T = eng.max_seq_len
    for (k0, v0), layer in zip(caches, eng.model.model.layers):
        for before, now in ((k0, layer.self_attn.kv_cache.k), (v0, layer.self_attn.kv_cache.v)):
            changed = (before != now).any(-1).any(1)  # [slot, position]
            expect = torch.zeros_like(changed)
            expect[3, 4:7] = expect[1, 5] = True
            assert torch.equal(changed[:, :T], expect[:, :T])


def test_batch_invariant_mode_is_bitwise_and_eager_is_not(ckpt):
    """A verify of 9 tokens and 9 one-token decodes of the same sequence: bit-identical
    features (so logits) in batch-invariant mode; in the bucketed mode only to rounding."""
    prompt, cont = toks(12, 40), toks(9, 41)
    diffs = {}
    for inv in (True, False):
        eng = engine(ckpt, graphs="static", batch_invariant=inv, query_buckets=(1, 4, 16))
        a, b, c = (eng.allocate() for _ in range(3))
        eng.verify([row(a, 0, prompt), row(b, 0, prompt)])
        spec = eng.verify([row(a, 12, cont, k=8), row(c, 0, toks(2, 42))])[0]
        steps = [eng.verify([row(b, 12 + i, cont[i : i + 1])])[0] for i in range(9)]
        assert spec.argmax.tolist() == [int(s.argmax[0]) for s in steps]
        diffs[inv] = np.abs(spec.features - np.concatenate([s.features for s in steps])).max()
    assert diffs[True] == 0.0
    assert 0.0 < diffs[False] < 1e-3  # the check above can fail: shapes do change rounding


def test_batch_invariant_speculative_equals_autoregressive_in_bf16(ckpt):
    """In bf16 a (K+1)-row verify and a one-row step round differently in the eager engine
    (on this CPU some sequences diverge); in batch-invariant mode every sequence is identical."""
    from drafter_service.factory import load_proposer
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest

    prompts = [toks(int(n), 50 + i).tolist() for i, n in enumerate([4, 9, 6, 12])]
    reqs = lambda: [GenerationRequest(p, 24) for p in prompts]  # noqa: E731
    eng = engine(
        ckpt,
        graphs="static",
        dtype=torch.bfloat16,
        batch_invariant=True,
        query_buckets=(17,),
        feature_layers=None,
    )
    prop = load_proposer("init", str(ckpt), n_slots=4, max_context=eng.max_seq_len, steps=1)
    ar = decode(eng, reqs())
    sp = decode(eng, reqs(), prop, 1)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]
    assert sum(r.stats.drafts for r in sp) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
def test_cuda_graphs_equal_eager_on_cuda(ckpt, dtype):
    def make(graphs):
        e = TargetEngine.from_model(
            Qwen3.from_pretrained(ckpt, device="cuda", dtype=dtype),
            n_slots=4,
            max_seq_len=96,
            feature_layers=[0, 1, 3],
        )
        if graphs:
            e.enable_graphs(batch_buckets=(1, 2, 4), query_buckets=(1, 4, 8, 17))
        return e

    got, want = script(make(True)), script(make(False))
    if dtype == torch.float32:
        assert_same(got, want)
    else:  # bf16: argmax may flip only at near-ties; count them
        same = sum(np.array_equal(g.argmax, w.argmax) for g, w in zip(got, want))
        assert same >= len(want) - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.gpu
def test_lossless_on_cuda_with_graphs(ckpt, batch_invariant):
    """Speculative (untrained FlashMap drafter, its CUDA graphs) == autoregressive at T = 0 with
    the target's CUDA graphs in fp32; in batch-invariant mode also in bf16."""
    from drafter_service.factory import load_proposer
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest

    prompts = [toks(int(n), 60 + i).tolist() for i, n in enumerate([4, 9, 6, 12, 20, 3, 15, 7])]
    reqs = lambda: [GenerationRequest(p, 24) for p in prompts]  # noqa: E731
    for dtype in (torch.float32,) + ((torch.bfloat16,) if batch_invariant else ()):
        eng = TargetEngine(ckpt, n_slots=8, max_seq_len=96, device="cuda", dtype=dtype)
        eng.enable_graphs(
            batch_buckets=(8,) if batch_invariant else (1, 2, 4, 8),
            query_buckets=(1, 2, 4, 8, 17),
            batch_invariant=batch_invariant,
        )
        ar = decode(eng, reqs())
        for steps in (1, 2):
            prop = load_proposer(
                "init", str(ckpt), device="cuda", n_slots=8, max_context=96, steps=steps
            )
            prop.enable_graphs(steps=(steps,), batch_buckets=(8,))
            sp = decode(eng, reqs(), prop, steps)
            assert [r.token_ids for r in sp] == [r.token_ids for r in ar], (dtype, steps)


# ------------------------------------------------------------------ Triton kernels, interpreted

_INTERPRET = r"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
torch.set_num_threads(1)
from target_service.kernels import self_check
from target_service.torch_ops import TorchOps
from target_service.triton_ops import TritonOps
from target_service.engine import TargetEngine
from target_service.qwen3 import Qwen3
from flashmap.types import SamplingParams, VerifyRow
ckpt = sys.argv[1]
out = {"check": self_check(TritonOps(), dtype=torch.float32, device=torch.device("cpu"), n_heads=4, n_kv=2,
                           head_dim=16, hidden=64, intermediate=128)}
res = {}
for name in ("triton", "torch"):
    m = Qwen3.from_pretrained(ckpt)
    e = TargetEngine.from_model(m, n_slots=3, max_seq_len=32, feature_layers=[0, 1])
    if name == "triton":
        m.ops = TritonOps()
        e.enable_graphs(mode="static", batch_buckets=(4,), query_buckets=(4,))
        out["windowed"] = m.ops.windowed_attention(16)
        out["keys"] = [list(k) for k in e.graphs.graphs]
    rng = np.random.default_rng(0)
    for s in range(3):
        e.allocate()
    G = SamplingParams()
    r = e.verify([VerifyRow(0, 0, rng.integers(0, 512, 9), G), VerifyRow(1, 0, rng.integers(0, 512, 7), G)])
    r += e.verify([VerifyRow(0, 9, rng.integers(0, 512, 4), G, np.arange(3)[:, None]),
                   VerifyRow(1, 7, rng.integers(0, 512, 1), G), VerifyRow(2, 0, rng.integers(0, 512, 3), G)])
    res[name] = r
out["argmax_equal"] = all(np.array_equal(a.argmax, b.argmax) for a, b in zip(res["triton"], res["torch"]))
out["feature_err"] = max(float(np.abs(a.features - b.features).max() / np.abs(b.features).max())
                         for a, b in zip(res["triton"], res["torch"]))
print(json.dumps(out))
"""


def test_triton_kernels_match_torch_in_the_interpreter(ckpt_small):
    """The fused kernels' indexing, masking and slot mapping, in fp32 under TRITON_INTERPRET=1
    (the interpreter does not emulate bf16 faithfully: bf16 is checked on the device by
    kernels.self_check). Needs Triton installed (not on CPU-only CI)."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path), TRITON_INTERPRET="1")
    p = subprocess.run(
        [sys.executable, "-c", _INTERPRET, str(ckpt_small)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert all(isinstance(v, float) and v < 1e-5 for v in out["check"].values()), out["check"]
    assert out["windowed"] is False and all(k[2] is None for k in out["keys"])  # no context buckets
    assert out["argmax_equal"] and out["feature_err"] < 1e-5, out


# ------------------------------------------------------------------ bench/gpu.py


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_section(tmp_path):
    """The device script end to end at tiny sizes on the CPU (static graphs, torch ops): every
    section runs without error, the JSON is written and the summary table comes last."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    p = subprocess.run(
        [sys.executable, "bench/gpu.py", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("env", "ceilings", "exactness_fp32", "exactness_bf16", "target", "drafter"):
        assert "error" not in report[name], (name, report[name])
    assert (
        report["exactness_bf16"]["invariant_verify17_vs_17_steps"]["features_bitwise_equal"] is True
    )
    ex = report["exactness_fp32"]
    assert (
        ex["graph_vs_eager"]["argmax_equal"] == "10/10"
        and ex["graph_vs_eager"]["features_max_rel_err"] < 1e-5
    )
    assert (
        ex["speculative_eq_autoregressive_steps1"] == "2/2"
        and ex["invariant_speculative_eq_autoregressive"] == "2/2"
    )
    assert ex["invariant_verify17_vs_17_steps"]["features_bitwise_equal"] is True
    t = report["target"]
    assert (
        {f"{n} b={b}" for n in ("step", "verify17") for b in (1, 4, 16)}
        <= set(t["graph"])
        <= set(t["eager"])
    )
    assert t["capture"]["graphs"] == 6 and set(t["parts"]) == {
        "b=1 q=1",
        "b=1 q=17",
        "b=16 q=1",
        "b=16 q=17",
    }
    assert report["drafter"]["same_draft_alone_and_in_batch16"] is True
    assert len(report["projection"]) == 3 * 2 * 4
    tail = p.stdout.strip().splitlines()
    assert tail[-1].startswith("sections with errors: none") and any(
        l.startswith("acceptance: ") for l in tail[-6:]
    )
