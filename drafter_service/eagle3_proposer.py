"""Serving proposer of a published EAGLE-3 drafter (drafter_service.eagle3): EAGLE-2's dynamic
tree at every temperature, or a chain for sampling rows (`sampled_tree=False`).

Per sequence a slot in static caches of the layer's keys / values ([1, n_slots, kv,
max_context, d]) and of the fused features g ([n_slots, max_context, H]). Position p's key
needs the token at p + 1, so the caches hold keys for positions 0..L-2 of a context of L; the
last position runs with the anchor when drafting. `extend_many` writes every sequence's new
positions with one fc and one k/v projection (keys need no attention: one layer).

Tree: step 0 runs the last context position; each later step expands the
`top_k` best nodes so far (by the sum of their path's log-probabilities), each with its own
`top_k` children, attending to the context, the step-0 position and its ancestors; after
`depth` steps the `tree_tokens` best of all children are the draft, a tree closed under
parents (a child's score is at most its parent's). The tree is the same at every temperature
(it does not depend on the target's noise), so at T > 0 the target verifies it by picking its
own token at each node (target_service.tree), as SGLang verifies EAGLE's trees. With
`sampled_tree=False` sampling rows draft a chain of `tree_tokens` tokens instead, slot k drawn
from the top-m of the drafter's law given the drafted prefix, verified by exact speculative
sampling with that q (drafter_service.proposals' rule).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from drafter_service.cuda_graphs import BucketGraphs
from drafter_service.eagle3 import Eagle3Drafter
from drafter_service.flashmap_proposer import request_generator
from drafter_service.slots import SlotCacheProposer
from flashmap.drafts import Draft, ProposeRequest


class Eagle3Proposer(SlotCacheProposer):
    def __init__(
        self,
        model: Eagle3Drafter,
        n_slots: int = 64,
        max_context: int = 4096,
        device: str = "cpu",
        tree_tokens: int = 16,
        depth: int = 6,
        top_k: int = 4,
        sampled_tree: bool = True,
    ):
        c = model.cfg
        if not 1 <= top_k <= c.draft_vocab_size or depth < 1 or tree_tokens < 1:
            raise ValueError(
                f"need depth >= 1, tree_tokens >= 1 and 1 <= top_k <= the draft vocabulary, "
                f"got depth {depth}, tree_tokens {tree_tokens}, top_k {top_k}"
            )
        cache = (1, c.num_key_value_heads, c.head_dim)
        super().__init__(model, n_slots, max_context, device, cache, tree_tokens, c.hidden_size)
        self.depth, self.top_k, self.sampled_tree = depth, top_k, sampled_tree
        self.g_cache = torch.zeros(
            n_slots, max_context, c.hidden_size, dtype=self.k_cache.dtype, device=self.device
        )
        self.graphs: BucketGraphs | None = None  # after enable_graphs(): the tree search

    @property
    def bytes_per_context_token(self) -> int:
        c = self.cfg
        return (
            2 * c.num_key_value_heads * c.head_dim + c.hidden_size
        ) * self.k_cache.element_size()

    def _write_many(
        self, slots: Tensor, positions: Tensor, token_ids: np.ndarray, features: Tensor
    ) -> None:
        """g of every new position, then the key of every position whose next token is now
        known: the one before each new position (its token is that position's)."""
        g = features if features.shape[-1] != self.feature_dim else self.model.fuse(features)
        self.g_cache[slots, positions] = g.to(self.g_cache.dtype)
        has_prev = positions > 0
        ks, kp = slots[has_prev], positions[has_prev] - 1
        nxt = torch.from_numpy(token_ids).to(self.device)[has_prev]
        _, k, v = self.model.qkv(self.g_cache[ks, kp], nxt, kp)  # [N, kv, d]
        self.k_cache[0, ks, :, kp] = k.to(self.k_cache.dtype)
        self.v_cache[0, ks, :, kp] = v.to(self.v_cache.dtype)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(
        self, requests: list[ProposeRequest], draft_steps: int | None = None
    ) -> list[Draft]:
        """A tree per request, or with sampled_tree off a chain per sampling one (steps: accepted
        and ignored)."""
        for r in requests:
            if r.temperature < 0 or (r.temperature > 0 and r.top_m < 1):
                raise ValueError(f"request {r.seq_id!r}: need temperature >= 0 and top_m >= 1")
        out: list[Draft | None] = [None] * len(requests)
        chain = [r.temperature > 0 and not self.sampled_tree for r in requests]
        trees = [i for i, c in enumerate(chain) if not c]
        chains = [i for i, c in enumerate(chain) if c]
        if trees:
            for i, d in zip(trees, self._trees([requests[i] for i in trees])):
                out[i] = d
        if chains:
            for i, d in zip(chains, self._chains([requests[i] for i in chains])):
                out[i] = d
        return out

    def _rows(self, requests: list[ProposeRequest]) -> tuple[Tensor, Tensor, Tensor, int]:
        """anchor, cache slot and context length [B] of each request, and the longest context."""
        rows = [self.slots.lookup(r.seq_id) for r in requests]
        dev = self.device
        anchor = torch.tensor([int(r.anchor) for r in requests], device=dev)
        slot = torch.tensor([max(s, 0) for s, _ in rows], device=dev)
        lengths = torch.tensor([n for _, n in rows], device=dev)
        return anchor, slot, lengths, max(n for _, n in rows)

    def _start(self, slot: Tensor, lengths: Tensor, window: int, n_new: int):
        """Keys / values of the cached context (the first `window` positions, masked beyond each
        row's) with room for n_new drafted positions after them, and the step-0 inputs: the
        last context position p0 [B] and its fused features g0 [B, 1, H]."""
        p0 = (lengths - 1).clamp(min=0)  # the last context position, run with the anchor
        k = self.k_cache.new_zeros(
            slot.shape[0], self.cfg.num_key_value_heads, window + n_new, self.cfg.head_dim
        )
        v = torch.zeros_like(k)
        k[:, :, :window] = self.k_cache[0, slot, :, :window]
        v[:, :, :window] = self.v_cache[0, slot, :, :window]
        g0 = torch.where((lengths > 0)[:, None], self.g_cache[slot, p0], 0)[:, None]
        return k, v, p0, g0

    def _trees(self, requests: list[ProposeRequest]) -> list[Draft]:
        anchor, slot, lengths, longest = self._rows(requests)
        out = self.graphs.run(anchor, slot, lengths, longest) if self.graphs else None
        tokens, scores, parents = (
            x.cpu().numpy()
            for x in out or self._tree_search(anchor, slot, lengths, max(longest, 1))
        )
        return [_select(t, s, p, self.block_size) for t, s, p in zip(tokens, scores, parents)]

    def _tree_search(self, anchor: Tensor, slot: Tensor, lengths: Tensor, window: int):
        """EAGLE-2's dynamic tree on the device (no host read: CUDA graphs capture it): every
        candidate's token, path score and parent candidate [B, n_cand] (-1: the anchor)."""
        B, kk, D = anchor.shape[0], self.top_k, self.depth
        dev = self.device
        n_new = 1 + kk * (D - 1)  # scratch positions: step 0, then kk nodes per later step
        k, v, p0, g = self._start(slot, lengths, window, n_new)
        T = window + n_new
        key = torch.arange(T, device=dev)
        ctx_seen = key[None] < p0[:, None]  # [B, T]: cached context keys
        first = slice(window, window + 1)
        o, logp = self._step(
            k, v, g, anchor[:, None], p0[:, None], first, (ctx_seen | (key == window))[:, None]
        )
        score, tok = logp[:, 0].topk(kk, -1)  # [B, kk]
        cand_tok, cand_score, cand_parent = [tok], [score], [torch.full_like(tok, -1)]
        seen = (ctx_seen | (key == window))[:, None].expand(B, kk, T)  # each frontier node's keys
        front_tok, front_score, front_o = tok, score, o.expand(B, kk, -1)
        front_idx = torch.arange(kk, device=dev).expand(B, kk)  # candidate index of each node
        n_cand, nodes = kk, torch.arange(kk, device=dev)
        for i in range(1, D):
            at = window + 1 + (i - 1) * kk  # this step's key columns at..at+kk
            seen = seen.clone()
            seen[:, nodes, at + nodes] = True  # a node sees itself
            pos = (p0 + i)[:, None].expand(B, kk)
            o, logp = self._step(
                k, v, front_o, front_tok, pos, slice(at, at + kk), seen
            )  # [B, kk, H], [B, kk, V]
            child_score, child_tok = (front_score[..., None] + logp).topk(kk, -1)  # [B, kk, kk]
            cand_tok.append(child_tok.flatten(1))
            cand_score.append(child_score.flatten(1))
            cand_parent.append(front_idx[..., None].expand(B, kk, kk).flatten(1))
            best = child_score.flatten(1).topk(kk, -1).indices  # [B, kk] among kk * kk
            parent = best // kk
            front_tok = child_tok.flatten(1).gather(1, best)
            front_score = child_score.flatten(1).gather(1, best)
            front_o = o.gather(1, parent[..., None].expand(-1, -1, o.shape[-1]))
            seen = seen.gather(1, parent[..., None].expand(-1, -1, T))
            front_idx = n_cand + best
            n_cand += kk * kk
        return torch.cat(cand_tok, 1), torch.cat(cand_score, 1).float(), torch.cat(cand_parent, 1)

    def enable_graphs(self, steps: tuple[int, ...] = (1, 2), mode: str = "cuda", **buckets) -> dict:
        """Capture the tree search per (batch bucket, context bucket) (cuda_graphs.BucketGraphs);
        sampling rows draft chains eagerly."""
        self.graphs = BucketGraphs(
            self._tree_search, self.n_slots, self.max_context, self.device, mode=mode, **buckets
        )
        return self.graphs.capture()

    def _step(self, k, v, g, tok, pos, cols: slice, seen) -> tuple[Tensor, Tensor]:
        """One drafting step of n queries per row: hidden g [B, n, H], tokens / positions [B, n],
        their keys go to the n columns `cols` of k / v; seen [B, n, T] masks the keys.
        Returns the layer's output [B, n, H] and log-probs [B, n, Vd] mapped to target ids."""
        q, kn, vn = self.model.qkv(g, tok, pos)  # [B, n, h|kv, d]
        k[:, :, cols] = kn.transpose(1, 2)
        v[:, :, cols] = vn.transpose(1, 2)
        o = self.model.finish(g, q, k, v, seen[:, None])
        logp, ids = self.model.log_probs(o)
        full = logp.new_full((*logp.shape[:-1], self.vocab_size), float("-inf"))
        return o, full.index_copy_(-1, ids, logp)

    def _chains(self, requests: list[ProposeRequest]) -> list[Draft]:
        B, N, dev = len(requests), self.block_size, self.device
        anchor, slot, lengths, longest = self._rows(requests)
        W = max(longest, 1)
        k, v, p0, g = self._start(slot, lengths, W, N)
        key = torch.arange(W + N, device=dev)
        seen = (key[None] < p0[:, None])[:, None]  # [B, 1, T]
        tok = anchor[:, None]
        gens = [request_generator(r.seed) for r in requests]
        m_max = min(max(r.top_m for r in requests), self.vocab_size)
        tokens = np.zeros((B, N), np.int64)
        sup = np.full((B, N, m_max), -1, np.int64)
        q_sup = np.zeros((B, N, m_max), np.float32)
        for i in range(N):
            seen = seen | (key == W + i)[None, None]
            g, logp = self._step(k, v, g, tok, (p0 + i)[:, None], slice(W + i, W + i + 1), seen)
            top_l, top_i = (x.cpu() for x in logp[:, 0].topk(m_max, -1))
            for b, r in enumerate(requests):
                m = min(r.top_m, self.vocab_size)
                q = (top_l[b, :m].double() / r.temperature).softmax(-1)
                pick = int(torch.multinomial(q, 1, generator=gens[b])[0])
                tokens[b, i] = int(top_i[b, pick])
                sup[b, i, :m], q_sup[b, i, :m] = top_i[b, :m].numpy(), q.float().numpy()
            tok = torch.from_numpy(tokens[:, i : i + 1]).to(dev)
        return [
            Draft(tokens[b].copy(), sup[b, :, : r.top_m].copy(), q_sup[b, :, : r.top_m].copy())
            for b, r in enumerate(requests)
        ]


def _select(tokens: np.ndarray, scores: np.ndarray, parents: np.ndarray, n: int) -> Draft:
    """The n best candidates as a tree closed under parents, parents before children: a Draft
    whose `parents` index its own tokens (-1: the anchor)."""
    order = np.argsort(-scores, kind="stable")
    keep: set[int] = set()
    for c in order:
        if len(keep) >= n:
            break
        chain = []
        while c >= 0 and c not in keep:
            chain.append(int(c))
            c = parents[c]
        if len(keep) + len(chain) <= n:
            keep.update(chain)
    ids = sorted(keep)  # candidates are numbered level by level: parents come first
    where = {c: i for i, c in enumerate(ids)}
    par = np.array([where.get(int(parents[c]), -1) for c in ids], np.int64)
    return Draft.tree(tokens[ids].astype(np.int64), par)
