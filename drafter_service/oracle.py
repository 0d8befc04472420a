"""A test / benchmark drafter that proposes the target's own greedy continuation.

Given reference sequences (prompt + the target's greedy output), it proposes the next K
tokens of the reference that the sequence's committed tokens + anchor are a prefix of,
so at temperature 0 every draft is accepted, except where it injects errors: at each
1-based slot in error_slots, and at each slot with probability error_rate (seeded by
the oracle seed, the request seed and the position, so it does not depend on batching),
the token is replaced by (tok + 1) % V and rejection happens exactly there. With no
matching reference (or past its end) it proposes token 0. Drafts are greedy (q = 1); with
`support` > 1, at T > 0 each slot's support also holds the next support - 1 ids after its token
(q still all on the token): the ids a siblings tree sets beside it (flashmap.drafts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from drafter_service.proposer import Proposer
from flashmap.drafts import Draft, ProposeRequest
from flashmap.types import BLOCK_SIZE


class OracleProposer(Proposer):
    max_blocks = 64  # block b > 0 draws its own random errors

    def __init__(
        self,
        references: Sequence[Sequence[int]],
        block_size: int = BLOCK_SIZE,
        vocab_size: int | None = None,
        error_slots: Sequence[int] = (),
        error_rate: float = 0.0,
        seed: int = 0,
        feature_dim: int = 0,
        support: int = 1,
    ):
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"vocab_size is required (>= 1), got {vocab_size}")
        bad = [k for k in error_slots if not 1 <= k <= block_size]
        if bad:
            raise ValueError(f"error_slots are 1-based slots in 1..{block_size}, got {bad}")
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.references = [np.asarray(r, np.int64) for r in references]
        self.block_size, self.vocab_size = block_size, vocab_size
        self.error_slots = sorted(set(error_slots))
        self.error_rate, self.seed = error_rate, seed
        self.support = max(1, min(support, vocab_size))
        self.feature_dim = feature_dim  # features are accepted and ignored
        self.committed: dict[str, list[int]] = {}
        self._match: dict[str, int] = {}  # seq_id -> index of the last matching reference

    def extend_many(self, items) -> dict[str, Exception]:
        for seq_id, token_ids, _ in items:  # features are ignored
            self.committed.setdefault(seq_id, []).extend(
                int(t) for t in np.asarray(token_ids).reshape(-1)
            )
        return {}

    def truncate(self, seq_id: str, n: int) -> None:
        """Keep only the first n committed tokens."""
        if seq_id in self.committed:
            del self.committed[seq_id][n:]

    def release(self, seq_id: str) -> None:
        self.committed.pop(seq_id, None)
        self._match.pop(seq_id, None)

    def context_length(self, seq_id: str) -> int:
        return len(self.committed.get(seq_id, ()))

    def _find(self, seq_id: str, prefix: np.ndarray) -> np.ndarray | None:
        """The reference that starts with prefix (the last match is tried first)."""
        order = list(range(len(self.references)))
        last = self._match.get(seq_id)
        if last is not None:
            order.insert(0, last)
        for i in order:
            ref = self.references[i]
            if len(ref) >= len(prefix) and np.array_equal(ref[: len(prefix)], prefix):
                self._match[seq_id] = i
                return ref
        return None

    def propose(
        self, requests: list[ProposeRequest], draft_steps: int | None = None
    ) -> list[Draft]:
        return [blocks[0] for blocks in self.propose_blocks(requests, draft_steps)]

    def propose_blocks(
        self, requests: list[ProposeRequest], draft_steps: int | None = None, n_blocks: int = 1
    ) -> list[list[Draft]]:
        """n_blocks per request (tree verification); block b > 0 draws its own random errors."""
        return [[self._propose(r, b) for b in range(n_blocks)] for r in requests]

    def _propose(self, r: ProposeRequest, block: int) -> Draft:
        K = self.block_size
        prefix = np.asarray(self.committed.get(r.seq_id, []) + [int(r.anchor)], np.int64)
        n = len(prefix)
        tokens = np.zeros(K, np.int64)
        ref = self._find(r.seq_id, prefix)
        if ref is not None:
            nxt = ref[n : n + K]
            tokens[: len(nxt)] = nxt
        wrong = np.zeros(K, bool)
        wrong[[k - 1 for k in self.error_slots]] = True
        if self.error_rate > 0:
            rng = np.random.default_rng(
                [self.seed & 0xFFFFFFFF, r.seed & 0xFFFFFFFF, n] + ([block] if block else [])
            )
            wrong |= rng.random(K) < self.error_rate
        tokens[wrong] = (tokens[wrong] + 1) % self.vocab_size
        d = Draft.greedy(tokens)
        if r.temperature > 0 and self.support > 1:
            d.support_ids = (tokens[:, None] + np.arange(self.support)) % self.vocab_size
            d.support_probs = np.zeros(d.support_ids.shape, np.float32)
            d.support_probs[:, 0] = 1.0
        return d
