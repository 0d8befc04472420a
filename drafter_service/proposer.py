"""The proposer interface every drafter implements (FlashMap, DFlash-style, EAGLE-style, test oracle).

A proposer keeps per-sequence context: the token ids and target features of the
committed positions, appended in order as rounds commit. `propose` drafts a block of
`block_size` tokens after each sequence's anchor (the last committed token, whose
features are not known yet: the context is strictly before the anchor).

The interface is complete: callers (the drafter service, the in-process runtime) never
probe for optional methods. Defaults here are what a drafter without the feature does.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from flashmap.drafts import Draft, ProposeRequest
from flashmap.types import DRAFT_STEPS

# Features of new context positions: a numpy array, a torch tensor on any device, or a list of
# row pieces of either (the in-process runtime hands the engine's device tensors over as they are).
Features = Any


class Proposer(abc.ABC):
    block_size: int
    feature_dim: int  # width of the target features `extend` takes
    steps: int = (
        DRAFT_STEPS  # the draft_steps of a request without its own (a chain drafter ignores it)
    )
    max_blocks: int = 1  # blocks per request `propose_blocks` can draw from independent noise

    @abc.abstractmethod
    def extend_many(self, items: list[tuple[str, np.ndarray, Features]]) -> dict[str, Exception]:
        """Append committed positions of several sequences in one pass: (seq_id, token_ids [m]
        int64, features [m, F] of the target's layers, or [m, D] already projected by the target
        (flashmap.drafter_inputs), as numpy, a tensor on any device or a list of row pieces).
        Returns the sequences refused, with why; nothing is written for them."""

    def extend(self, seq_id: str, token_ids: np.ndarray, features: Features) -> None:
        """One sequence's new positions (extend_many of one); raises what refuses it."""
        if err := self.extend_many([(seq_id, token_ids, features)]).get(seq_id):
            raise err

    @abc.abstractmethod
    def propose(
        self, requests: list[ProposeRequest], draft_steps: int | None = None
    ) -> list[Draft]:
        """One batched draft: a block per request, in request order. draft_steps: this call's
        step count (None: self.steps); a request's own draft_steps overrides it."""

    @abc.abstractmethod
    def release(self, seq_id: str) -> None:
        """Forget a sequence (finish, cancel, idle timeout). Unknown ids are ignored."""

    def propose_blocks(
        self, requests: list[ProposeRequest], draft_steps: int | None = None, n_blocks: int = 1
    ) -> list[list[Draft]]:
        """n_blocks blocks per request from independent noise (block 0 = `propose`'s), for tree
        verification; at most `max_blocks`."""
        if n_blocks > self.max_blocks:
            raise ValueError(
                f"{type(self).__name__} drafts at most {self.max_blocks} block(s) per request, "
                f"asked for {n_blocks}"
            )
        return [[d] for d in self.propose(requests, draft_steps)]

    def draft(self, requests: list[ProposeRequest], n_blocks: int = 1) -> list[list[Draft]]:
        """What the serving runtimes call (the drafter service, flashmap.inprocess): each
        request's n_blocks blocks, cut to its max_draft_tokens (the one place drafts are cut;
        the round loop trusts them)."""
        out = self.propose_blocks(requests, None, n_blocks)
        return [
            ds if r.max_draft_tokens is None else [d.truncate(r.max_draft_tokens) for d in ds]
            for r, ds in zip(requests, out)
        ]

    def set_steps(self, n: int) -> None:
        """Run-time switch of the default step count (takes effect at the next propose); n was
        checked where it came in (flashmap.types.check_draft_steps)."""
        self.steps = int(n)

    @property
    def available_steps(self) -> tuple[int, ...] | None:
        """Step counts this proposer can run now (captured CUDA graphs); None: any."""
        return None

    @property
    def bytes_per_context_token(self) -> int:
        """State bytes one context position takes (0: not reported)."""
        return 0

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll a sequence's context back to `length` positions (a resend after a lost reply)."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll a sequence back")

    def context_length(self, seq_id: str) -> int:
        """Committed positions held for seq_id (0 if unknown)."""
        return 0

    def enable_graphs(self, steps: tuple[int, ...] = (1, 2)) -> dict:
        """Capture CUDA graphs of the drafting pass (CUDA only). Returns a report."""
        return {"graphs": 0, "reason": f"{type(self).__name__} has no CUDA-graph path"}

    def enable_compile(self, steps: tuple[int, ...] = (1,), warmup: bool = True) -> dict:
        """torch.compile the drafting pass (the CPU counterpart of CUDA graphs). Returns a report."""
        return {"compiled": False, "reason": f"{type(self).__name__} has no compiled path"}
