"""Drafts from per-slot logits: the proposal rule every block drafter shares.

Greedy rows (temperature 0) propose each slot's argmax (support {x_k}, q = 1). Sampling rows
propose x_k ~ q_k = softmax(logits_k / T) restricted to its top-m tokens and renormalised;
the support sent to the target is those m ids with their q (docs/ARCHITECTURE.md, exact speculative
sampling). The sample comes from the request's own CPU generator, so a seeded request drafts
the same block whatever it is batched with.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flashmap.drafts import Draft


def block_drafts(
    logits: Tensor,
    temperatures: list[float],
    top_ms: list[int],
    gens: list[torch.Generator],
    greedy_ids: Tensor | None = None,
    keep: np.ndarray | None = None,
) -> list[Draft]:
    """One Draft per row of logits [B, K, V]. greedy_ids [B, K]: the argmax when the caller
    has it already; keep [B]: greedy rows keep only their first keep[b] slots."""
    B, K, V = logits.shape
    ids = (logits.argmax(-1) if greedy_ids is None else greedy_ids).cpu().numpy()  # [B, K]
    keep = np.full(B, K) if keep is None else keep
    if all(t == 0 for t in temperatures):
        return [Draft.greedy(g[:n]) for g, n in zip(ids, keep)]
    m_max = min(max([m for m, t in zip(top_ms, temperatures) if t > 0] + [1]), V)
    top_logits, top_ids = (x.cpu() for x in logits.topk(m_max, dim=-1))  # [B, K, m_max]
    out = []
    for b in range(B):
        if temperatures[b] == 0:
            out.append(Draft.greedy(ids[b][: keep[b]]))
            continue
        m = min(top_ms[b], V)
        q = (top_logits[b, :, :m].double() / temperatures[b]).softmax(-1)  # [K, m], topk order
        pick = torch.multinomial(q, 1, generator=gens[b])[:, 0]  # [K]
        sup = top_ids[b, :, :m]
        tokens = sup.gather(1, pick[:, None])[:, 0]
        out.append(
            Draft(tokens.numpy().astype(np.int64), sup.numpy().astype(np.int64), q.float().numpy())
        )
    return out
