"""Records that cross part boundaries: target verify rows/results and drafter drafts.

Numpy only (no torch): the orchestrator imports these. Shapes use
K = number of draft tokens in a round (0 for prefill and autoregressive steps),
S = size of the drafter's explicit proposal support per slot, L = input tokens,
F = concatenated feature-layer width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class InvalidRequest(ValueError):
    """Bad user input; servers map it to INVALID_ARGUMENT, the CLI to a one-line error."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        return self


@dataclass
class VerifyRow:
    """One sequence's input to a target verify pass.

    tokens are written at positions start_pos .. start_pos+L-1 after the sequence's
    KV cache is truncated to start_pos. Statistics are returned for the last K+1
    positions, where K = len(support_ids): rows 0..K-1 check draft tokens
    tokens[L-K:], row K is the bonus position.
    """

    slot: int
    start_pos: int
    tokens: np.ndarray  # [L] int64
    params: SamplingParams
    support_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int64))  # [K, S], -1 = padding
    round_seed: int = 0  # seeds the target's residual / bonus samples for this row

    @property
    def num_draft(self) -> int:
        return int(self.support_ids.shape[0])


@dataclass
class VerifyResult:
    """Per-position verification statistics (DESIGN.md, exact sampling protocol)."""

    argmax: np.ndarray  # [K+1] int64, target argmax after the anchor and each draft token
    support_probs: np.ndarray  # [K, S] float32, p_k(s) for s in S_k (0 for padding); empty at T=0
    complement: np.ndarray  # [K] float32, c_k = 1 - sum_s p_k(s); empty at T=0
    residual: np.ndarray  # [K+1] int64, y_k ~ p_k outside S_k (row K: bonus ~ p_{K+1}); -1 if none
    features: np.ndarray  # [L, F] float32, feature-layer hidden states of every input position


@dataclass
class Draft:
    """One proposed block. Greedy drafting: support_ids[:, 0] = tokens, probs 1."""

    tokens: np.ndarray  # [K] int64
    support_ids: np.ndarray  # [K, S] int64, -1 = padding
    support_probs: np.ndarray  # [K, S] float32, q_k(s); sum over S is 1 per slot

    @staticmethod
    def greedy(tokens: np.ndarray) -> "Draft":
        tokens = np.asarray(tokens, np.int64)
        return Draft(tokens, tokens[:, None].copy(), np.ones((len(tokens), 1), np.float32))

    def truncate(self, k: int) -> "Draft":
        return Draft(self.tokens[:k], self.support_ids[:k], self.support_probs[:k])


def feature_layers_for(num_layers: int, count: int = 5) -> list[int]:
    """Evenly spaced layers from 1 to N-3 (36 layers -> 1, 9, 17, 25, 33).

    Layer l means the output of decoder layer l (0-based), i.e. HF hidden_states[l+1].
    Small targets get fewer, distinct layers.
    """
    hi = max(num_layers - 3, 0)
    lo = min(1, hi)
    return sorted({int(round(x)) for x in np.linspace(lo, hi, count)})
