"""The CUDA-graph drafting path (padded batch buckets, fixed context windows, device-tensor
times) computes what the dynamic path computes. Run here in mode="static": the same
function without capture, since CI has no GPU. And its CPU counterpart, torch.compile
(enable_compile): the same drafts, and eager drafting when compilation fails."""

import shutil

import numpy as np
import pytest
import torch

from drafter_service import compiled
from drafter_service.checkpoint import init_drafter
from drafter_service.flashmap_proposer import FlashMapProposer
from flashmap.drafts import ProposeRequest
from target_service.random_checkpoint import make_random_qwen3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    target = make_random_qwen3(tmp_path_factory.mktemp("g") / "t", with_tokenizer=False)
    return init_drafter(target, dim=64, n_blocks=2, n_heads=4, seed=0)


def _proposer(model, graphs: bool, estimate: str = "soft", **departures):
    p = FlashMapProposer(model, n_slots=8, max_context=32, greedy_estimate=estimate, **departures)
    rng = np.random.default_rng(0)
    for i, n in enumerate([3, 10, 20, 7, 1]):
        p.extend(
            f"s{i}",
            rng.integers(0, 512, n),
            rng.standard_normal((n, model.cfg.feature_dim)).astype(np.float32),
        )
    if graphs:
        report = p.enable_graphs(
            steps=(1, 2), mode="static", batch_buckets=(1, 2, 4), context_buckets=(8, 16)
        )
        assert report["graphs"] == 2 * 3 * 3  # steps x batch buckets x (8, 16, max_context 32)
    return p


# 5 rows > the largest bucket: eager fallback. The argmax estimate exists between two jumps.
CASES = [(steps, n, "soft") for steps in (1, 2) for n in (1, 3, 5)] + [
    (2, 1, "argmax"),
    (2, 3, "argmax"),
]


@pytest.mark.parametrize("steps,n_seqs,estimate", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0, None])  # None: T = 0 and T = 1 rows mixed
def test_static_graph_path_matches_dynamic(model, steps, n_seqs, temperature, estimate):
    reqs = [
        ProposeRequest(
            f"s{i}",
            anchor=7 + i,
            temperature=float(i % 2) if temperature is None else temperature,
            seed=11 + i,
        )
        for i in range(n_seqs)
    ]
    ref = _proposer(model, graphs=False, estimate=estimate).propose(reqs, steps)
    got = _proposer(model, graphs=True, estimate=estimate).propose(reqs, steps)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.support_ids, b.support_ids)
        np.testing.assert_allclose(a.support_probs, b.support_probs, rtol=1e-4, atol=1e-6)


def test_graph_run_reports_no_graph_for_uncaptured_steps(model):
    p = _proposer(model, graphs=True)
    y = torch.zeros(1, p.block_size, p.cfg.target_hidden_size)
    assert p.graphs.run(y, torch.tensor([1]), [0], [3], steps=5) is None


def _mixed_requests():
    return [
        ProposeRequest("s1", anchor=9, seed=3),
        ProposeRequest("s2", anchor=4, temperature=1.0, top_m=4, seed=5),
        ProposeRequest("s4", anchor=2, seed=6),
        ProposeRequest("new", anchor=1, seed=7),
    ]


