"""How the rows of one verify call are grouped into forward passes, and what that costs.

A forward pass pads its rows to the longest ([B, max_len]), so one 17-token row among
fifteen 1-token rows makes the pass cost 16 x 17 query tokens. Two passes (the short rows,
then the long ones) cost 15 + 17 tokens plus the fixed cost of a second pass. The target
engine splits when that is cheaper; the speculation controller prices its plans with the
same rule, so both agree on what a round costs.

`pass_tokens` is the fixed cost of one extra pass, in query tokens (on the 2-core CPU VM the
demo target's pass costs about 60 tokens' worth of compute: `python -m bench.verify_passes`); None = never split (CUDA graphs, where
padding is nearly free and a second pass is a second launch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_PASS_TOKENS = 60.0  # CPU: 13.2 ms + 0.22 ms per token, 61 tokens (bench.verify_passes, quiet 2-core VM)


def pass_groups(lengths: Sequence[int], pass_tokens: float | None) -> list[list[int]]:
    """Row indices grouped into one or two passes (shortest rows first), whichever costs fewer
    padded query tokens once a second pass is charged pass_tokens."""
    n = len(lengths)
    if pass_tokens is None or n < 2:
        return [list(range(n))]
    values, counts = np.unique(np.asarray(lengths), return_counts=True)
    g = int(best_split(values, counts[:, None], pass_tokens)[1][0])
    if g < 0:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: lengths[i])
    j = int(counts[:g + 1].sum())  # the rows up to length values[g] go first
    return [order[:j], order[j:]]


def query_tokens(lengths: Sequence[int], pass_tokens: float | None) -> float:
    """What a verify of rows with these lengths costs, in padded query tokens (plus pass_tokens
    for a second pass): the x of the controller's verify-cost fit."""
    values, counts = np.unique(np.asarray(lengths), return_counts=True)
    return float(best_split(values, counts[:, None], pass_tokens)[0][0])


def best_split(values: np.ndarray, counts: np.ndarray, pass_tokens: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The grouping rule, for many row sets at once. Rows are given as length groups:
    values [G] ascending, counts [G, P] rows of each length in each of P row sets (0 allowed).
    Returns (padded query tokens [P], split [P]): the rows up to length values[split] form the
    first pass, or split = -1 for one pass. A split point inside a group of equal lengths is
    never the best one (moving it to the group's end only removes padding)."""
    values = np.asarray(values, np.float64)[:, None]  # [G, 1]
    counts = np.asarray(counts, np.float64)  # [G, P]
    n = counts.sum(0)  # [P]
    longest = np.where(counts > 0, values, 0.0).max(0)  # [P]
    one = n * longest
    if pass_tokens is None:
        return one, np.full(one.shape, -1)
    first = np.cumsum(counts, 0)  # [G, P] rows in the first pass when it ends after group g
    two = np.where((values < longest) & (counts > 0), first * values + (n - first) * longest + pass_tokens, np.inf)
    g = two.argmin(0)  # [P]
    best = two[g, np.arange(two.shape[1])]
    return np.minimum(one, best), np.where(best < one, g, -1)
