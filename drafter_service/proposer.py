"""The proposer interface every drafter implements (FlashMap, DFlash-style, test oracle).

A proposer keeps per-sequence context: the token ids and target features of the
committed positions, appended in order as rounds commit. `propose` drafts a block of
`block_size` tokens after each sequence's anchor (the last committed token, whose
features are not known yet: the context is strictly before the anchor).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from flashmap.types import Draft


@dataclass
class ProposeRequest:
    seq_id: str
    anchor: int  # last committed token; it sits at position len(context)
    temperature: float = 0.0  # 0: greedy proposals (support = {x_k}); > 0: sample from top-m
    top_m: int = 4  # support size when sampling
    seed: int = 0  # seeds the flow noise and the proposal sampling
    steps: int | None = None  # per-request override of the proposer's step count


class Proposer(abc.ABC):
    block_size: int

    @abc.abstractmethod
    def extend(self, seq_id: str, token_ids: np.ndarray, features: np.ndarray) -> None:
        """Append committed positions: token_ids [m] int64, features [m, F] float32."""

    @abc.abstractmethod
    def propose(self, requests: list[ProposeRequest], steps: int) -> list[Draft]:
        """One batched draft: a block per request, in request order."""

    @abc.abstractmethod
    def release(self, seq_id: str) -> None:
        """Forget a sequence (finish, cancel, idle timeout). Unknown ids are ignored."""

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll a sequence's context back to `length` positions (a resend after a lost reply)."""
        raise NotImplementedError

    def context_length(self, seq_id: str) -> int:
        """Committed positions held for seq_id (0 if unknown)."""
        return 0
