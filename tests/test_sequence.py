"""flashmap.sequence: when a round surely ends a request (the target may free it in that call)."""

from __future__ import annotations

import numpy as np
import pytest

from flashmap.drafts import Draft
from flashmap.sequence import Sequence
from flashmap.types import GenerationRequest, SamplingParams, VerifyResult


def _prefilled(max_new: int) -> Sequence:
    s = Sequence(
        "1", GenerationRequest(np.arange(3, 9), max_new, SamplingParams(seed=1))
    )  # seeded: same draws
    row = s.verify_row(None)
    s.commit(
        row,
        None,
        VerifyResult(
            np.array([7]),
            np.zeros((0, 1), np.float32),
            np.zeros(0, np.float32),
            np.array([7]),
            np.zeros((6, 4), np.float32),
        ),
    )
    return s


def test_ends_with_counts_the_tokens_a_row_commits_at_least():
    s = _prefilled(6)  # 1 generated, 5 left
    assert s.ends_with(s.verify_row(None, steps=8))  # 5 steps (capped): exactly 5 tokens
    assert not s.ends_with(s.verify_row(None, steps=4))  # 4 tokens: one left after it
    drafted = s.verify_row(Draft.greedy(np.array([4, 5, 6, 7])))
    assert not s.ends_with(drafted)  # a drafted row may commit a single token
    s = _prefilled(2)  # 1 left
    assert s.ends_with(s.verify_row(Draft.greedy(np.array([4]))))
    assert _prefilled(1).finished
    for max_new, ends in ((1, True), (2, False)):  # a prompt's row commits one token
        fresh = Sequence("2", GenerationRequest(np.arange(3, 9), max_new))
        assert fresh.ends_with(fresh.verify_row(None)) == ends


def test_a_follow_row_is_the_next_round_row_sent_early():
    """follow_row before a row's commit = verify_row after it: same position, steps and seeds
    (the text of a pipelined round is the text of the next round); `followed` gives it the
    anchor, and refuses a commit that ended elsewhere."""
    early, late = _prefilled(12), _prefilled(12)  # 1 generated
    first_early, first_late = early.verify_row(None, steps=4), late.verify_row(None, steps=4)
    follow = early.follow_row(first_early, 8)
    assert follow.tokens.tolist() == [-1] and follow.steps == 7  # 12 - 1 - 4 left
    assert early.ends_with(follow, ahead=first_early.steps)
    result = VerifyResult(
        np.array([5, 6, 7, 8]),
        np.zeros((0, 1), np.float32),
        np.zeros(0, np.float32),
        np.full(4, -1),
        np.zeros((4, 4), np.float32),
    )
    early.commit(first_early, None, result)
    late.commit(first_late, None, result)
    nxt = late.verify_row(None, steps=8)
    fixed = early.followed(follow)
    assert (
        fixed.start_pos,
        fixed.tokens.tolist(),
        fixed.round_seed,
        fixed.next_seeds.tolist(),
    ) == (nxt.start_pos, nxt.tokens.tolist(), nxt.round_seed, nxt.next_seeds.tolist())
    early.tokens.pop()  # a commit that ended one token short
    with pytest.raises(ValueError, match="continuation"):
        early.followed(follow)


def test_a_drafter_answer_acknowledges_only_the_context_its_call_sent():
    """A shadow probe's draft call is out while a round commits more context: its answer
    acknowledges what it sent, and the next call sends the rest from where the drafter stands."""
    s = _prefilled(20)  # the prompt's 6 positions pending
    start, ids, feats = s.context.unsent()
    assert (start, len(ids)) == (0, 6)
    row = s.verify_row(None, steps=3)  # committed while the call is out: 3 more positions
    s.commit(
        row,
        None,
        VerifyResult(
            np.array([5, 6, 7]),
            np.zeros((0, 1), np.float32),
            np.zeros(0, np.float32),
            np.full(3, -1),
            np.arange(12, dtype=np.float32).reshape(3, 4),
        ),
    )
    s.context.acknowledged(len(ids))
    assert s.context.seen == 6 and s.context.known == 9 and s.context_gap() is None
    start, ids, feats = s.context.unsent()
    assert (
        start == 6
        and ids.tolist() == s.tokens[6:9]
        and np.concatenate(feats).tolist() == np.arange(12).reshape(3, 4).tolist()
    )
    s.context.acknowledged()
    assert s.context.seen == 9 and s.context.unsent() is None


def test_a_multi_step_row_counts_a_round_per_token_it_kept():
    """A row without drafts that decoded 4 steps counts 4 rounds; one whose second token is a
    stop id counts 2 (the steps past the stop are not the request's)."""
    for stop, rounds in ((None, 4), (6, 2)):
        s = Sequence(
            "1",
            GenerationRequest(np.arange(3, 9), 20, stop_token_ids=[] if stop is None else [stop]),
        )
        s.commit(
            s.verify_row(None),
            None,
            VerifyResult(
                np.array([7]),
                np.zeros((0, 1), np.float32),
                np.zeros(0, np.float32),
                np.array([7]),
                np.zeros((6, 4), np.float32),
            ),
        )
        assert s.stats.rounds == 0  # a prompt's row
        row = s.verify_row(None, steps=4)
        s.commit(
            row,
            None,
            VerifyResult(
                np.array([5, 6, 7, 8]),
                np.zeros((0, 1), np.float32),
                np.zeros(0, np.float32),
                np.full(4, -1),
                np.zeros((4, 4), np.float32),
            ),
        )
        assert s.stats.rounds == rounds and len(s.generated) == 1 + rounds
