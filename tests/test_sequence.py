"""flashmap.sequence: when a round surely ends a request (the target may free it in that call)."""

from __future__ import annotations

import numpy as np

from flashmap.sequence import Sequence
from flashmap.types import Draft, GenerationRequest, VerifyResult


def _prefilled(max_new: int) -> Sequence:
    s = Sequence(1, GenerationRequest(np.arange(3, 9), max_new))
    row = s.verify_row(None)
    s.commit(row, None, VerifyResult(np.array([7]), np.zeros((0, 1), np.float32), np.zeros(0, np.float32),
                                     np.array([7]), np.zeros((6, 4), np.float32)))
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
        fresh = Sequence(2, GenerationRequest(np.arange(3, 9), max_new))
        assert fresh.ends_with(fresh.verify_row(None)) == ends
