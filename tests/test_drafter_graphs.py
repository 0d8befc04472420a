"""The CUDA-graph drafting path (padded batch buckets, fixed context windows, device-tensor
times) computes what the dynamic path computes. Run here in mode="static": the same
function without capture, since CI has no GPU."""

import numpy as np
import pytest
import torch

from drafter_service.checkpoint import init_drafter
from drafter_service.flashmap_proposer import FlashMapProposer
from drafter_service.proposer import ProposeRequest
from target_service.random_checkpoint import make_random_qwen3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    target = make_random_qwen3(tmp_path_factory.mktemp("g") / "t", with_tokenizer=False)
    return init_drafter(target, dim=64, n_blocks=2, n_heads=4, seed=0)


def _proposer(model, graphs: bool):
    p = FlashMapProposer(model, n_slots=8, max_context=32)
    rng = np.random.default_rng(0)
    for i, n in enumerate([3, 10, 20, 7, 1]):
        p.extend(f"s{i}", rng.integers(0, 512, n), rng.standard_normal((n, model.cfg.feature_dim)).astype(np.float32))
    if graphs:
        report = p.enable_graphs(steps=(1, 2), mode="static", batch_buckets=(1, 2, 4), context_buckets=(8, 16))
        assert report["graphs"] == 2 * 3 * 3  # steps x batch buckets x (8, 16, max_context 32)
    return p


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("n_seqs", [1, 3, 5])  # 5 > largest bucket: eager fallback
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_graph_path_matches_dynamic(model, steps, n_seqs, temperature):
    reqs = [ProposeRequest(f"s{i}", anchor=7 + i, temperature=temperature, seed=11 + i) for i in range(n_seqs)]
    ref = _proposer(model, graphs=False).propose(reqs, steps)
    got = _proposer(model, graphs=True).propose(reqs, steps)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.support_ids, b.support_ids)
        np.testing.assert_allclose(a.support_probs, b.support_probs, rtol=1e-4, atol=1e-6)


def test_graph_run_reports_no_graph_for_uncaptured_steps(model):
    p = _proposer(model, graphs=True)
    x = torch.zeros(1, p.block_size, p.vocab_size)
    assert p.graphs.run(x, torch.tensor([1]), [0], [3], steps=5) is None
