"""Rejection sampling emits exactly the target distribution (chi-square, fixed seeds).

The target side is simulated in numpy from a known p, exactly as the protocol says the
target computes it (p on the support, complement mass, one sample outside the support),
so the test checks the orchestrator's half of the protocol in isolation.
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from flashmap.drafts import Draft
from flashmap.rejection_sampler import greedy_verify, sample_verify
from flashmap.types import VerifyResult

V = 12
N = 20_000


def _random_p(rng, sparsity=0.0):
    p = rng.dirichlet(np.full(V, 0.5))
    if sparsity:
        p[rng.random(V) < sparsity] = 0.0
        p[rng.integers(V)] += 1e-3
        p /= p.sum()
    return p


def _draft(rng, qs, m):
    """Sample a block from per-slot q restricted to the top-m ids (renormalised)."""
    toks, ids, probs = [], [], []
    for q in qs:
        top = np.argsort(-q)[:m]
        qq = q[top] / q[top].sum()
        toks.append(top[rng.choice(m, p=qq)])
        ids.append(top)
        probs.append(qq)
    return Draft(np.array(toks), np.array(ids), np.array(probs, np.float32))


def _target_result(rng, ps, draft):
    """What the target returns for p_1..p_{K+1} (last = bonus position)."""
    k = len(draft.tokens)
    sp = np.stack([ps[i][draft.support_ids[i]] for i in range(k)]) if k else np.zeros((0, 1))
    comp = 1.0 - sp.sum(-1)
    resid = []
    for i in range(k + 1):
        p = ps[i].copy()
        if i < k:
            p[draft.support_ids[i]] = 0.0
        resid.append(rng.choice(V, p=p / p.sum()) if p.sum() > 1e-9 else -1)
    return VerifyResult(
        np.array([int(np.argmax(p)) for p in ps]),
        sp.astype(np.float32),
        comp.astype(np.float32),
        np.array(resid),
        np.zeros((k + 1, 1)),
    )


def _check(samples, p):
    counts = np.bincount(samples, minlength=V)
    mask = p * len(samples) >= 5  # chi-square needs expected counts >= 5; pool the rest
    obs = np.append(counts[mask], counts[~mask].sum())
    exp = np.append(p[mask], p[~mask].sum()) * len(samples)
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        assert counts[~mask].sum() == 0
    assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)


@pytest.mark.parametrize("m,sparsity", [(1, 0.0), (3, 0.0), (4, 0.5), (V, 0.0)])
def test_first_and_second_token_follow_p(m, sparsity):
    rng = np.random.default_rng(1234 + m)
    ps = [_random_p(rng, sparsity) for _ in range(3)]  # K = 2 drafts, then bonus
    qs = [_random_p(rng) for _ in range(2)]
    first, second = [], []
    for _ in range(N):
        draft = _draft(rng, qs, m)
        tokens, n_acc = sample_verify(draft, _target_result(rng, ps, draft), rng)
        assert len(tokens) == n_acc + 1
        assert list(tokens[:n_acc]) == list(draft.tokens[:n_acc])
        first.append(tokens[0])
        if len(tokens) > 1:
            second.append(tokens[1])
    _check(np.array(first), ps[0])
    # The simulated p_2 does not depend on token 1, so token 2 follows p_2 whenever
    # slot 1 was accepted.
    _check(np.array(second), ps[1])


def test_greedy_draft_exact_when_q_is_a_point_mass():
    rng = np.random.default_rng(7)
    p = [_random_p(rng), _random_p(rng)]
    out = []
    for _ in range(N):
        draft = Draft.greedy(np.array([3]))
        out.append(sample_verify(draft, _target_result(rng, p, draft), rng)[0][0])
    _check(np.array(out), p[0])


def test_draft_equal_to_target_is_always_accepted():
    rng = np.random.default_rng(0)
    p = [_random_p(rng) for _ in range(4)]
    for _ in range(200):
        ids = np.tile(np.arange(V), (3, 1))
        probs = np.stack(p[:3]).astype(np.float32)
        toks = np.array([rng.choice(V, p=pi) for pi in p[:3]])
        draft = Draft(toks, ids, probs)
        res = _target_result(rng, p, draft)
        res.support_probs = probs  # exactly equal p and q: acceptance probability 1
        tokens, n_acc = sample_verify(draft, res, rng)
        assert n_acc == 3 and len(tokens) == 4


def test_greedy_verify_longest_prefix():
    assert greedy_verify(np.array([5, 6, 7]), np.array([5, 6, 7, 8])) == ([5, 6, 7, 8], 3)
    assert greedy_verify(np.array([5, 6, 7]), np.array([5, 9, 7, 8])) == ([5, 9], 1)
    assert greedy_verify(np.array([5, 6, 7]), np.array([1, 6, 7, 8])) == ([1], 0)
    assert greedy_verify(np.array([], np.int64), np.array([4])) == ([4], 0)


# ============================================================ a drafted token's support beside it


def test_siblings_sit_beside_each_drafted_token_with_the_law_on_themselves():
    d = Draft(
        np.array([4, 7, 1]),
        np.array([[4, 2, 9], [3, 7, -1], [1, 5, 6]]),
        np.array([[0.5, 0.3, 0.2], [0.4, 0.6, 0.0], [0.7, 0.2, 0.1]], np.float32),
    )
    t = d.with_siblings()
    assert t.tokens.tolist() == [4, 7, 1, 2, 9, 3, 5, 6]
    assert t.parents.tolist() == [-1, 0, 1, -1, -1, 0, 1, 1]
    assert t.proposal_law and t.depth == 3
    # the drafted tokens keep their q; a leaf's law is all on itself
    assert np.array_equal(t.support_probs[:3], d.support_probs)
    assert t.support_ids[3:, 0].tolist() == [2, 9, 3, 5, 6]
    assert (t.support_ids[3:, 1:] == -1).all() and (t.support_probs[3:, 0] == 1).all()
    first = d.with_siblings(max_depth=1)  # leaves beside the first drafted token only
    assert first.tokens.tolist() == [4, 7, 1, 2, 9] and first.parents.tolist() == [-1, 0, 1, -1, -1]


def test_siblings_accept_the_targets_mass_on_the_support_and_keep_its_law():
    """One drafted token x ~ q (top-4 support) with its three siblings, walked by the target's
    multi-draft rejection sampling (target_service.tree): the committed token follows p, and a
    round accepts a draft with probability p(support), where x alone accepts with
    sum min(p, q)."""
    import torch

    from flashmap.types import SamplingParams, VerifyRow
    from target_service.tree import _rejection_walk
    from target_service.verification import exponential_noise

    rng = np.random.default_rng(3)
    p = _random_p(rng)
    top = np.argsort(-p)[:4]  # a drafter that knows the target's top 4 but not their order:
    q = np.full(4, 0.25)  # q < p at the target's mode, where one draft alone loses mass
    probs = torch.as_tensor(np.stack([p] * 5), dtype=torch.float32)  # [1 + K, V]
    n, counts, accepted = 12_000, np.zeros(V), 0
    for i in range(n):
        x = top[rng.choice(4, p=q)]
        t = Draft(np.array([x]), top[None].copy(), q[None].astype(np.float32)).with_siblings()
        row = VerifyRow(
            0, 0, np.concatenate([[0], t.tokens]), SamplingParams(1.0), t.support_ids, i,
            parents=t.parents, support_q=t.support_probs,
        )  # fmt: skip
        path, picked = _rejection_walk(row, probs, exponential_noise(i, (2, V), "cpu"))
        counts[picked[0]] += 1
        accepted += len(path) > 0
    assert chisquare(counts[p > 0], p[p > 0] * n).pvalue > 0.01
    rate, mass = accepted / n, p[top].sum()
    half = 4 * np.sqrt(mass * (1 - mass) / n)
    assert abs(rate - mass) < half, (rate, mass)
    single = np.minimum(p[top], q).sum()
    assert mass - single > 2 * half  # the test would see siblings that add nothing
