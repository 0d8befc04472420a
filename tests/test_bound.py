"""The bound (research/bound.py): the chain teacher-forced along a block gives the law it samples
that block from, and the offline measurement scores greedy drafts as 1 + their matching prefix
against the target's own greedy answers. Tiny random target and drafters: seconds."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from drafter_service.checkpoint import init_drafter
from drafter_service.eagle import EagleProposer, init_eagle
from drafter_service.flashmap_proposer import FlashMapProposer
from flashmap.drafts import ProposeRequest
from research import bound
from tests.drafter_helpers import distilled_world, one_thread  # noqa: F401 - autouse fixture
from training import heldout
from training.shuffle_test import proposal_prob


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bound")
    target, data, engine, prompts = distilled_world(root, n_prompts=4, max_new_tokens=30)
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text(
        "".join(f'{{"domain": "d{i % 2}", "prompt_ids": {p}}}\n' for i, p in enumerate(prompts))
    )
    seqs = heldout.heldout_sequences(data, prompt_file, exclude=())
    return target, engine, seqs


def _chain(target, seed=0):
    m = init_eagle(target, seed=seed, n_heads=4, n_layers=1, block_size=16, train_depth=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m.eval()


@pytest.mark.parametrize("top", [0, 4])
def test_chain_forced_along_a_sample_gives_the_law_it_was_sampled_from(world, top):
    target, _, seqs = world
    prop = EagleProposer(_chain(target), n_slots=2, max_context=128)
    s = seqs[0]
    a = s.prompt_len + 3
    prop.extend("x", s.tokens[:a], s.features[:a])
    V = prop.vocab_size
    reqs = [
        ProposeRequest("x", int(s.tokens[a]), temperature=1.0, top_m=top or V, seed=i)
        for i in (1, 2)
    ]
    drafts = prop.propose(reqs)
    q = bound.chain_reference_probs(prop, reqs, np.stack([d.tokens for d in drafts]), 1.0, top)
    for d, qq in zip(drafts, q):
        np.testing.assert_allclose(qq, proposal_prob(d), rtol=1e-4, atol=1e-6)
    # forced along its own greedy chain, every step's argmax is the forced token
    greedy = prop.propose([replace(reqs[0], temperature=0.0)])[0].tokens
    qg = bound.chain_reference_probs(prop, reqs[:1], greedy[None], 1e-4, 0)
    assert (qg > 0.99).all()


def test_measure_greedy_is_the_matching_prefix_and_draws_average(world):
    target, engine, seqs = world
    K = 16
    chain = EagleProposer(_chain(target, 1), n_slots=4, max_context=128)
    g = bound.measure(engine, chain, seqs, bound.RowSpec("c", "-"), 0.0, max_anchors=3)
    assert g.off_reference == 0 and not g.exact
    # the chain's greedy drafts, scored against the reference by hand
    drafts = []
    for s in seqs:
        for a in heldout.spread_anchors(s, K, 3):
            chain.extend("y", s.tokens[:a], s.features[:a])
            drafts.append(chain.propose([ProposeRequest("y", int(s.tokens[a]))])[0].tokens)
            chain.release("y")
    want = [
        1.0 + np.cumprod(d == s.tokens[a + 1 : a + 1 + K]).sum()
        for d, (s, a) in zip(
            drafts, [(s, a) for s in seqs for a in heldout.spread_anchors(s, K, 3)]
        )
    ]
    np.testing.assert_allclose(g.gamma, want)
    # sampled with draws: per-anchor means, and the exact expectation beside them
    sm = bound.measure(
        engine, chain, seqs, bound.RowSpec("c", "-", sample=True, draws=3), 0.0, max_anchors=3
    )
    assert len(sm.gamma) == len(sm.exact) == len(want) and sm.seq == g.seq
    assert all(1.0 <= x <= K + 1 for x in sm.gamma + sm.exact)
    # a FlashMap drafter: draws from its noise; the mode-seeking row is deterministic
    fm = init_drafter(
        target, seed=0, dim=64, n_blocks=1, n_heads=4, block_size=K, time_map_samples=2048
    )
    prop = FlashMapProposer(fm.eval(), n_slots=4, max_context=128, greedy_noise_scale=0.0)
    r1 = bound.measure(engine, prop, seqs, bound.RowSpec("m", "-", draws=2), 0.0, max_anchors=3)
    r2 = bound.measure(engine, prop, seqs, bound.RowSpec("m", "-", draws=1), 0.0, max_anchors=3)
    np.testing.assert_allclose(r1.gamma, r2.gamma)  # zero state: every draw the same block
    # the target sampling its own T = 1 law, exactly: one value per anchor, in [1, K + 1]
    ts = bound.target_sampled(engine, seqs, K, max_anchors=3)
    assert ts.seq == g.seq and ts.gamma == ts.exact and all(1.0 <= x <= K + 1 for x in ts.gamma)
    row = bound.summarize(sm, g)
    assert {"gamma_all", "exact_all", "draws_minus_exact_all", "vs_base_all"} <= set(row)


def test_row_specs():
    r = bound.parse_row("a=dir:2,sample,top=4,draws=8,scale=0,estimate=argmax,q1")
    assert (r.name, r.path, r.steps, r.sample, r.top, r.draws, r.scale, r.estimate) == (
        "a",
        "dir",
        2,
        True,
        4,
        8,
        0.0,
        "argmax",
    )
    assert r.q1 and "top 4" in r.label() and "8 draws" in r.label()
