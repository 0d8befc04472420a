"""Exact speculative sampling over sparse proposal supports (numpy only).

One round checks a draft block x_1..x_K against the target (docs/ARCHITECTURE.md, "Exact
speculative sampling without moving the vocabulary"). Names follow vLLM:

- accepted token: draft token x_k kept because every u_j < min(1, p_j(x_j) / q_j(x_j))
  for j <= k (temperature 0: x_j equals the target argmax for every j <= k);
- recovered token: at the first rejection k, a token drawn from the residual
  r_k ∝ max(0, p_k - q_k) (temperature 0: the target argmax at k);
- bonus token: when all K are accepted, one token drawn from p_{K+1}
  (temperature 0: the argmax at K+1).

A round commits `accepted + 1` tokens: the accepted ones plus one recovered or bonus
token. This is Leviathan et al. 2023 / Chen et al. 2023; it needs only O(K * |S|)
numbers from the target because q_k is zero outside its explicit support S_k:
outside S_k the residual equals p_k, so its mass there is the complement
c_k = 1 - sum_{s in S_k} p_k(s) and the target ships one sample y_k from that part.
"""

from __future__ import annotations

import numpy as np

from flashmap.drafts import Draft
from flashmap.types import VerifyResult


def greedy_verify(draft_tokens: np.ndarray, target_argmax: np.ndarray) -> tuple[list[int], int]:
    """Temperature 0: the longest prefix of the draft that matches the target argmax.

    draft_tokens [K], target_argmax [K+1]. Returns (committed tokens, number accepted).
    """
    k = len(draft_tokens)
    mismatch = np.nonzero(draft_tokens != target_argmax[:k])[0]
    n_acc = int(mismatch[0]) if len(mismatch) else k
    return [int(t) for t in draft_tokens[:n_acc]] + [int(target_argmax[n_acc])], n_acc


def _residual_token(k: int, draft: Draft, result: VerifyResult, rng: np.random.Generator) -> int:
    """Sample from r_k ∝ max(0, p_k - q_k), split into the part outside S_k (mass c_k,
    represented by the target's sample y_k) and the part on S_k."""
    ids = draft.support_ids[k]
    valid = ids >= 0
    p = np.where(valid, result.support_probs[k], 0.0).astype(np.float64)
    q = np.where(valid, draft.support_probs[k], 0.0).astype(np.float64)
    w = np.maximum(p - q, 0.0)  # residual mass on the support
    c = float(result.complement[k]) if result.residual[k] >= 0 else 0.0
    total = c + w.sum()
    if total <= 0.0:
        # Only reachable through rounding (p == q on S_k and c == 0 means rejection had
        # probability 0); fall back to p restricted to S_k, which is then the target.
        w, total = p, p.sum()
    v = rng.random() * total
    if v < c:
        return int(result.residual[k])
    j = int(np.searchsorted(np.cumsum(w), v - c, side="right"))
    return int(ids[min(j, len(ids) - 1)])


def sample_verify(
    draft: Draft, result: VerifyResult, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Temperature > 0: exact rejection sampling. Returns (committed tokens, number accepted)."""
    out: list[int] = []
    for k, x in enumerate(draft.tokens):
        row = draft.support_ids[k]
        j = int(np.nonzero(row == x)[0][0])  # the drafted token is always in its own support
        q_x = float(draft.support_probs[k, j])
        p_x = float(result.support_probs[k, j])
        if rng.random() * q_x < p_x:  # u < p/q without dividing by a tiny q
            out.append(int(x))
            continue
        out.append(_residual_token(k, draft, result, rng))
        return out, k
    out.append(int(result.residual[len(draft.tokens)]))  # bonus ~ p_{K+1}
    return out, len(draft.tokens)
