"""What a round asks a drafter and what it answers: a sequence's id between the parts, the
draft request (ProposeRequest: the context the drafter has not seen, then what to draft) and
a drafted block (Draft: a chain, a tree, or blocks as one tree).

Numpy only (no torch): every part imports these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A sequence's id between the parts: the drafter's key for its context. Triton's correlation id
# (Sequence.handle) is the target's own name for it.
SeqId = str
TOP_M = 4  # proposal support per slot when sampling: q_k on the drafter's top-m tokens


@dataclass
class ProposeRequest:
    """One sequence's part of a batched draft call: the context the drafter has not seen yet,
    then what to draft after the anchor. THE draft request, in process and on the wire
    (flashmap.wire: ask_to_proto / ask_from_proto); flashmap.draft_call answers it."""

    seq_id: SeqId
    anchor: int  # last committed token; it sits at position context_start + len(new_tokens)
    temperature: float = 0.0  # 0: greedy proposals (support = {x_k}); > 0: sample from top-m
    top_m: int = TOP_M  # support size when sampling
    seed: int = 0  # seeds the flow noise and the proposal sampling
    draft_steps: int | None = None  # None: the proposer's step count (Proposer.steps)
    max_draft_tokens: int | None = None  # the block is cut to this many tokens; None: whole
    blocks: int = 1  # blocks from independent noise (a tree when > 1)
    context_start: int = 0  # position of new_tokens[0]: where the drafter's context must stand
    new_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [m]
    # [m, F] numpy, a device tensor, or a list of row pieces (Proposer.extend_many's Features)
    new_features: object = None


@dataclass
class Draft:
    """One proposed block: a chain of K tokens, or (greedy only) a tree of K tokens whose
    `parents` [K] index earlier tokens of the draft (-1: the anchor), parents before children.
    Greedy drafting: support_ids[:, 0] = tokens, probs 1."""

    tokens: np.ndarray  # [K] int64
    support_ids: np.ndarray  # [K, S] int64, -1 = padding
    support_probs: np.ndarray  # [K, S] float32, q_k(s); sum over S is 1 per slot
    draft_steps: int = 0  # the step count that drafted it (0: not reported)
    parents: np.ndarray | None = None  # [K] int64 for a tree; None: a chain
    # A tree whose support_probs are each draft's proposal law (Draft.forest): verified by
    # multi-draft rejection sampling at T > 0. False: a tree of fixed drafts.
    proposal_law: bool = False

    @staticmethod
    def greedy(tokens: np.ndarray, draft_steps: int = 0) -> Draft:
        tokens = np.asarray(tokens, np.int64)
        return Draft(
            tokens, tokens[:, None].copy(), np.ones((len(tokens), 1), np.float32), draft_steps
        )

    @staticmethod
    def tree(tokens: np.ndarray, parents: np.ndarray, draft_steps: int = 0) -> Draft:
        """A greedy tree draft (parents[i] < i; -1: a child of the anchor)."""
        d = Draft.greedy(tokens, draft_steps)
        d.parents = np.asarray(parents, np.int64)
        return d

    @staticmethod
    def merged(blocks: list[np.ndarray], draft_steps: int = 0) -> Draft:
        """Greedy blocks drafted after one anchor as one tree: a shared prefix is one path
        (a trie), so the tree has at most the blocks' tokens together."""
        tokens, parents, node = [], [], {}
        for b in blocks:
            parent = -1
            for t in np.asarray(b, np.int64).tolist():
                key = (parent, t)
                if key not in node:
                    node[key] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = node[key]
        return Draft.tree(np.array(tokens, np.int64), np.array(parents, np.int64), draft_steps)

    @staticmethod
    def forest(blocks: list[Draft], draft_steps: int = 0) -> Draft:
        """Blocks drafted after one anchor as one tree in which each block is a chain of its
        own (no shared prefix is merged), with each draft's proposal law: what multi-draft
        rejection sampling needs (every draft drawn from its own q, given its block's
        randomness; target_service.tree)."""
        S = max(b.support_ids.shape[1] for b in blocks)
        pad = lambda a, v: np.pad(a, ((0, 0), (0, S - a.shape[1])), constant_values=v)  # noqa: E731
        parents, at = [], 0
        for b in blocks:
            parents += [-1, *range(at, at + len(b.tokens) - 1)]
            at += len(b.tokens)
        return Draft(
            np.concatenate([b.tokens for b in blocks]).astype(np.int64),
            np.concatenate([pad(b.support_ids, -1) for b in blocks]),
            np.concatenate([pad(b.support_probs, 0.0) for b in blocks]).astype(np.float32),
            draft_steps,
            np.array(parents, np.int64),
            proposal_law=True,
        )

    def with_siblings(self, max_depth: int = 0) -> Draft:
        """This draft (a chain or a forest with its proposal law) with, beside each drafted
        token, the rest of its slot's support as leaves (after every drafted token), each with
        the law that puts all its mass on it: multi-draft rejection sampling then tries the
        drafted token with its q first and, where the target rejects it, the other support
        tokens, so a node accepts with the target's whole mass on its support (not
        sum min(p, q)). Exact: each leaf is a function of the children before it
        (target_service.tree). max_depth > 0: leaves beside the first max_depth depths only."""
        K = len(self.tokens)
        parents = np.array([-1, *range(K - 1)], np.int64) if self.parents is None else self.parents
        depth = node_depths(parents)
        tokens, par, ids, probs = [self.tokens], [parents], [self.support_ids], [self.support_probs]
        for i in range(K):
            if max_depth and depth[i] > max_depth:
                continue
            extra = [int(t) for t in self.support_ids[i] if t >= 0 and t != self.tokens[i]]
            if not extra:
                continue
            tokens.append(np.array(extra, np.int64))
            par.append(np.full(len(extra), parents[i], np.int64))
            one = np.full((len(extra), self.support_ids.shape[1]), -1, np.int64)
            one[:, 0] = extra
            p = np.zeros(one.shape, np.float32)
            p[:, 0] = 1.0
            ids.append(one)
            probs.append(p)
        return Draft(
            np.concatenate(tokens),
            np.concatenate(ids),
            np.concatenate(probs),
            self.draft_steps,
            np.concatenate(par),
            proposal_law=True,
        )

    @property
    def depth(self) -> int:
        """The longest path a round can accept: K for a chain, the tree's depth for a tree."""
        if self.parents is None:
            return len(self.tokens)
        return int(node_depths(self.parents).max(initial=0))

    def truncate(self, k: int) -> Draft:
        """The first k tokens (of a tree: still a tree, since parents come first)."""
        return Draft(
            self.tokens[:k],
            self.support_ids[:k],
            self.support_probs[:k],
            self.draft_steps,
            None if self.parents is None else self.parents[:k],
            self.proposal_law,
        )


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Each node's depth [K] in a tree whose parents come first (-1: the anchor; its children
    are at depth 1)."""
    depth = np.zeros(len(parents), np.int64)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return depth
