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
the others verify one token each for the price of a second pass. The search tries every M
in 1..K and, for each, the b requests that gain most (the others skip the draft call), and
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
    def acceptance(self, s: Sequence) -> np.ndarray:
        """[K] conditional acceptance of each slot for this request (shrunk to the global prior)."""
        ver, acc = self.global_counts[s.params.greedy]
        prior = acc / np.maximum(ver, 1e-9)
        st, w = s.stats, self.cfg.prior_strength
        a = (st.accepted_per_slot[:self.block_size] + w * prior) / (st.verified_per_slot[:self.block_size] + w)
        return np.minimum.accumulate(np.clip(a, 0.0, 1.0))  # later slots never count as more likely

    @staticmethod
    def expected_gain(a: np.ndarray) -> np.ndarray:
        """[K+1] expected accepted tokens for draft lengths 0..K."""
        return np.concatenate([[0.0], np.cumsum(np.cumprod(a))])

    # -- the choice --------------------------------------------------------------
    def plan(self, seqs: list[Sequence]) -> dict[int, int]:
        """Set each sequence's draft_limit for this round; returns seq_id -> chosen length."""
        for s in seqs:
            s.draft_limit = None
        caps = {s.seq_id: (s.draft_budget() if not s.drafter_lost else 0) for s in seqs}
        # A seeded sampling request keeps its whole draft: which tokens it samples depends on the
        # draft lengths, and a seed must give the same text every time.
        pinned = {s.seq_id for s in seqs if s.params.seed is not None and not s.params.greedy}
        prefill_len = max((len(s.tokens) for s in seqs if not s.prefilled), default=0)
        idle = {i: self.idle.get(i, 0) + 1 for i, cap in caps.items() if cap}
        if not any(caps.values()):
            choice = dict(caps)
        elif self.verify_cost.n == 0:  # nothing measured yet: the first decode round probes
            choice = {i: 0 for i in caps}
            self.since_probe = self.probe_every
        else:
            choice = self._search(seqs, caps, prefill_len)
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

    def _search(self, seqs: list[Sequence], caps: dict[int, int], prefill_len: int) -> dict[int, int]:
        """The best plan "the b requests that gain most draft min(cap, M)" over M and b.

        A pass pads every row to the longest one ([B, max_len]: the eager pass and the graph
        buckets alike), so one pass costs c0 + c1 * n * max(prefill_len, M + 1) whatever the
        shorter rows ask for: the requests that draft share one length M, and one that drafts
        less saves nothing but its part of the draft call. A target that splits (pass_tokens)
        verifies the n - b others in a pass of their own: b (M + 1) + n - b + pass_tokens
        tokens, when that is cheaper (decode rounds; a prefill row keeps one pass)."""
        n = len(seqs)
        c0, c1 = self.verify_cost.coef
        d0, d1 = self.draft_cost.coef
        ids = [s.seq_id for s in seqs]
        # [n, K + 1] expected accepted tokens of each request at draft lengths 0..K (capped).
        gain = np.stack([self.expected_gain(self.acceptance(s)) for s in seqs])
        cap = np.array([caps[i] for i in ids])
        best_m, best_b, best_thr, order_at = 0, 0, n / (c0 + c1 * n * max(prefill_len, 1)), None
        for m in range(1, self.block_size + 1):
            g = gain[np.arange(n), np.minimum(cap, m)]  # [n]
            order = np.argsort(-g, kind="stable")
            b = np.arange(1, n + 1)
            committed = n + np.cumsum(g[order])  # the top-b requests draft
            tokens = np.full(n, n * max(prefill_len, m + 1), np.float64)
            if self.cfg.pass_tokens is not None and not prefill_len:
                tokens = np.minimum(tokens, b * (m + 1) + (n - b) + np.where(b < n, self.cfg.pass_tokens, 0.0))
            cost = c0 + c1 * tokens + d0 + d1 * b
            thr = committed / np.maximum(cost, 1e-12)
            k = int(np.argmax(thr))
            if thr[k] > best_thr and g[order[k]] > 0:
                best_m, best_b, best_thr, order_at = m, k + 1, float(thr[k]), order
        drafting = set() if order_at is None else {ids[j] for j in order_at[:best_b]}
        return {i: min(caps[i], best_m) if i in drafting else 0 for i in ids}

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
