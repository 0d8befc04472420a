"""One request's decoding state and round logic, shared by every runtime (flashmap.rounds).

A sequence alternates: (prefill) -> [draft -> verify -> commit]*. Positions: the target
KV cache holds every committed token except the newest one, the anchor, which sits at
position len(tokens) - 1 and is written by the next verify. The drafter's context is
every position strictly before the anchor; committed positions the drafter has not
acknowledged yet wait in `pending_context` (a lost answer is resent from `drafter_seen`).
While the speculation controller keeps a sequence from drafting it may let its rows go
without features (`lazy_features`); the context then has a gap (`context_gap`), and the
sequence drafts again only after a row has fetched the kept features from the target
(VerifyRow.features_from).
With no draft a round is one autoregressive step (the bonus token is the next token),
so the autoregressive baseline and the drafter-down fallback run through the same code.

Numpy only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flashmap.rejection_sampler import greedy_verify, sample_verify
from flashmap.types import (
    BLOCK_SIZE,
    FOLLOW_TOKEN,
    Draft,
    GenerationRequest,
    SpecStats,
    VerifyResult,
    VerifyRow,
)


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request: GenerationRequest,
        block_size: int = BLOCK_SIZE,
        handle: int = -1,
    ):
        self.seq_id = seq_id
        self.handle = (
            handle  # the target's name for this sequence: engine slot or Triton correlation id
        )
        self.request = request
        self.params = request.params
        self.block_size = block_size
        self.tokens: list[int] = [int(t) for t in request.prompt_ids]
        self.n_prompt = len(self.tokens)
        self.prefilled = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = (
            None  # set when a part failed this request (finish "error")
        )
        # Entropy when no seed: a request with a seed is reproducible, one without is not.
        self.rng = np.random.default_rng(request.params.seed)
        self.stats = SpecStats(block_size)
        # (token ids [m], features [m, F]) pieces the drafter has not acknowledged
        self.pending_context: list[tuple[np.ndarray, object]] = []
        self.drafter_seen = 0  # context positions the drafter has acknowledged
        self.drafter_lost = (
            False  # the drafter lost this sequence's context: autoregressive from now on
        )
        self.draft_limit: int | None = (
            None  # this round's draft length, set by the speculation controller
        )
        self.lazy_features = (
            False  # this round's rows go without features (set by the speculation controller)
        )
        self._gap: int | None = (
            None  # first position a committed row without features left out (context_gap)
        )
        self._stop = set(request.stop_token_ids)
        # A shadow probe's block (SpeculationController.observe_shadows): (index in `tokens` of its
        # first token, its tokens [k]), and the slots such blocks reached and had accepted [2, K].
        self.shadow: tuple[int, np.ndarray] | None = None
        self.shadow_counts = np.zeros((2, block_size), np.int64)

    # -- state -----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    def draft_budget(self, context: bool = True) -> int:
        """This round's max_draft_tokens (what the drafter is asked for): within the block, the
        tokens max_new_tokens leaves, the request's max_draft_tokens and the controller's choice
        for this round (draft_limit); 0 while the drafter's context has a gap, unless `context`
        is False (what the sequence could draft once it has caught up)."""
        if not self.prefilled or self.finished or (context and self.context_gap() is not None):
            return 0
        left = self.request.max_new_tokens - len(self.generated) - 1
        caps = [self.block_size, left]
        if self.request.max_draft_tokens is not None:
            caps.append(self.request.max_draft_tokens)
        if self.draft_limit is not None:
            caps.append(self.draft_limit)
        return max(0, min(caps))

    def wants_draft(self) -> bool:
        """Would draft this round if the drafter answers (False when its context is lost)."""
        return self.draft_budget() > 0 and not self.drafter_lost

    def may_draft(self) -> bool:
        """Can draft in some later round (with a drafter): not when speculation is off for the
        request or the drafter lost its context. A sequence that never drafts needs no
        features from the target."""
        return self.request.max_draft_tokens != 0 and not self.drafter_lost

    @property
    def features_known(self) -> int:
        """Context positions whose features the drafter holds or `pending_context` has."""
        return self.drafter_seen + sum(len(c[0]) for c in self.pending_context)

    def context_gap(self) -> int | None:
        """The first cached position whose features neither the drafter nor pending_context
        has (committed rows that went without features), or None when the context is whole."""
        return self._gap if self.may_draft() else None

    def _sends_features(self, drafter: bool) -> bool:
        """Whether this round's row without a draft asks the target for features."""
        return drafter and self.may_draft() and not self.lazy_features

    def draft_seed(self) -> int:
        return int(self.rng.integers(2**62))

    # -- the drafter's context ----------------------------------------------------
    def context_for_drafter(self) -> tuple[int, np.ndarray, list] | None:
        """(position of the first unacknowledged context token, token ids [m], features [m, F]
        as a list of row pieces); None when the drafter has everything. Kept until
        `drafter_acknowledged`. The pieces are what the target handed back (numpy, or the
        in-process engine's device tensors), joined where they are used: on the wire or on
        the drafter's device."""
        if not self.pending_context:
            return None
        ids = np.concatenate([c[0] for c in self.pending_context])
        return self.drafter_seen, ids, [c[1] for c in self.pending_context]

    def drafter_acknowledged(self, n: int | None = None) -> None:
        """The drafter holds the first n positions of the pending context (None: all of it).
        A call's answer acknowledges what that call sent: rounds may have committed more
        while it was out (a shadow probe's call runs beside them)."""
        held = sum(len(c[0]) for c in self.pending_context)
        n = held if n is None else min(n, held)
        self.drafter_seen += n
        rest = []
        for ids, feats in self.pending_context:
            if n >= len(ids):
                n -= len(ids)
                continue
            rest.append((ids[n:], feats[n:]))
            n = 0
        self.pending_context = rest

    def lose_drafter(self) -> None:
        """The drafter cannot serve this sequence any more (its context is gone)."""
        self.drafter_lost = True
        self.pending_context.clear()

    # -- one round -------------------------------------------------------------
    def verify_row(self, draft: Draft | None, steps: int = 1, drafter: bool = True) -> VerifyRow:
        """The target input of this round: the prompt at prefill, else [anchor, d_1..d_K].
        Without a draft the row decodes up to `steps` tokens (within max_new_tokens), with
        the round seeds that as many one-step rounds would draw, so the text is the same.
        drafter False (the round loop has none): the row asks for no features."""
        if draft is not None and len(draft.tokens):
            round_seed = int(self.rng.integers(2**62))
            toks = np.concatenate([[self.anchor], draft.tokens]).astype(np.int64)
            row = VerifyRow(
                self.handle, len(self.tokens) - 1, toks, self.params, draft.support_ids, round_seed
            )
            if draft.parents is not None:
                row.parents = draft.parents
            return row
        features = self._sends_features(drafter)
        if not self.prefilled:
            return self._plain_row(0, self.tokens, steps, 0, features)
        gap = self.context_gap() if features else None
        return self._plain_row(
            len(self.tokens) - 1, [self.anchor], steps, 0, features, -1 if gap is None else gap
        )

    def follow_row(self, prev: VerifyRow, steps: int, drafter: bool = True) -> VerifyRow:
        """The row of the round after `prev` (this sequence's row without drafts, sent and not
        committed yet), to send before prev answers: its tokens are [FOLLOW_TOKEN] (the target
        feeds the last token prev decoded) and its seeds are the ones verify_row would draw
        after prev's commit. Before committing its result, `followed` sets the real token.
        After a prev without features, a row with features fetches everything from the first
        position the context lacks (the target runs prev first)."""
        features = self._sends_features(drafter)
        start = prev.start_pos + len(prev.tokens) + len(prev.next_seeds)
        since = self.features_known if features and not prev.features else -1
        return self._plain_row(start, [FOLLOW_TOKEN], steps, prev.steps, features, since)

    def followed(self, row: VerifyRow) -> VerifyRow:
        """A follow_row once the row before it is committed: its token is the anchor.
        ValueError if that commit did not end where the row starts (a broken pipeline)."""
        if row.start_pos != len(self.tokens) - 1:
            raise ValueError(
                f"a continuation at position {row.start_pos} after a commit that ends at "
                f"{len(self.tokens) - 1}"
            )
        return replace(row, tokens=np.asarray([self.anchor], np.int64))

    def _plain_row(
        self,
        start_pos: int,
        tokens,
        steps: int,
        ahead: int,
        features: bool,
        features_from: int = -1,
    ) -> VerifyRow:
        """A row without drafts decoding up to `steps` tokens within max_new_tokens, `ahead`
        tokens being committed before it."""
        round_seed = int(self.rng.integers(2**62))
        steps = max(1, min(steps, self.request.max_new_tokens - len(self.generated) - ahead))
        next_seeds = self.rng.integers(2**62, size=steps - 1).astype(np.int64)
        return VerifyRow(
            self.handle,
            start_pos,
            np.asarray(tokens, np.int64),
            self.params,
            np.zeros((0, 1), np.int64),
            round_seed,
            next_seeds,
            features,
            features_from,
        )

    def ends_with(self, row: VerifyRow, ahead: int = 0) -> bool:
        """Whether committing this row's verify surely ends the sequence: it commits at least
        one token (a drafted row) or exactly `row.steps` (a row without drafts), and those
        reach max_new_tokens whatever the target answers (`ahead`: tokens committed before it,
        for a follow_row). The target may then free the sequence in the same call
        (TritonTarget: END on the row, no release call after)."""
        least = row.steps if row.num_draft == 0 else 1
        return len(self.generated) + ahead + least >= self.request.max_new_tokens

    def commit(
        self, row: VerifyRow, draft: Draft | None, result: VerifyResult, tree: Draft | None = None
    ) -> tuple[list[int], int]:
        """Apply rejection sampling to a verify result; (newly committed tokens, drafts accepted).
        A sequence that ended while the round ran (aborted, cancelled) commits nothing. tree:
        the tree draft the round verified, when row and draft are its accepted path (the
        statistics count the tree's depth and nodes)."""
        if self.finished:
            return [], 0
        k = row.num_draft
        if k == 0:  # one token per step: the argmax (T = 0) or the target's own sample
            new, n_acc = [int(t) for t in result.decoded(self.params.greedy)[-row.steps :]], 0
        elif self.params.greedy:
            new, n_acc = greedy_verify(draft.tokens, result.argmax)
        else:
            new, n_acc = sample_verify(draft, result, self.rng)
        # Positions now in the target's cache and final: the row's tokens up to the last accepted
        # (and every token a multi-step row decoded but the last).
        decoded = new[:-1] if k == 0 else []
        n_ctx = len(row.tokens) - k + n_acc
        if row.features and not self.drafter_lost:  # rows without features: see context_gap
            since = row.features_from if 0 <= row.features_from < row.start_pos else row.start_pos
            if (
                since != self.features_known
            ):  # features that would not continue the context: never draft on them
                self.lose_drafter()
            else:
                before = np.asarray(
                    self.tokens[since : row.start_pos], np.int64
                )  # fetched with the row
                self.pending_context.append(
                    (
                        np.concatenate([before, row.tokens[:n_ctx], np.asarray(decoded, np.int64)]),
                        result.features[: len(before) + n_ctx + len(decoded)],
                    )
                )
                self._gap = None
        elif not row.features and self._gap is None:
            self._gap = self.features_known
        prompt = not self.prefilled
        self.prefilled = True
        kept = self._append(new)
        # A multi-step row: one round per step whose token was kept (not those past a stop).
        for _ in range(1 if k or tree is not None else len(kept) - prompt):
            if tree is None:
                self.stats.record_round(k, n_acc)
            else:
                self.stats.record_round(tree.depth, n_acc, len(tree.tokens))
        if (k or tree is not None) and draft is not None and draft.draft_steps:
            self.stats.draft_steps = draft.draft_steps
        return kept, n_acc

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

    def finish(self, reason: str) -> None:
        """End the request now (abort, a stop string, ...); the first reason stays."""
        if not self.finished:
            self.finish_reason = reason

    def abort(self) -> None:
        self.finish("abort")

    def fail(self, error: BaseException) -> None:
        """A part failed this request: it ends with finish reason "error"."""
        if not self.finished:
            self.error = error
            self.finish_reason = "error"
