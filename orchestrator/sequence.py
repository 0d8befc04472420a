"""One request's decoding state and round logic, shared by the server and the in-process decoder.

A sequence alternates: (prefill) -> [draft -> verify -> commit]*. Positions: the target
KV cache holds every committed token except the newest one, the anchor, which sits at
position len(tokens) - 1 and is written by the next verify. The drafter's context is
every position strictly before the anchor. With no draft a round is one
autoregressive step (the bonus token is the next token), so the autoregressive
baseline and the drafter-down fallback run through the same code.

Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashmap.types import Draft, InvalidRequest, SamplingParams, VerifyResult, VerifyRow
from orchestrator.rejection_sampler import greedy_verify, sample_verify


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    draft_steps: int | None = None  # None: the drafter's current step count
    request_id: str = ""

    def validate(self, vocab_size: int, max_seq_len: int) -> None:
        """Raise InvalidRequest with a one-line message for anything a server must refuse."""
        if len(self.prompt_ids) == 0:
            raise InvalidRequest("prompt is empty")
        bad = [t for t in self.prompt_ids if not (0 <= int(t) < vocab_size)]
        if bad:
            raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if self.max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if len(self.prompt_ids) >= max_seq_len:
            raise InvalidRequest(f"prompt has {len(self.prompt_ids)} tokens; the context holds {max_seq_len}")
        if len(self.prompt_ids) + self.max_new_tokens > max_seq_len:
            raise InvalidRequest(
                f"prompt ({len(self.prompt_ids)}) + max_new_tokens ({self.max_new_tokens}) exceeds the context ({max_seq_len})"
            )
        if self.draft_steps is not None and self.draft_steps < 1:
            raise InvalidRequest(f"draft_steps must be >= 1, got {self.draft_steps}")
        self.params.validate()


@dataclass
class SequenceStats:
    block_size: int
    rounds: int = 0  # verify passes after prefill
    drafts: int = 0  # rounds that verified a draft
    draft_tokens: int = 0
    accepted: int = 0
    fallback_rounds: int = 0
    accepted_per_slot: np.ndarray = None  # [block_size] how often slot k (0-based) was accepted

    def __post_init__(self):
        if self.accepted_per_slot is None:
            self.accepted_per_slot = np.zeros(self.block_size, np.int64)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per drafted round (gamma), DESIGN.md's definition."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0


class Sequence:
    def __init__(self, seq_id: int, request: GenerationRequest, block_size: int):
        self.seq_id = seq_id
        self.request = request
        self.params = request.params
        self.block_size = block_size
        self.tokens: list[int] = [int(t) for t in request.prompt_ids]
        self.n_prompt = len(self.tokens)
        self.prefilled = False
        self.finish_reason: str | None = None
        # Entropy when no seed: a request with a seed is reproducible, one without is not.
        self.rng = np.random.default_rng(request.params.seed)
        self.stats = SequenceStats(block_size)
        # Committed positions the drafter has not been sent yet: (token ids, features).
        self.pending_context: list[tuple[np.ndarray, np.ndarray]] = []
        self._stop = set(request.stop_token_ids)
        self.last_round = (0, 0)

    # -- state -----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    def draft_budget(self) -> int:
        """Most draft tokens this round may carry (commits stay within max_new_tokens)."""
        if not self.prefilled:
            return 0
        left = self.request.max_new_tokens - len(self.generated) - 1
        return max(0, min(self.block_size, left))

    def draft_seed(self) -> int:
        return int(self.rng.integers(2**62))

    def take_pending_context(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Pop the committed (token ids [m], features [m, F]) the drafter has not seen."""
        if not self.pending_context:
            return None
        ids = np.concatenate([c[0] for c in self.pending_context])
        feats = np.concatenate([c[1] for c in self.pending_context])
        self.pending_context.clear()
        return ids, feats

    # -- one round -------------------------------------------------------------
    def verify_row(self, draft: Draft | None, slot: int = -1) -> VerifyRow:
        """The target input of this round: the prompt at prefill, else [anchor, d_1..d_K]."""
        round_seed = int(self.rng.integers(2**62))
        if not self.prefilled:
            return VerifyRow(slot, 0, np.asarray(self.tokens, np.int64), self.params, round_seed=round_seed)
        if draft is None or len(draft.tokens) == 0:
            support = np.zeros((0, 1), np.int64)
            toks = np.asarray([self.anchor], np.int64)
        else:
            support = draft.support_ids
            toks = np.concatenate([[self.anchor], draft.tokens]).astype(np.int64)
        return VerifyRow(slot, len(self.tokens) - 1, toks, self.params, support, round_seed)

    def commit(self, row: VerifyRow, draft: Draft | None, result: VerifyResult) -> list[int]:
        """Apply rejection sampling to a verify result; return the newly committed tokens."""
        k = row.num_draft
        if k == 0:
            new, n_acc = [int(result.argmax[-1] if self.params.greedy else result.residual[-1])], 0
        elif self.params.greedy:
            new, n_acc = greedy_verify(draft.tokens, result.argmax)
        else:
            new, n_acc = sample_verify(draft, result, self.rng)
        # Positions now in the target's cache and final: the row's tokens up to the last accepted.
        n_ctx = len(row.tokens) - k + n_acc
        self.pending_context.append((row.tokens[:n_ctx], result.features[:n_ctx]))
        self.last_round = (k, n_acc)  # (draft tokens, accepted) for metrics
        if self.prefilled:
            self.stats.rounds += 1
            if k:
                self.stats.drafts += 1
                self.stats.draft_tokens += k
                self.stats.accepted += n_acc
                self.stats.accepted_per_slot[:n_acc] += 1
        self.prefilled = True
        return self._append(new)

    def _append(self, new: list[int]) -> list[int]:
        """Append tokens, stopping at a stop id (kept) or max_new_tokens."""
        out = []
        for t in new:
            out.append(t)
            self.tokens.append(t)
            if t in self._stop:
                self.finish_reason = "stop"
                break
            if len(self.generated) >= self.request.max_new_tokens:
                self.finish_reason = "length"
                break
        return out

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"
