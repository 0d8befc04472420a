"""Goodput-driven speculation: how many drafted tokens each request verifies this round.

Every round the controller picks, per request, a draft length L_i in 0..K (0 = a plain
decode step) that maximises the batch's expected committed tokens per second:

    sum_i (1 + E[accepted_i | L_i]) / (draft_cost(#drafting) + verify_cost(query tokens))

- E[accepted | L] = sum_{k<=L} prod_{j<=k} a_j, with a_j the request's conditional
  acceptance of slot j (SpecStats: accepted / verified per slot), shrunk towards a global
  prior (every request's counts, per greedy / sampling) so new requests start informed.
- verify_cost(T) = c0 + c1 * T for T padded query tokens in the round (rows x the longest
  row of each forward pass, prefill rows included, a second pass charged `pass_tokens`:
  flashmap.passes) and
  draft_cost(B) = d0 + d1 * B for B drafting requests: least-squares fits with forgetting
  over the rounds measured, so the model follows the device and the load.

A forward pass pads every row to the longest ([B, max_len]), so the requests that draft
share one length M; a target that splits its rows into two passes (flashmap.passes) lets
the others, and a long prompt beside them, run in a pass of their own. Every plan is priced
with the engine's own grouping rule (flashmap.passes.best_split), prefill rows included.
The search tries every M in 1..K and, for each, the b requests that gain most (the others
skip the draft call), all at once in numpy (0.5-1.3 ms per round for 4-32 requests, 2-core VM), and
keeps the best of those and no speculation at all. Exactness never depends on the choice:
any prefix of a draft is a valid proposal.

The first decode round probes. While speculation is off, every `probe_every` rounds one request (the one longest without a
draft) drafts its whole block, so the per-slot acceptance and the draft cost stay current
and speculation can come back; each probe doubles the interval (up to `max_probe_every`)
until the search lets a round draft again.
Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashmap.passes import best_split
from flashmap.sequence import Sequence
from flashmap.types import BLOCK_SIZE


class OnlineLinear:
    """y ~ w0 + w1 * x by least squares with exponential forgetting (recent rounds count most)."""

    def __init__(self, prior: tuple[float, float], forget: float = 0.98, prior_weight: float = 1e-3):
        self.forget = forget
        # Normal equations A w = b, started from a weak prior centred on `prior`.
        self.A = prior_weight * np.eye(2)
        self.b = self.A @ np.asarray(prior, np.float64)
        self.n = 0

    def add(self, x: float, y: float) -> None:
        v = np.array([1.0, float(x)])
        self.A = self.forget * self.A + np.outer(v, v)
        self.b = self.forget * self.b + v * float(y)
        self.n += 1

    @property
    def coef(self) -> tuple[float, float]:
        w0, w1 = np.linalg.solve(self.A + 1e-9 * np.eye(2), self.b)
        return max(float(w0), 0.0), max(float(w1), 0.0)

    def __call__(self, x: float) -> float:
        w0, w1 = self.coef
        return w0 + w1 * x


@dataclass
class ControllerConfig:
    prior_strength: float = 8.0  # pseudo-rounds of the global acceptance in a request's estimate
    prior_acceptance: float = 0.6  # per-slot acceptance assumed before any round is seen
    prior_rounds: float = 4.0  # ... with the weight of this many rounds
    forget: float = 0.98  # cost fits: weight of a round measured n rounds ago is forget**n
    probe_every: int = 8  # after this many rounds without speculation one request drafts its block ...
    max_probe_every: int = 64  # ... and after each such probe, twice as many
    pass_tokens: float | None = None  # the target's price of a second forward pass (flashmap.passes); None: one pass


@dataclass
class SpeculationController:
    block_size: int = BLOCK_SIZE
    cfg: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self):
        K = self.block_size
        # Global per-slot counts (verified, accepted), greedy and sampling separately.
        c = self.cfg
        self.global_counts = {g: (np.full(K, c.prior_rounds), np.full(K, c.prior_rounds * c.prior_acceptance))
                              for g in (True, False)}
        self.verify_cost = OnlineLinear((1e-2, 1e-4), c.forget, prior_weight=1e-3)
        self.draft_cost = OnlineLinear((1e-2, 1e-4), c.forget, prior_weight=1e-3)
        self.idle: dict[int, int] = {}  # seq_id -> rounds in a row it could have drafted and did not
        self.probe_every = self.cfg.probe_every  # rounds without speculation before the next probe
        self.since_probe = 0

    # -- estimates ---------------------------------------------------------------
    def acceptance(self, seqs: list[Sequence]) -> np.ndarray:
        """[n, K] conditional acceptance of each slot for these requests (shrunk to the global prior)."""
        K, w = self.block_size, self.cfg.prior_strength
        prior = {g: acc / np.maximum(ver, 1e-9) for g, (ver, acc) in self.global_counts.items()}
        pri = np.stack([prior[s.params.greedy] for s in seqs])  # [n, K]
        acc = np.stack([s.stats.accepted_per_slot[:K] for s in seqs])
        ver = np.stack([s.stats.verified_per_slot[:K] for s in seqs])
        a = np.clip((acc + w * pri) / (ver + w), 0.0, 1.0)
        return np.minimum.accumulate(a, axis=1)  # later slots never count as more likely

    @staticmethod
    def expected_gain(a: np.ndarray) -> np.ndarray:
        """[n, K+1] expected accepted tokens for draft lengths 0..K, from acceptance a [n, K]."""
        return np.concatenate([np.zeros((len(a), 1)), np.cumsum(np.cumprod(a, axis=1), axis=1)], axis=1)

    # -- the choice --------------------------------------------------------------
    def plan(self, seqs: list[Sequence]) -> dict[int, int]:
        """Set each sequence's draft_limit for this round; returns seq_id -> chosen length."""
        for s in seqs:
            s.draft_limit = None
        caps = {s.seq_id: (s.draft_budget() if not s.drafter_lost else 0) for s in seqs}
        # A seeded sampling request keeps its whole draft: which tokens it samples depends on the
        # draft lengths, and a seed must give the same text every time.
        pinned = {s.seq_id for s in seqs if s.params.seed is not None and not s.params.greedy}
        idle = {i: self.idle.get(i, 0) + 1 for i, cap in caps.items() if cap}
        if not any(caps.values()):
            choice = dict(caps)
        elif self.verify_cost.n == 0:  # nothing measured yet: the first decode round probes
            choice = {i: 0 for i in caps}
            self.since_probe = self.probe_every
        else:
            choice = self._search(seqs, caps)
        # Probes: while speculation is off, every `probe_every` rounds the request that has gone
        # longest without a draft drafts its whole block, so the per-slot acceptance (and the draft
        # cost) stays current and speculation can come back. One request: a probe pads every row
        # of the verify to its length and adds to the draft call. Probes that keep finding
        # speculation off come rarer; a round the search lets draft starts over.
        if any(choice.values()):
            self.probe_every, self.since_probe = self.cfg.probe_every, 0
        elif idle:
            self.since_probe += 1
            if self.since_probe >= self.probe_every:
                i = max(idle, key=lambda j: (idle[j], -j))
                choice[i] = caps[i]
                self.probe_every = min(2 * self.probe_every, self.cfg.max_probe_every)
                self.since_probe = 0
        self.idle = {i: n for i, n in idle.items() if not choice[i]}
        for i in pinned:
            choice[i] = caps[i]
        for s in seqs:
            s.draft_limit = choice[s.seq_id]
        return choice

    def _search(self, seqs: list[Sequence], caps: dict[int, int]) -> dict[int, int]:
        """The best plan "the b requests that gain most draft min(cap, M)" over M and b.

        A pass pads every row to the longest one ([B, max_len]: the eager pass and the graph
        buckets alike), so the requests that draft share one length M, and one that drafts less
        saves nothing but its part of the draft call. A target that splits its rows into two
        passes (pass_tokens) does so by the rule of flashmap.passes, prefill rows included: each
        plan is priced as the engine will run it (`_plan_tokens`). All K x n plans at once."""
        n, K = len(seqs), self.block_size
        c0, c1 = self.verify_cost.coef
        d0, d1 = self.draft_cost.coef
        dec = [s for s in seqs if s.prefilled]
        prompts = [len(s.tokens) for s in seqs if not s.prefilled]  # prefill rows: their whole prompt
        nd = len(dec)
        none = {s.seq_id: 0 for s in seqs}
        if not nd:
            return none
        gain = self.expected_gain(self.acceptance(dec))  # [nd, K + 1]
        cap = np.array([caps[s.seq_id] for s in dec], np.int64)
        m = np.arange(1, K + 1)
        g = np.take_along_axis(gain, np.minimum(cap[:, None], m[None, :]), axis=1).T  # [K, nd] gain at length m
        order = np.argsort(-g, axis=1, kind="stable")  # [K, nd] best requests first
        g_sorted = np.take_along_axis(g, order, axis=1)
        committed = n + np.cumsum(g_sorted, axis=1)  # [K, nd] the top-b requests draft
        b = np.arange(1, nd + 1)
        cost = c0 + c1 * self._plan_tokens(prompts, nd, m, b) + d0 + d1 * b[None, :]  # [K, nd]
        thr = np.where(g_sorted > 0, committed / np.maximum(cost, 1e-12), -np.inf)
        k = int(np.argmax(thr))  # the first best: the shortest M, the fewest requests
        mi, bi = divmod(k, nd)
        base = self._plan_tokens(prompts, nd, m[:1], np.zeros(1, np.int64))[0, 0]  # nobody drafts
        if not thr[mi, bi] > n / (c0 + c1 * base):
            return none
        drafting = {dec[j].seq_id for j in order[mi, :bi + 1]}
        return {s.seq_id: min(caps[s.seq_id], mi + 1) if s.seq_id in drafting else 0 for s in seqs}

    def _plan_tokens(self, prompts: list[int], nd: int, m: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[len(m), len(b)] padded query tokens of a verify with these prefill rows and nd
        decode rows, b of them drafting m tokens (rows of m + 1) and the others rows of 1."""
        values = np.array(sorted({1, *(m + 1).tolist(), *prompts}))
        mm, bb = np.meshgrid(m, b, indexing="ij")  # [M, B]
        counts = np.zeros((len(values), mm.size))
        col = np.arange(mm.size)
        counts[0] = nd - bb.ravel()  # values[0] == 1; m + 1 >= 2 never shares its row
        counts[np.searchsorted(values, mm.ravel() + 1), col] += bb.ravel()
        np.add.at(counts, np.searchsorted(values, prompts), 1)  # one row of counts per prompt
        return best_split(values, counts, self.cfg.pass_tokens)[0].reshape(mm.shape)

    # -- learning ----------------------------------------------------------------
    def observe(self, query_tokens: int, verify_s: float, drafting: int, draft_s: float,
                rounds: list[tuple[bool, int, int]], prefill: bool = False) -> None:
        """One round's measurements: the verify call's padded query tokens and seconds, the number of
        drafting requests and the draft call's seconds, and per drafted request (greedy,
        drafted, accepted). prefill: the round had a prompt row, whose attention over the whole
        prompt is not what a decode round's tokens cost: the verify fit leaves it out."""
        if verify_s > 0 and not prefill:
            self.verify_cost.add(query_tokens, verify_s)
        if drafting and draft_s > 0:
            self.draft_cost.add(drafting, draft_s)
        for greedy, drafted, accepted in rounds:
            if drafted:
                ver, acc = self.global_counts[greedy]
                k = min(drafted, accepted + 1)
                ver *= 0.999  # slow forgetting: the prior follows the workload
                acc *= 0.999
                ver[:k] += 1
                acc[:accepted] += 1
