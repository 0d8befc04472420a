"""Goodput-driven speculation: how many drafted tokens each request verifies this round.

Every round the controller picks, per request, a draft length L_i in 0..K (0 = a plain
decode step) that maximises the batch's expected committed tokens per second:

    sum_i (1 + E[accepted_i | L_i]) / (draft_cost(#drafting) + verify_cost(query tokens))

- E[accepted | L] = sum_{k<=L} prod_{j<=k} a_j, with a_j the request's conditional
  acceptance of slot j (SpecStats: accepted / verified per slot), shrunk towards a global
  prior (every request's counts, per greedy / sampling) so new requests start informed.
- verify_cost(T) = c0 + c1 * T for T query tokens in the round (prefill rows included) and
  draft_cost(B) = d0 + d1 * B for B drafting requests: least-squares fits with forgetting
  over the rounds measured, so the model follows the device and the load.

The search is Dinkelbach's: for a throughput guess lam, each request extends its draft
while the next slot's expected acceptance exceeds lam * c1 (the acceptance of slot k is
non-increasing in k, so this is a prefix); lam is then the throughput of that choice;
repeat until it settles, and keep the better of that and no speculation at all. Exactness
never depends on the choice: any prefix of a draft is a valid proposal.

A request left without a draft for `probe_every` rounds drafts a whole block, so its
acceptance estimate and the draft cost stay current and speculation can come back.
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
    probe_every: int = 8  # a request left without a draft this many rounds in a row drafts a full block
    min_rounds_measured: int = 4  # before this many verify measurements, speculate fully


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
        self.last_plan: dict[int, int] = {}

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
        fixed_tokens = sum(0 if s.prefilled else len(s.tokens) - 1 for s in seqs)  # prefill rows' extra tokens
        if self.verify_cost.n < self.cfg.min_rounds_measured or not any(caps.values()):
            choice = dict(caps)
        else:
            choice = self._search(seqs, caps, fixed_tokens)
        # Probes: a request that has gone without a draft for a while drafts a whole block, so its
        # acceptance estimate (and the draft cost) stays current and speculation can come back.
        idle = {}
        for i, cap in caps.items():
            if cap and not choice[i]:
                idle[i] = self.idle.get(i, 0) + 1
                if idle[i] >= self.cfg.probe_every:
                    choice[i], idle[i] = cap, 0
        self.idle = idle
        for i in pinned:
            choice[i] = caps[i]
        for s in seqs:
            s.draft_limit = choice[s.seq_id]
        self.last_plan = choice
        return choice

    def _search(self, seqs: list[Sequence], caps: dict[int, int], fixed_tokens: int) -> dict[int, int]:
        n = len(seqs)
        c0, c1 = self.verify_cost.coef
        gains = {s.seq_id: np.cumprod(self.acceptance(s))[:caps[s.seq_id]] for s in seqs}  # slot k's expected acceptance

        def throughput(choice: dict[int, int]) -> float:
            T = n + fixed_tokens + sum(choice.values())
            B = sum(1 for v in choice.values() if v)
            committed = n + sum(float(np.sum(gains[i][:L])) for i, L in choice.items())
            cost = c0 + c1 * T + (self.draft_cost(B) if B else 0.0)
            return committed / max(cost, 1e-12)

        off = {i: 0 for i in caps}
        best, best_thr = off, throughput(off)
        lam = best_thr
        for _ in range(8):
            choice = {i: int(np.sum(g >= lam * c1)) for i, g in gains.items()}
            thr = throughput(choice)
            if thr > best_thr:
                best, best_thr = choice, thr
            if abs(thr - lam) <= 1e-6 * max(lam, 1e-12):
                break
            lam = thr
        # A request whose gain does not pay its share of the draft call drafts nothing.
        for i in [i for i, L in best.items() if L]:
            trial = {**best, i: 0}
            thr = throughput(trial)
            if thr > best_thr:
                best, best_thr = trial, thr
        return best

    # -- learning ----------------------------------------------------------------
    def observe(self, query_tokens: int, verify_s: float, drafting: int, draft_s: float,
                rounds: list[tuple[bool, int, int]]) -> None:
        """One round's measurements: the verify call's query tokens and seconds, the number of
        drafting requests and the draft call's seconds, and per drafted request (greedy,
        drafted, accepted)."""
        if verify_s > 0:
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