def test_compile_failure_falls_back_to_eager(model, monkeypatch, caplog):
    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no C++ compiler (simulated)")

        return run

    monkeypatch.setattr(compiled.torch, "compile", broken)
    ref, comp = _proposer(model, graphs=False), _proposer(model, graphs=False)
    model.__dict__.pop("_compiled_methods", None)  # compile anew, through the broken torch.compile
    try:
        report = comp.enable_compile(steps=(1,))
        assert not report["compiled"] and "no C++ compiler" in report["failed"][0]
        assert "running it eagerly" in caplog.text
        reqs = _mixed_requests()
        for a, b in zip(ref.propose(reqs), comp.propose(reqs)):
            np.testing.assert_array_equal(a.tokens, b.tokens)
    finally:
        model.__dict__.pop("_compiled_methods", None)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="torch.compile (inductor) needs a C++ compiler",
)
def test_compiled_drafts_equal_eager_and_follow_weight_changes(tmp_path, caplog):
    """The compiled drafter drafts and encodes context as the eager one does. Compiling freezes
    the weights into the program: after an in-place update it must draft with the new weights
    (eagerly), not the frozen ones. One compilation serves both halves (it is the cost of this
    test); a one-block drafter of its own, since the second half changes its weights."""
    target = make_random_qwen3(tmp_path / "t", with_tokenizer=False)
    fresh = init_drafter(target, dim=64, n_blocks=1, n_heads=4, seed=1)
    ref, comp = _proposer(fresh, graphs=False), _proposer(fresh, graphs=False)
    report = comp.enable_compile(steps=(1,))  # with the warm-up's variants
    assert report["compiled"], report
    reqs = _mixed_requests()
    for batch in (reqs[:1], reqs):
        for a, b in zip(ref.propose(batch), comp.propose(batch)):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.support_ids, b.support_ids)
            np.testing.assert_allclose(a.support_probs, b.support_probs, rtol=1e-4, atol=1e-6)
    feats = np.random.default_rng(1).standard_normal((5, fresh.cfg.feature_dim)).astype(np.float32)
    for p in (ref, comp):  # the compiled context encoder writes the same cache
        p.extend("s1", np.arange(5), feats)
    torch.testing.assert_close(comp.k_cache, ref.k_cache, rtol=1e-4, atol=1e-5)
    with pytest.raises(IndexError):  # a bad request fails as it does eagerly...
        comp.propose([ProposeRequest("s1", anchor=10**6, seed=1)])
    assert (
        comp._evaluate.failed is None and comp._context_kv.failed is None
    )  # ...and compiling goes on

    before = comp.propose(reqs)
    # One drafting pass as the proposer runs it (one row with context, shared noise).
    H, K = fresh.cfg.target_hidden_size, fresh.cfg.block_size
    ctx = comp.cross_context(["s1"])
    args = (
        torch.randn(1, 1, H).expand(1, K, H),
        fresh.modulations(0.0, 1.0, 1),
        torch.tensor([9]),
        ctx.kv,
        ctx.lengths,
    )
    with torch.inference_mode():
        old = comp._evaluate_greedy(*args)[0]
        with torch.no_grad():
            fresh.out_proj.weight.mul_(-3.0)
        # The compiled program itself still has the old weights: they really are frozen in.
        with torch._inductor.config.patch(freezing=True):
            torch.testing.assert_close(comp._evaluate_greedy.compiled(*args)[0], old)
        new = fresh.evaluate(*args)
    assert not torch.allclose(new, old)
    eager = _proposer(fresh, graphs=False)  # eager, new weights, the same contexts as comp
    eager.extend("s1", np.arange(5), feats)
    after, want = comp.propose(reqs), eager.propose(reqs)
    for a, b in zip(after, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(before, after))
    assert "weights changed" in comp._evaluate_greedy.failed and "running it eagerly" in caplog.text


@pytest.mark.parametrize("steps", [1, 2])
def test_second_jump_network_rows_run_eagerly_beside_graphs(tmp_path, steps):
    """With a second-jump network a batch holding T = 0 rows drafts two jumps eagerly (the
    graphs hold the map's jumps only); every draft equals the graph-less proposer's."""
    target = make_random_qwen3(tmp_path / "t", with_tokenizer=False)
    m = init_drafter(target, dim=64, n_blocks=2, n_heads=4, seed=0, second_jump_net=True)
    m.cfg.null_jump_fraction = 0.5  # T = 0 rows draft from the zero state: the network's path
    reqs = [
        ProposeRequest(f"s{i}", anchor=7 + i, temperature=float(i % 2), seed=11 + i)
        for i in range(3)
    ]
    net = dict(greedy_noise_scale=0.0, second_jump_net=True)  # the departure, named
    ref = _proposer(m, graphs=False, **net).propose(reqs, steps)
    p = _proposer(m, graphs=True, **net)
    assert p.second_jump is not None
    calls = []
    run = p.graphs.run
    p.graphs.run = lambda *a, **k: calls.append(a[4]) or run(*a, **k)
    got = p.propose(reqs, steps)
    assert calls == ([1] if steps == 1 else [])
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.support_probs, b.support_probs, rtol=1e-4, atol=1e-6)
