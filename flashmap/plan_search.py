"""The plan search of the speculation controller (flashmap.speculation): given each request's
expected gain per draft length and the controller's cost fits, the draft lengths that maximise
committed tokens per second, for a target that runs a verify packed (each drafted token costs
its own time) or padded (every row pays for the longest). `ctl` is the controller: its cost
fits (verify_cost, draft_cost), `_verify_s`, `_plain_rate`, `_plan_tokens`, cfg.margin.

Numpy only.
"""

from __future__ import annotations

import numpy as np


def search_packed(
    ctl,
    n: int,
    prompts: list[int],
    gain: np.ndarray,
    cap: np.ndarray,
    most: int,
    width: int = 1,
) -> tuple[np.ndarray, float]:
    """[nd] lengths maximising committed tokens per second when each drafted token costs
    its own verify time (packed), at most `most` requests drafting. For a rate lam, each
    request maximises gain(L) - lam * (c_tok * L + d1 * [L > 0]) and the `most` best of
    those that gain keep theirs; Dinkelbach's iteration (lam = the plan's rate, repeat)
    reaches the best ratio in a few steps. The draft call's fixed d0 is paid once if
    anyone drafts, so the plan is kept only if it beats no speculation. Returns the plan
    and its rate (tokens per second)."""
    c0, c_row, c_tok = ctl.verify_cost.coef
    d0, d1 = ctl.draft_cost.coef
    nd, K = gain.shape[0], ctl.block_size
    L = np.arange(K + 1)
    price = width * (c_tok * L + d1 * (L > 0))  # [K + 1] seconds of drafting L tokens
    allowed = L[None, :] <= cap[:, None]  # [nd, K + 1]
    base = ctl._verify_s(n, sum(prompts) + nd)  # one verify without drafts
    lam = (1 + ctl.cfg.margin) * ctl._plain_rate(n, base, prompts)  # the rate to beat
    plan = np.zeros(nd, np.int64)
    for _ in range(32):
        value = np.where(allowed, gain - lam * price, -np.inf)  # [nd, K + 1]
        choice = value.argmax(1)  # [nd], the shortest on ties
        if not choice.any():
            break
        if np.count_nonzero(choice) > most:  # keep the `most` that gain most at this rate
            net = value[np.arange(nd), choice]  # over not drafting, which is worth 0
            choice[np.argsort(-net, kind="stable")[most:]] = 0
        rate = (n + gain[np.arange(nd), choice].sum()) / (base + d0 + price[choice].sum())
        if rate <= lam * (1 + 1e-9):
            break
        lam, plan = rate, choice
    return plan, lam


def search_shared(
    ctl,
    n: int,
    prompts: list[int],
    gain: np.ndarray,
    cap: np.ndarray,
    most: int,
    width: int = 1,
) -> tuple[np.ndarray, float]:
    """[nd] lengths of the best plan "the b requests that gain most draft min(cap, M)" over
    M and b <= most, for a padded target: every row pays for the longest, so the requests
    that draft share one length M, and one that drafts less saves only its part of the
    draft call. Each plan is priced by `_plan_tokens`; all K x nd plans at once. Returns
    the plan and its rate."""
    d0, d1 = ctl.draft_cost.coef
    nd, K = gain.shape[0], ctl.block_size
    m = np.arange(1, K + 1)
    g = np.take_along_axis(
        gain, np.minimum(cap[:, None], m[None, :]), axis=1
    ).T  # [K, nd] gain at length m
    order = np.argsort(-g, axis=1, kind="stable")  # [K, nd] best requests first
    g_sorted = np.take_along_axis(g, order, axis=1)
    committed = n + np.cumsum(g_sorted, axis=1)  # [K, nd] the top-b requests draft
    b = np.arange(1, nd + 1)
    cost = (
        ctl._verify_s(n, ctl._plan_tokens(prompts, nd, m * width, b)) + d0 + d1 * width * b[None, :]
    )  # [K, nd]
    thr = np.where(
        (g_sorted > 0) & (b[None, :] <= most), committed / np.maximum(cost, 1e-12), -np.inf
    )
    k = int(np.argmax(thr))  # the first best: the shortest M, the fewest requests
    mi, bi = divmod(k, nd)
    base = ctl._plan_tokens(prompts, nd, m[:1], np.zeros(1, np.int64))[0, 0]  # nobody drafts
    lengths = np.zeros(nd, np.int64)
    plain = ctl._plain_rate(n, ctl._verify_s(n, base), prompts)
    if thr[mi, bi] > (1 + ctl.cfg.margin) * plain:
        top = order[mi, : bi + 1]
        lengths[top] = np.minimum(cap[top], mi + 1)
        return lengths, float(thr[mi, bi])
    return lengths, plain
