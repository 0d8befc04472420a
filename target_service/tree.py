"""Tree verification's layout: several draft blocks after one anchor in one forward pass.

The row is the sequence's ordinary round, [.., anchor, d_1..d_K] (branch 0); branches are
more blocks of K tokens drafted after the same anchor. They are written after the row at
their own cache indices, with RoPE at their positions in the sequence and a tree mask (each
sees the context, the anchor and its own prefix), so every branch gets the logits a plain
verify of it would get. The branch with the longest prefix equal to the target's argmax
wins (the first on ties); its K/V entries move to the row's draft positions
(TargetEngine.verify_tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmap.types import VerifyRow


@dataclass
class TreeLayout:
    tokens: np.ndarray  # [total] int64: the row's tokens, then every branch
    seq_pos: np.ndarray  # [total] position in the sequence (RoPE)
    cache_pos: np.ndarray  # [total] cache index each token's K/V are written at
    mask: np.ndarray  # [total, start_pos + total] bool: the cache entries each query sees
    want: np.ndarray  # [total] bool: positions that need logits (the anchor and every branch)
    anchor: int  # the anchor's position


def tree_layout(row: VerifyRow, blocks: list[np.ndarray]) -> TreeLayout:
    K, n = row.num_draft, len(row.tokens)
    total = n + K * len(blocks)
    anchor = row.start_pos + n - K - 1
    seq_pos = np.concatenate(
        [row.start_pos + np.arange(n)] + [anchor + 1 + np.arange(K)] * len(blocks)
    )
    cache_pos = row.start_pos + np.arange(total)
    # Visible: cache indices up to the anchor, then the query's own branch up to itself.
    branch_start = np.concatenate(
        [np.full(n, anchor + 1)]
        + [np.full(K, row.start_pos + n + i * K) for i in range(len(blocks))]
    )
    j = np.arange(row.start_pos + total)
    mask = (j[None] <= cache_pos[:, None]) & (
        (j[None] <= anchor) | (j[None] >= branch_start[:, None])
    )
    want = np.zeros(total, bool)
    want[n - K - 1 :] = True  # the anchor, branch 0 and the other branches
    tokens = np.concatenate([row.tokens, *blocks])
    return TreeLayout(tokens, seq_pos, cache_pos, mask, want, anchor)


def best_branch(
    top: np.ndarray, row: VerifyRow, blocks: list[np.ndarray]
) -> tuple[np.ndarray, int, np.ndarray]:
    """From the argmax at the wanted positions, top [1 + K * (1 + len(blocks))]: the winning
    branch's argmax [K + 1], its index, and the indices into the tree's tokens that stay (the
    row's tokens up to the anchor, then the winner's block)."""
    K, n = row.num_draft, len(row.tokens)
    drafts = [row.tokens[n - K :], *blocks]
    argmax = [
        np.concatenate([top[:1], top[1 + i * K : 1 + (i + 1) * K]]) for i in range(len(drafts))
    ]
    accepted = [int(np.cumprod(d == a[:K]).sum()) for d, a in zip(drafts, argmax)]
    best = int(np.argmax(accepted))
    keep = (
        np.concatenate([np.arange(n - K), n + (best - 1) * K + np.arange(K)])
        if best
        else np.arange(n)
    )
    return argmax[best], best, keep


def move_kv(model, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's cached K/V of `slot` from cache indices src to dst."""
    for layer in model.model.layers:
        c = layer.self_attn.kv_cache
        c.k[slot, :, dst] = c.k[slot, :, src]
        c.v[slot, :, dst] = c.v[slot, :, src]
