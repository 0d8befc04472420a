"""One request's decoding state and round logic, shared by every runtime (flashmap.rounds).

A sequence alternates: (prefill) -> [draft -> verify -> commit]*. Positions: the target
KV cache holds every committed token except the newest one, the anchor, which sits at
position len(tokens) - 1 and is written by the next verify. What the drafter holds of the
context is `context` (flashmap.drafter_context). With no draft a round is one
autoregressive step (the bonus token is the next token), so the autoregressive baseline and
the drafter-down fallback run through the same code.

A target that dies mid-request loses the sequence's cache, not its committed tokens, which
are final. `rewind` drops the rounds in flight and puts the random generator back where it
was before their first draw (a snapshot per round, keyed by the committed length the round
starts from); `rebuild_row` writes prompt + committed tokens but the anchor into a new cache
without drawing. The round retried after that draws the seeds the lost one drew, so the text
is the one the request would have had (orchestrator.resume).

Numpy only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flashmap.drafter_context import DrafterContext
from flashmap.drafts import Draft, SeqId
from flashmap.rejection_sampler import greedy_verify, sample_verify
from flashmap.types import (
    BLOCK_SIZE,
    FOLLOW_TOKEN,
    GenerationRequest,
    SpecStats,
    TokenLogprob,
    VerifyResult,
    VerifyRow,
)


class Sequence:
    def __init__(
        self,
        seq_id: SeqId,
        request: GenerationRequest,
        block_size: int = BLOCK_SIZE,
        handle: int = -1,
    ):
        self.seq_id = seq_id
        self.handle = handle  # the target's name for it: engine slot or Triton correlation id
        self.request = request
        self.params = request.params
        self.block_size = block_size
        self.tokens: list[int] = [int(t) for t in request.prompt_ids]
        self.n_prompt = len(self.tokens)
        self.prefilled = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = None  # a part failed this request (finish "error")
        # Entropy when no seed: a request with a seed is reproducible, one without is not.
        self.rng = np.random.default_rng(request.params.seed)
        # The generator's state before the first draw of the round that starts from each
        # committed length (rounds sent ahead start from lengths not committed yet): `rewind`.
        self._rng_at: dict[int, dict] = {}
        self.stats = SpecStats(block_size)
        self.context = DrafterContext()
        self._stop = set(request.stop_token_ids)
        # What each row asks the target for (VerifyRow.logprobs), and per generated token its
        # log-probability and top tokens, from the verify pass that committed it.
        self.top_logprobs = -1 if request.logprobs is None else int(request.logprobs)
        self.logprobs: list[TokenLogprob] = []

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

    def draft_cap(self, context: bool = True) -> int:
        """The most draft tokens this sequence can verify now: within the block, the tokens
        max_new_tokens leaves and the request's max_draft_tokens; 0 while the drafter's
        context has a gap, unless `context` is False (what it could draft once caught up)."""
        if not self.prefilled or self.finished or (context and self.context_gap() is not None):
            return 0
        left = self.request.max_new_tokens - len(self.generated) - 1
        caps = [self.block_size, left]
        if self.request.max_draft_tokens is not None:
            caps.append(self.request.max_draft_tokens)
        return max(0, min(caps))

    def may_draft(self) -> bool:
        """Can draft in some later round (with a drafter): not when speculation is off for the
        request or the drafter lost its context. A sequence that never drafts needs no
        features from the target."""
        return self.request.max_draft_tokens != 0 and not self.context.lost

    def context_gap(self) -> int | None:
        """The first cached position whose features the drafter lacks (committed rows that went
        without features), or None when the context is whole."""
        return self.context.gap if self.may_draft() else None

    def draft_seed(self) -> int:
        self._mark(len(self.tokens))
        return int(self.rng.integers(2**62))

    def _mark(self, committed: int) -> None:
        """Before a draw of the round that starts from `committed` tokens: the generator's state
        if this is that round's first draw."""
        if committed not in self._rng_at:
            self._rng_at[committed] = self.rng.bit_generator.state

    # -- one round -------------------------------------------------------------
    def verify_row(self, draft: Draft | None, steps: int = 1, features: bool = True) -> VerifyRow:
        """The target input of this round: the prompt at prefill, else [anchor, d_1..d_K].
        Without a draft the row decodes up to `steps` tokens (within max_new_tokens), with
        the round seeds that as many one-step rounds would draw, so the text is the same.
        features: a row without a draft brings the drafter's features back (the plan's
        SeqPlan.features), unless the sequence can no longer draft."""
        if draft is not None and len(draft.tokens):
            self._mark(len(self.tokens))
            round_seed = int(self.rng.integers(2**62))
            toks = np.concatenate([[self.anchor], draft.tokens]).astype(np.int64)
            row = VerifyRow(
                self.handle, len(self.tokens) - 1, toks, self.params, draft.support_ids, round_seed
            )
            row.logprobs = self.top_logprobs
            if draft.parents is not None:
                row.parents = draft.parents
                if draft.proposal_law and not self.params.greedy:
                    row.support_q = draft.support_probs
            return row
        features = features and self.may_draft()
        if not self.prefilled:
            return self._plain_row(0, self.tokens, steps, 0, features)
        gap = self.context_gap() if features else None
        return self._plain_row(
            len(self.tokens) - 1, [self.anchor], steps, 0, features, -1 if gap is None else gap
        )

    def follow_row(self, prev: VerifyRow, steps: int, features: bool = True) -> VerifyRow:
        """The row of the round after `prev` (this sequence's row without drafts, sent and not
        committed yet), to send before prev answers: its tokens are [FOLLOW_TOKEN] (the target
        feeds the last token prev decoded) and its seeds are the ones verify_row would draw
        after prev's commit. Before committing its result, `followed` sets the real token.
        After a prev without features, a row with features fetches everything from the first
        position the context lacks (the target runs prev first)."""
        features = features and self.may_draft()
        start = prev.start_pos + len(prev.tokens) + len(prev.next_seeds)
        since = self.context.known if features and not prev.features else -1
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
        self._mark(len(self.tokens) + ahead)
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
            logprobs=self.top_logprobs,
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
        self, row: VerifyRow, draft: Draft | None, result: VerifyResult, path=None
    ) -> tuple[list[int], int]:
        """Apply rejection sampling to a verify result; (newly committed tokens, drafts accepted).
        A sequence that ended while the round ran (aborted, cancelled) commits nothing. A tree
        row commits `path`, the drafts the target accepted, as if that path alone had been the
        draft (the statistics count the tree's depth and nodes)."""
        if self.finished:
            return [], 0
        tree = None
        if row.is_tree:  # the target walked it: the path, then its own pick after the path
            tree, draft = draft, Draft.greedy(draft.tokens[path], draft.draft_steps)
            n = len(row.tokens) - row.num_draft
            row = replace(
                row,
                tokens=np.concatenate([row.tokens[:n], draft.tokens]),
                support_ids=draft.support_ids,
                parents=np.zeros(0, np.int64),
            )
        k = row.num_draft
        if k == 0:  # one token per step: the argmax (T = 0) or the target's own sample
            new, n_acc = [int(t) for t in result.decoded(self.params.greedy)[-row.steps :]], 0
        elif tree is not None:
            new = [*draft.tokens.tolist(), int(result.decoded(self.params.greedy)[k])]
            n_acc = k
        elif self.params.greedy:
            new, n_acc = greedy_verify(draft.tokens, result.argmax)
        else:
            new, n_acc = sample_verify(draft, result, self.rng)
        # Positions now in the target's cache and final: the row's tokens up to the last accepted
        # (and every token a multi-step row decoded but the last).
        decoded = new[:-1] if k == 0 else []
        n_ctx = len(row.tokens) - k + n_acc
        if row.features:
            since = row.features_from if 0 <= row.features_from < row.start_pos else row.start_pos
            before = np.asarray(
                self.tokens[since : row.start_pos], np.int64
            )  # fetched with the row
            ids = np.concatenate([before, row.tokens[:n_ctx], np.asarray(decoded, np.int64)])
            self.context.add(since, ids, result.features[: len(ids)])
        else:
            self.context.skipped()
        prompt = not self.prefilled
        self.prefilled = True
        kept = self._append(new)
        if self.top_logprobs >= 0:  # token j was committed at the row's verified position j
            self.logprobs += [
                result.token_logprob(j, t, row.support_ids[j] if j < k else (), self.params.greedy)
                for j, t in enumerate(kept)
            ]
        self._rng_at = {n: st for n, st in self._rng_at.items() if n >= len(self.tokens)}
        # A multi-step row: one round per step whose token was kept (not those past a stop).
        for _ in range(1 if k or tree is not None else len(kept) - prompt):
            if tree is None:
                self.stats.record_round(k, n_acc)
            else:
                self.stats.record_round(tree.depth, n_acc, len(tree.tokens))
        if (k or tree is not None) and draft is not None and draft.draft_steps:
            self.stats.draft_steps = draft.draft_steps
        return kept, n_acc

    def rewind(self) -> None:
        """The target lost this sequence (it died or restarted) before answering the rounds in
        flight: they commit nothing, and the random draws they made are undone, so the round
        retried draws what the lost one drew. Its cache is to be rebuilt (`rebuild_row`)."""
        state = self._rng_at.get(len(self.tokens))
        if state is not None:
            self.rng.bit_generator.state = state
        self._rng_at.clear()

    def rebuild_row(self) -> VerifyRow | None:
        """After `rewind`: the row that writes every committed position but the anchor into a
        new cache (the next round's row writes the anchor, as it would have); its output is
        not used and it draws nothing. None before the prompt was prefilled: the prompt's own
        row does it."""
        if not self.prefilled:
            return None
        return VerifyRow(
            self.handle, 0, np.asarray(self.tokens[:-1], np.int64), self.params, features=False
        )

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
