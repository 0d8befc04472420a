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

DEFAULT_PASS_TOKENS = 60.0  # CPU: 13.2 ms + 0.22 ms per token, 61 tokens (bench.verify_passes, quiet 2-core VM)


def pass_groups(lengths: Sequence[int], pass_tokens: float | None) -> list[list[int]]:
    """Row indices grouped into one or two passes (shortest rows first), whichever costs fewer
    padded query tokens once a second pass is charged pass_tokens."""
    n = len(lengths)
    if pass_tokens is None or n < 2:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: lengths[i])
    longest = lengths[order[-1]]
    best_j, best = 0, n * longest
    for j in range(1, n):  # rows order[:j] in the first pass, the rest in the second
        if lengths[order[j - 1]] == longest:
            break
        cost = j * lengths[order[j - 1]] + (n - j) * longest + pass_tokens
        if cost < best:
            best_j, best = j, cost
    return [order[:best_j], order[best_j:]] if best_j else [list(range(n))]


def query_tokens(lengths: Sequence[int], pass_tokens: float | None) -> float:
    """What a verify of rows with these lengths costs, in padded query tokens (plus pass_tokens
    for a second pass): the x of the controller's verify-cost fit."""
    groups = pass_groups(lengths, pass_tokens)
    return (sum(len(g) * max(lengths[i] for i in g) for g in groups)
            + (len(groups) - 1) * (pass_tokens or 0.0))
