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
EAGLE's top-k tree). A row that carries its drafts' proposal law (VerifyRow.support_q: blocks
as chains of their own, each draft drawn from its own q; Draft.forest) is walked by multi-draft
rejection sampling instead (`_rejection_walk`). The path's K/V entries move to its own
positions (anchor + 1, ...), so the cache is as after a plain verify of that path, and the
result is that path's: the target's tokens along it (argmax, and at T > 0 its tokens as
`residual`) and the features of the positions up to its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmap.drafts import node_depths
from flashmap.types import VerifyResult, VerifyRow
from target_service.verification import (
    argmax_ids,
    exponential_noise,
    path_logprobs,
    process_logits,
)


@dataclass
class TreeLayout:
    seq_pos: np.ndarray  # [L] position in the sequence (RoPE)
    cache_pos: np.ndarray  # [L] cache index each token's K/V are written at
    mask: np.ndarray  # [L, start_pos + L] bool: the cache entries each query sees
    want: np.ndarray  # [L] bool: positions that need logits (the anchor and every draft)
    anchor: int  # the anchor's cache index


def tree_layout(row: VerifyRow) -> TreeLayout:
    K, n = row.num_draft, len(row.tokens)
    anchor = row.start_pos + n - K - 1
    cache_pos = row.start_pos + np.arange(n)
    seq_pos = cache_pos.copy()
    seq_pos[n - K :] = anchor + node_depths(row.parents)
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


