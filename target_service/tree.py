"""Tree verification: a row whose K drafted tokens form a tree (VerifyRow.parents), in one
forward pass.

The row's tokens, [.., anchor, d_1..d_K], are written at their usual cache indices; draft i
sits at RoPE position anchor + depth(i) and, through a tree mask, sees the context up to the
anchor, its ancestors and itself, so it gets the logits a plain verify of its path would give.
The accepted path is walked from the anchor: at each node the target picks its own token (the
argmax at T = 0; at T > 0 a sample of its distribution after temperature, top-k and top-p,
Gumbel-max with noise seeded by the row's round seed and the node's depth) and moves to the
child that carries it; where no child does, the picked token is the one the round commits
after the path. Every committed token is the target's own choice, so the output law is the
target's whatever the drafts are, as long as they do not depend on the target's noise (drafts
fixed given the drafter's own randomness: blocks from independent noise, argmax blocks,
EAGLE's top-k tree). The path's K/V entries move to its own positions (anchor + 1, ...), so the
cache is as after a plain verify of that path, and the result is that path's: the picked
tokens along it (argmax, and at T > 0 the samples as `residual`) and the features of the
positions up to its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmap.types import VerifyResult, VerifyRow
from target_service.verification import argmax_ids, exponential_noise, process_logits


@dataclass
class TreeLayout:
    seq_pos: np.ndarray  # [L] position in the sequence (RoPE)
    cache_pos: np.ndarray  # [L] cache index each token's K/V are written at
    mask: np.ndarray  # [L, start_pos + L] bool: the cache entries each query sees
    want: np.ndarray  # [L] bool: positions that need logits (the anchor and every draft)
    anchor: int  # the anchor's cache index


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node (1: a child of the anchor); parents come before their children."""
    d = np.zeros(len(parents), np.int64)
    for i, p in enumerate(parents):
        d[i] = 1 if p < 0 else d[p] + 1
    return d


def tree_layout(row: VerifyRow) -> TreeLayout:
    K, n = row.num_draft, len(row.tokens)
    anchor = row.start_pos + n - K - 1
    cache_pos = row.start_pos + np.arange(n)
    seq_pos = cache_pos.copy()
    seq_pos[n - K :] = anchor + depths(row.parents)
    # Ancestors (and self) of each draft, as cache indices.
    seen = np.eye(K, dtype=bool)
    for i, p in enumerate(row.parents):
        if p >= 0:
            seen[i] |= seen[p]
    j = np.arange(row.start_pos + n)
    mask = j[None] <= cache_pos[:, None]  # causal: the row's prefix and the anchor
    mask[n - K :] = j[None] <= anchor
    mask[n - K :, anchor + 1 :] = seen
    want = np.zeros(n, bool)
    want[n - K - 1 :] = True
    return TreeLayout(seq_pos, cache_pos, mask, want, anchor)


def picks(logits: torch.Tensor, row: VerifyRow) -> np.ndarray:
    """[1 + K] the target's own token at the anchor and at each draft: its argmax at T = 0,
    else a sample of its adjusted distribution whose noise depends on the round seed and the
    node's depth only (a path is drawn as a chain of its length would be)."""
    if row.params.greedy:
        return argmax_ids(logits)
    p = row.params
    n = len(logits)
    probs = process_logits(logits, [p.temperature] * n, [p.top_k] * n, [p.top_p] * n)  # [1+K, V]
    depth = np.concatenate([[0], depths(row.parents)])  # [1+K]
    noise = exponential_noise(row.round_seed, (int(depth.max()) + 1, probs.shape[-1]), probs.device)
    return (probs / noise[torch.as_tensor(depth, device=probs.device)]).argmax(-1).cpu().numpy()


def accepted_path(top: np.ndarray, row: VerifyRow) -> tuple[np.ndarray, np.ndarray]:
    """From the target's pick at the anchor and each draft, top [1 + K]: the accepted path
    (draft indices) and the picks along it [len(path) + 1]."""
    K = row.num_draft
    drafts = row.tokens[len(row.tokens) - K :]
    path, node = [], -1
    while True:
        want = top[node + 1]
        child = next((i for i in range(K) if row.parents[i] == node and drafts[i] == want), None)
        if child is None:
            break
        path.append(child)
        node = child
    path = np.array(path, np.int64)
    return path, np.concatenate([top[:1], top[1 + path]])


def move_kv(model, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's cached K/V of `slot` from cache indices src to dst."""
    for layer in model.model.layers:
        c = layer.self_attn.kv_cache
        c.k[slot, :, dst] = c.k[slot, :, src]
        c.v[slot, :, dst] = c.v[slot, :, src]


def verify_tree(engine, row: VerifyRow) -> tuple[VerifyResult, np.ndarray]:
    """One validated tree row through the engine's model (TargetEngine.verify_tree): the
    accepted path's VerifyResult and the path."""
    K, n = row.num_draft, len(row.tokens)
    t = tree_layout(row)
    dev = engine._device
    try:
        with torch.inference_mode():
            logits, features = engine.model(
                torch.as_tensor(row.tokens, device=dev)[None],
                torch.as_tensor(t.seq_pos, device=dev)[None],
                torch.tensor([row.slot], device=dev),
                torch.ones(1, n, dtype=torch.bool, device=dev),
                torch.as_tensor(t.want, device=dev)[None],
                engine._feature_layers,
                row.start_pos + n,
                torch.as_tensor(t.cache_pos, device=dev)[None],
                torch.as_tensor(t.mask, device=dev)[None, None],
            )
    except BaseException:
        engine._length[row.slot] = min(engine._length[row.slot], row.start_pos)
        raise
    path, picked = accepted_path(picks(logits, row), row)
    a = len(path)
    src = torch.as_tensor(t.anchor + 1 + path, device=dev)
    move_kv(engine.model, row.slot, src, torch.arange(t.anchor + 1, t.anchor + 1 + a, device=dev))
    engine._length[row.slot] = row.start_pos + n - K + a
    keep = np.concatenate([np.arange(n - K), n - K + path])
    chain = VerifyRow(row.slot, row.start_pos, row.tokens[keep], row.params, features=row.features)
    (feats,) = engine._keep_features([chain], features.reshape(n, -1), [keep])
    sampled = not row.params.greedy
    result = VerifyResult(
        picked if not sampled else argmax_ids(logits)[np.concatenate([[0], 1 + path])],
        np.zeros((0, 1), np.float32),
        np.zeros(0, np.float32),
        picked if sampled else np.full(a + 1, -1, np.int64),
        feats,
    )
    return result, path
