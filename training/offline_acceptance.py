"""Offline acceptance: a drafter's blocks at held-out anchors, verified by the target.

`offline_acceptance` drafts a block at every anchor of held-out sequences (training.heldout)
and verifies it with the target engine, one verify pass per drafted block: alpha_k =
[d_k = argmax] at T = 0, min(1, p_k(d_k) / q_k(d_k)) at T > 0, and gamma = 1 + sum_k
prod_{j<=k} alpha_j per draft variant of the shuffle test (training.shuffle_test).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flashmap.drafts import Draft
from flashmap.types import SamplingParams, VerifyRow
from training.heldout import HeldoutSequence, anchor_rounds, spread_anchors
from training.shuffle_test import (
    DraftVariants,
    acceptance,
    cyclic_shuffles,
    draft_variants,
    proposal_prob,
)


@dataclass
class AnchorDrafts:
    """Per anchor: its sequence, expected accepted length per draft variant, the drafted
    tokens of the shared-noise block and the share of slots a second draw changes."""

    seq: np.ndarray  # [N] sequence index (the bootstrap's clusters)
    domain: list = field(default_factory=list)
    gamma: dict = field(default_factory=dict)  # variant -> [N]
    tokens: list = field(default_factory=list)  # [N] arrays [K]
    changed: np.ndarray | None = None  # [N]


def _alpha(res, draft: Draft, temperature: float) -> np.ndarray:
    """Per-slot acceptance probability [K] from a target VerifyResult of this draft."""
    if temperature == 0:
        return (draft.tokens == res.argmax[: len(draft.tokens)]).astype(np.float64)
    hit = draft.support_ids == draft.tokens[:, None]  # [K, S]
    p = np.where(hit, res.support_probs, 0.0).sum(-1)
    return np.minimum(1.0, p / np.maximum(proposal_prob(draft), 1e-12))


@torch.no_grad()
def offline_acceptance(
    engine,
    proposer,
    seqs: list[HeldoutSequence],
    *,
    temperature: float = 0.0,
    steps: int = 1,
    top_m: int = 4,
    shuffles: bool = True,
    max_anchors: int | None = None,
    seed: int = 0,
    progress: bool = False,
    averaged: bool = False,
) -> AnchorDrafts:
    """Draft a block at every anchor of seqs with `proposer` (the serving FlashMapProposer or
    any SlotCacheProposer; context = the target's features of the reference tokens before the
    anchor) and verify it with the target `engine` (TargetEngine): alpha_k = [d_k = argmax]
    at T = 0, min(1, p_k(d_k) / q_k(d_k)) at T > 0, along the drafted block. Variants (with
    `shuffles`): "shared" (what serving drafts), "perm" (permutation shuffle), "slot_noise"
    (per-slot noise); gamma per variant is 1 + sum_k prod_{j<=k} alpha_j. Seeds depend on
    (seed, sequence, anchor) only, so two drafters see the same draws. max_anchors: at most
    this many anchors per sequence, spread evenly. averaged (with shuffles): also "shared_avg"
    and "perm_avg", gamma averaged over all K shared-noise runs and over their K cyclic
    shuffles (2K - 2 more verifies per anchor, no more drafting): the same Delta in expectation,
    without the noise of one draw per anchor."""
    from tqdm import tqdm

    K = proposer.block_size
    n_par = min(engine.n_slots, proposer.n_slots)
    params = SamplingParams(temperature=float(temperature))
    out = AnchorDrafts(seq=np.zeros(0, np.int64))
    seq_ids, gam, changed = [], {}, []
    bar = tqdm(total=len(seqs), disable=not progress, desc="anchors")
    for g0 in range(0, len(seqs), n_par):
        group = seqs[g0 : g0 + n_par]
        anchors = [spread_anchors(s, K, max_anchors) for s in group]
        slots = [engine.allocate() for _ in group]
        # Leading positions of the engine's cache that hold reference tokens.
        ref_kv = [0] * len(group)
        try:
            for r, live, reqs in anchor_rounds(proposer, group, anchors, temperature, top_m, seed):
                if shuffles and getattr(proposer.model.cfg, "kind", "") == "flashmap":
                    variants = draft_variants(proposer, reqs, steps)
                else:  # drafts that ignore the noise: every variant is the same block
                    variants = [DraftVariants(d, d, d, d) for d in proposer.propose(reqs, steps)]
                kinds = ("shared", "perm", "slot_noise") if shuffles else ("shared",)
                blocks = {k: [getattr(v, k) for v in variants] for k in kinds}
                if averaged and shuffles and variants[0].runs is not None:
                    cyc = [cyclic_shuffles(v.runs) for v in variants]
                    # Run 0 is "shared" and its shuffle 0 is "perm", verified above.
                    for j in range(1, K):
                        blocks[f"run{j}"] = [v.runs[j] for v in variants]
                        blocks[f"cyc{j}"] = [c[j] for c in cyc]
                for kind, ds in blocks.items():
                    rows = []
                    for i, d in zip(live, ds):
                        s, a = group[i], anchors[i][r]
                        # The cache past ref_kv holds drafts of an earlier anchor.
                        start = min(a, ref_kv[i])
                        rows.append(
                            VerifyRow(
                                slots[i],
                                start,
                                np.concatenate([s.tokens[start : a + 1], d.tokens]),
                                params,
                                support_ids=d.support_ids,
                            )
                        )
                    res = engine.verify(rows)
                    for d, rr in zip(ds, res):
                        gam.setdefault(kind, []).append(acceptance(_alpha(rr, d, temperature)))
                for i in live:  # the anchor is reference; the positions after it, drafts
                    ref_kv[i] = anchors[i][r] + 1
                for i, v in zip(live, variants):
                    seq_ids.append(group[i].index)
                    out.domain.append(group[i].domain)
                    out.tokens.append(v.shared.tokens)
                    changed.append(float(np.mean(v.shared.tokens != v.other.tokens)))
        finally:
            for sl in slots:
                engine.release(sl)
        bar.update(len(group))
    bar.close()
    out.seq = np.array(seq_ids, np.int64)
    out.gamma = {k: np.array(v) for k, v in gam.items() if not k.startswith(("run", "cyc"))}
    if "run1" in gam:
        out.gamma["shared_avg"] = np.mean(
            [gam["shared"]] + [gam[f"run{j}"] for j in range(1, K)], 0
        )
        out.gamma["perm_avg"] = np.mean([gam["perm"]] + [gam[f"cyc{j}"] for j in range(1, K)], 0)
    out.changed = np.array(changed)
    return out


def agreement(a: AnchorDrafts, b: AnchorDrafts) -> float:
    """Share of drafted slots where two drafters' shared-noise blocks agree (same anchors)."""
    if len(a.tokens) != len(b.tokens):
        raise ValueError("the two drafts cover different anchors")
    return float(np.mean([np.mean(x == y) for x, y in zip(a.tokens, b.tokens)]))