def walk(logits: torch.Tensor, rows: list[VerifyRow]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row, its accepted path (draft indices) and the target's tokens along it [a + 1]
    (the last: the one committed after the path). logits: the rows' [1 + K, V] blocks back to
    back. T = 0: the argmax at each node, followed. T > 0 with fixed drafts: a sample of the
    target's adjusted distribution at each node (noise from the round seed and the node's
    depth only), followed. T > 0 with the drafts' proposal law (VerifyRow.support_q): multi-draft
    rejection sampling."""
    counts = [r.num_draft + 1 for r in rows]
    at = np.cumsum([0] + counts)
    top = argmax_ids(logits)
    picked = [top[at[i] : at[i + 1]] for i in range(len(rows))]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        index = torch.as_tensor(np.concatenate([np.arange(at[i], at[i + 1]) for i in sampled]))
        n = [counts[i] for i in sampled]
        per_position = lambda f: np.repeat([f(rows[i].params) for i in sampled], n)  # noqa: E731
        probs = process_logits(
            logits[index.to(logits.device)],
            per_position(lambda p: p.temperature),
            per_position(lambda p: p.top_k),
            per_position(lambda p: p.top_p),
        ).split(n)  # [1 + K, V] per sampled row
        for i, p in zip(sampled, probs):
            depth = np.concatenate([[0], node_depths(rows[i].parents)])  # [1 + K]
            noise = exponential_noise(
                rows[i].round_seed, (int(depth.max()) + 1, p.shape[-1]), p.device
            )
            if rows[i].support_q.size:
                picked[i] = _rejection_walk(rows[i], p, noise)
                continue
            picked[i] = (
                (p / noise[torch.as_tensor(depth, device=p.device)]).argmax(-1).cpu().numpy()
            )
    out = []
    for r, top_r in zip(rows, picked):
        out.append(top_r if isinstance(top_r, tuple) else accepted_path(top_r, r))
    return out


def _rejection_walk(row: VerifyRow, probs: torch.Tensor, noise: torch.Tensor):
    """Multi-draft rejection sampling down the tree (SpecInfer's, each draft with its own q):
    at a node the residual r starts as the target's distribution; each child in turn is
    accepted with probability min(1, r(x) / q(x)), else r <- norm(max(0, r - q)); the first
    accepted child is the next node, and where none is, the committed token is a sample of r.
    Exact when every draft is drawn from its q independently of the others given its block's
    randomness (Draft.forest). Uniforms from the round seed, apart from the Gumbel noise."""
    K, V = row.num_draft, probs.shape[-1]
    drafts = row.tokens[len(row.tokens) - K :]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(row.parents.tolist()):
        children.setdefault(p, []).append(i)
    D = int(node_depths(row.parents).max()) + 1
    seed = int(np.random.SeedSequence([int(row.round_seed) & (2**63 - 1), 1]).generate_state(1)[0])
    u = torch.rand((D, K), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    probs, noise = probs.double().cpu(), noise.cpu()
    path, node, d = [], -1, 0
    while True:
        r = probs[node + 1].clone()
        nxt = None
        for j, c in enumerate(children.get(node, [])):
            q = torch.zeros(V, dtype=torch.float64)
            ids = row.support_ids[c]
            q[torch.as_tensor(ids[ids >= 0])] = torch.as_tensor(
                row.support_q[c][ids >= 0], dtype=torch.float64
            )
            t = int(drafts[c])
            if u[d, j] * q[t] < r[t]:
                nxt = c
                break
            left = (r - q).clamp(min=0.0)
            if left.sum() > 0:  # (r = q leaves nothing, but then the child was accepted)
                r = left / left.sum()
        if nxt is None:
            final = int((r.float() / noise[d]).argmax())
            return np.array(path, np.int64), np.array([*drafts[path].tolist(), final], np.int64)
        path.append(nxt)
        node, d = nxt, d + 1


def accepted_path(top: np.ndarray, row: VerifyRow) -> tuple[np.ndarray, np.ndarray]:
    """From the target's pick at the anchor and each draft, top [1 + K]: the path that follows
    the picks (draft indices) and the picks along it [len(path) + 1]."""
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


def verify_trees(engine, rows: list[VerifyRow]) -> list[tuple[VerifyResult, np.ndarray]]:
    """Validated tree rows through the engine's model in one padded pass (TargetEngine.
    verify_trees): each row's accepted path's VerifyResult and the path."""
    layouts = [tree_layout(r) for r in rows]
    n = [len(r.tokens) for r in rows]
    B, L = len(rows), max(n)
    kv_len = max(r.start_pos + k for r, k in zip(rows, n))
    tokens, seq_pos, cache_pos = (np.zeros((B, L), np.int64) for _ in range(3))
    valid, want = np.zeros((B, L), bool), np.zeros((B, L), bool)
    mask = np.zeros((B, 1, L, kv_len), bool)
    mask[:, :, :, 0] = True  # padding queries see one key (their output is never read)
    for b, (r, t, k) in enumerate(zip(rows, layouts, n)):
        tokens[b, :k], seq_pos[b, :k], cache_pos[b, :k] = r.tokens, t.seq_pos, t.cache_pos
        valid[b, :k], want[b, :k] = True, t.want
        mask[b, 0, :k] = False
        mask[b, 0, :k, : r.start_pos + k] = t.mask
    dev = engine._device
    try:
        with torch.inference_mode():
            logits, features = engine.model(
                *(torch.as_tensor(x, device=dev) for x in (tokens, seq_pos)),
                torch.tensor([r.slot for r in rows], device=dev),
                *(torch.as_tensor(x, device=dev) for x in (valid, want)),
                engine._feature_layers,
                kv_len,
                torch.as_tensor(cache_pos, device=dev),
                torch.as_tensor(mask, device=dev),
            )
    except BaseException:
        for r in rows:
            engine._length[r.slot] = min(engine._length[r.slot], r.start_pos)
        raise
    logit_at = np.cumsum([0] + [r.num_draft + 1 for r in rows])  # [B + 1] into logits
    feature_at = np.cumsum([0] + n)  # [B + 1] into features
    top = argmax_ids(logits)
    out = []
    for b, (r, t, (path, picked)) in enumerate(zip(rows, layouts, walk(logits, rows))):
        argmax = top[logit_at[b] : logit_at[b + 1]][np.concatenate([[0], 1 + path])]
        row_features = features[feature_at[b] : feature_at[b + 1]]  # [n, F]
        logprobs = path_logprobs(logits[logit_at[b] : logit_at[b + 1]], r, path, picked)
        out.append((_result(engine, r, t, path, picked, argmax, row_features, logprobs), path))
    return out


def _result(
    engine, row: VerifyRow, t: TreeLayout, path, picked, argmax, features, logprobs
) -> VerifyResult:
    """Move the path's K/V to its own positions and answer for the path: the argmax and (at
    T > 0) the target's samples along it as `residual`, the features up to its end."""
    K, n, a = row.num_draft, len(row.tokens), len(path)
    dev = engine._device
    src = torch.as_tensor(t.anchor + 1 + path, device=dev)
    move_kv(engine.model, row.slot, src, torch.arange(t.anchor + 1, t.anchor + 1 + a, device=dev))
    engine._length[row.slot] = row.start_pos + n - K + a
    keep = np.concatenate([np.arange(n - K), n - K + path])
    chain = VerifyRow(row.slot, row.start_pos, row.tokens[keep], row.params, features=row.features)
    (feats,) = engine._keep_features([chain], features, [keep])
    sampled = not row.params.greedy
    return VerifyResult(
        argmax,
        np.zeros((0, 1), np.float32),
        np.zeros(0, np.float32),
        picked if sampled else np.full(a + 1, -1, np.int64),
        feats,
        *logprobs,
    )
