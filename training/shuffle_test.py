"""The shuffle test: how much of a block's acceptance comes from the joint structure of one draw.

`draft_variants` makes, with the serving proposer (FlashMapProposer), the drafts the test and
the noise diagnostics need: the block of one shared noise draw, the permutation shuffle
(slot k from an independent shared-noise run k: every input stays in distribution), the
per-slot-noise shuffle, and a second draw (how often the noise changes the block).
`acceptance` is the expected accepted length of a block given its per-slot acceptance
probabilities, 1 + sum_k prod_{j<=k} alpha_j (rejection sampling; the +1 is the token the
target supplies). Delta = gamma(shared) - gamma(shuffled), with `paired_bootstrap`
intervals clustered by context or sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashmap.drafts import Draft


@dataclass
class DraftVariants:
    """Drafts of one request under the noise variants (see `draft_variants`)."""

    shared: Draft  # one shared noise draw (what serving drafts)
    perm: Draft  # slot k from an independent shared-noise run k
    other: Draft  # a second, independent shared-noise draw
    slot_noise: Draft | None = None  # one pass with an independent draw per slot
    runs: list[Draft] | None = None  # the K independent shared-noise runs behind perm


def cyclic_shuffles(blocks: list[Draft]) -> list[Draft]:
    """The K permutation shuffles j = 0..K-1 that take slot k from run (k + j) mod K: each is a
    valid shuffle (every slot from another independent run), and together with the K runs
    themselves they estimate Delta with the draws' own noise averaged out (Rao-Blackwell)."""
    K = len(blocks[0].tokens)
    return [permutation_shuffle(blocks[j:K] + blocks[:j]) for j in range(K)]


def permutation_shuffle(blocks: list[Draft]) -> Draft:
    """Slot k of block k (K independent runs -> one block)."""
    K = len(blocks[0].tokens)
    if len(blocks) < K:
        raise ValueError(f"the permutation shuffle needs {K} blocks, got {len(blocks)}")
    S = max(b.support_ids.shape[1] for b in blocks)
    ids = np.full((K, S), -1, np.int64)
    probs = np.zeros((K, S), np.float32)
    for k in range(K):
        s = blocks[k].support_ids.shape[1]
        ids[k, :s], probs[k, :s] = blocks[k].support_ids[k], blocks[k].support_probs[k]
    return Draft(np.array([blocks[k].tokens[k] for k in range(K)], np.int64), ids, probs)


def draft_variants(
    proposer, requests: list, steps: int, slot_noise: bool = True
) -> list[DraftVariants]:
    """For each request (drafter_service.proposer.ProposeRequest): the shared-noise block
    (= proposer.propose), the permutation shuffle and a second draw from K independent
    shared-noise runs (propose_blocks), and with slot_noise the block of one pass with an
    independent draw per slot (the proposer's shared_noise switched off for that call)."""
    K = proposer.block_size
    runs = proposer.propose_blocks(requests, steps, n_blocks=K)
    indep = [None] * len(requests)
    if slot_noise:
        was = proposer.shared_noise
        proposer.shared_noise = False
        try:
            indep = proposer.propose(requests, steps)
        finally:
            proposer.shared_noise = was
    return [
        DraftVariants(r[0], permutation_shuffle(r), r[1], s, list(r)) for r, s in zip(runs, indep)
    ]


def acceptance(alpha: np.ndarray) -> float:
    """Expected accepted length 1 + sum_k prod_{j<=k} alpha_j for per-slot acceptance
    probabilities alpha [K] (each given the earlier slots accepted)."""
    return 1.0 + float(np.cumprod(np.asarray(alpha, np.float64)).sum())


def proposal_prob(draft: Draft) -> np.ndarray:
    """q_k(d_k) per slot [K] (1 for greedy drafts)."""
    hit = draft.support_ids == draft.tokens[:, None]
    return np.where(hit, draft.support_probs, 0.0).sum(-1)


def paired_bootstrap(
    a: np.ndarray,
    b: np.ndarray | None = None,
    clusters: np.ndarray | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """Mean of a (or of a - b, paired) with a percentile bootstrap interval; resampling whole
    clusters (e.g. the anchors of one sequence) when given. Returns mean, lo, hi, n."""
    d = np.asarray(a, np.float64) - (0.0 if b is None else np.asarray(b, np.float64))
    cl = np.arange(len(d)) if clusters is None else np.asarray(clusters)
    ids, inv = np.unique(cl, return_inverse=True)
    sums, counts = np.bincount(inv, weights=d), np.bincount(inv)
    g = np.random.default_rng(seed)
    pick = g.integers(0, len(ids), (n_boot, len(ids)))
    boot = sums[pick].sum(1) / counts[pick].sum(1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return dict(mean=float(d.mean()), lo=float(lo), hi=float(hi), n=int(len(d)))
