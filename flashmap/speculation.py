"""Goodput-driven speculation: how many drafted tokens each request verifies this round.

Every round the controller picks, per request, a draft length L_i in 0..K (0 = a row without
a draft) that maximises the batch's expected committed tokens per second:

    sum_i (1 + E[accepted_i | L_i]) / (draft_cost(#drafting) + verify_cost(query tokens))

- E[accepted | L] = sum_{k<=L} prod_{j<=k} a_j, with a_j the request's conditional
  acceptance of slot j: the global per-slot rates (greedy and sampling apart) scaled by the
  request's own hazard ratio (`acceptance`).
- No speculation is worth n / verify_cost(n, n) tokens per second, or with `plain_tokens` > 1
  n * plain_tokens / plain_cost(n): the rate any plan must beat.
- verify_cost(n, T) = c0 + c_row * n + c_tok * (T - n) for n rows and T query tokens as the
  target runs them (`verify_tokens`: packed, the rows' total; padded, rows x the longest);
  draft_cost(B) = d0 + d1 * B for B drafting requests. Both are flashmap.online_fit fits over
  the rounds measured.

On a packed target every request gets its own length (Dinkelbach's iteration over the rate,
`plan_search.search_packed`); on a padded target the drafting requests share one length M
(`plan_search.search_shared`, every M and number of requests at once). A plan is kept only when it beats
no speculation. Exactness never depends on the choice: any prefix of a draft is a valid
proposal.

While speculation is off, probes keep the estimates current: every `probe_every` tokens the
request longest without a draft drafts its whole block, the interval doubling up to
`max_probe_every`. With `shadow_probes` a greedy probe drafts beside the rounds sent ahead and
is counted once the committed text decides it (`observe_shadows`, flashmap.shadow_probes).
With `lazy_features` rows send no features while nobody drafts; a request chosen to draft
whose context has a gap catches up first. The reasoning behind each rule, with its
measurements: docs/speculation.md.

Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashmap.drafts import SeqId
from flashmap.online_fit import OnlineLinear
from flashmap.plan_search import search_packed, search_shared
from flashmap.round_metadata import RoundPlan, RoundResult, SeqPlan
from flashmap.sequence import Sequence
from flashmap.shadow_probes import ShadowBlocks
from flashmap.types import BLOCK_SIZE, VerifyRow


@dataclass
class ControllerConfig:
    # A probe is the only news while speculation is off: a prior that outweighs it keeps
    # speculation off (see `acceptance`).
    prior_strength: float = 1.0  # pseudo-rejections at the global rates in a request's estimate
    prior_acceptance: float = 0.6  # per-slot acceptance assumed before any round is seen
    prior_rounds: float = 4.0  # ... weighing this many slot verifications (_global_rates)
    forget: float = 0.98  # cost fits: weight of a round measured n rounds ago is forget**n
    # Counted in tokens decoded per request (a round of plain_tokens counts that many), so a
    # multi-step round does not stretch the schedule plain_tokens-fold.
    probe_every: int = 32  # after this many tokens without speculation a request drafts a block ...
    max_probe_every: int = 256  # ... and after each such probe, twice as many
    probe_budget: float | None = (
        None  # probes may take at most this share of the time (None: the schedule alone)
    )
    verify_probe_every: int = (
        4  # with plain_tokens > 1: every n-th probe is a one-token round (measures the verify cost)
    )
    # While the search finds nothing worth drafting and what it depends on is unchanged (the
    # requests, any acceptance observed), it runs again only every this many rounds: the cost
    # fits drift slowly, and the search itself costs a share of a small round.
    recheck_every: int = 8
    packed: bool = True  # the target runs a verify packed (cost ~ total tokens); False: padded to the longest row
    margin: float = 0.0  # a plan must promise this much more throughput than no speculation
    explore_factor: int = (
        2  # a plan drafts for at most this many times the most requests a measured draft call had
    )
    plain_tokens: int = 1  # tokens per row of a round without drafts or prompts (flashmap.rounds)
    lazy_features: bool = (
        False  # rows without drafts send no features while speculation is off (see above)
    )
    shadow_probes: bool = (
        False  # greedy probes draft beside the rounds sent ahead, nothing verified (see above)
    )


@dataclass
class SpeculationController:
    block_size: int = BLOCK_SIZE
    cfg: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self):
        K = self.block_size
        # Global per-slot counts (verified, accepted), greedy and sampling separately, per tree
        # width (blocks verified as one tree; 1: a chain).
        c = self.cfg
        self.global_counts: dict[tuple[bool, int], tuple[np.ndarray, np.ndarray]] = {}
        # The round's seconds outside the draft call: c0 + c_row * rows + c_tok * (query tokens - rows).
        self.verify_cost = OnlineLinear((1e-2, 1e-4, 1e-4), c.forget, prior_weight=1e-3)
        self.draft_cost = OnlineLinear((1e-2, 1e-4), c.forget, prior_weight=1e-3)
        # The seconds of a round without drafts decoding plain_tokens tokens per row: plain + rows.
        self.plain_cost = OnlineLinear((1e-2, 1e-4), c.forget, prior_weight=1e-3)
        self.idle: dict[SeqId, int] = {}  # rounds in a row it could have drafted and did not
        self.probe_every = self.cfg.probe_every  # rounds without speculation before the next probe
        self.since_probe = 0
        self.probe_credit = 0.0  # seconds of probing earned (probe_budget x the rounds' time)
        self.drafted_rounds = 0  # rounds observed with drafts (acceptance news)
        self.probes = 0  # probes planned
        self.shadow = ShadowBlocks(K)  # the shadow probes' blocks and what they accepted
        self._nothing = (None, 0)  # (what the last search that found nothing saw, rounds since)
        self.most_drafting = 0  # the most drafting requests of a draft call measured
        self.drafted_last = (
            False  # the last plan with decoding requests let some draft (not a probe)
        )

    # -- estimates ---------------------------------------------------------------
    def acceptance(self, seqs: list[Sequence], width: int = 1) -> np.ndarray:
        """[n, K] conditional acceptance of each slot for these requests: the global per-slot
        rates with each request's rejection rate scaled by its own hazard ratio,
        1 - a_ij = (1 - g_j) * R_i. R_i is the Gamma-Poisson posterior mean of the request's
        rejections over those the global rates expect at the slots it verified, with
        `prior_strength` pseudo-rejections at ratio 1. One ratio per request pools every slot
        it verified, so a single rejection moves it a little and a request that keeps failing
        early soon stops drafting (a per-slot estimate has about one observation per slot)."""
        K, w = self.block_size, self.cfg.prior_strength
        rates = {g: self._global_rates(g, width) for g in {s.params.greedy for s in seqs}}
        # Later slots never count as more likely. This makes the expected gain fall short of
        # what drafted rounds realise, as it should: without the cap the controller drafted in
        # most rounds and served fewer tokens/s than with speculation off (costs the model
        # leaves out: desynchronised prefills, catch-up context; docs/experiments).
        g = np.stack([np.minimum.accumulate(rates[s.params.greedy]) for s in seqs])  # [n, K]
        shadow = [self.shadow.counts(s) for s in seqs]
        acc = np.stack([s.stats.accepted_per_slot[:K] + c[1, :K] for s, c in zip(seqs, shadow)])
        ver = np.stack([s.stats.verified_per_slot[:K] + c[0, :K] for s, c in zip(seqs, shadow)])
        rejected = (ver - acc).sum(1)  # [n]
        expected = (ver * (1.0 - g)).sum(1)  # [n] rejections the global rates predict
        ratio = (rejected + w) / (expected + w)  # [n]
        return np.clip(1.0 - (1.0 - g) * ratio[:, None], 0.0, 1.0)

    def _counts(self, greedy: bool, width: int) -> tuple[np.ndarray, np.ndarray]:
        key = (greedy, width)
        if key not in self.global_counts:
            self.global_counts[key] = (np.zeros(self.block_size), np.zeros(self.block_size))
        return self.global_counts[key]

    def _global_rates(self, greedy: bool, width: int = 1) -> np.ndarray:
        """[K] the global per-slot acceptance: each slot's counts shrunk towards the rate of all
        slots together, and that towards `prior_acceptance` (`prior_rounds` pseudo-verifications
        each). A slot that drafts seldom reach (the last ones, when plans stop short) is priced
        like the slots before it: shrunk to a fixed prior it would look worse the less it is
        tried, and the plans would never try it."""
        ver, acc = self._counts(greedy, width)
        w, p0 = self.cfg.prior_rounds, self.cfg.prior_acceptance
        if (
            width > 1
        ):  # before its own rounds: as if each of the blocks had its own try (optimistic,
            # so a tree is tried and measured), after them its counts
            p0 = 1.0 - (1.0 - self._global_rates(greedy, 1).mean()) ** width
        pooled = (acc.sum() + w * p0) / (ver.sum() + w)
        return (acc + w * pooled) / (ver + w)

    def expected_accepted(
        self, seqs: list[Sequence], lengths: list[int], widths: list[int] | None = None
    ) -> np.ndarray:
        """[n] the draft tokens the controller expects seqs[i] to have accepted when it verifies
        lengths[i] of them: what its plans weigh (set beside what the verify accepts, the
        calibration of the acceptance model)."""
        widths = widths or [1] * len(seqs)
        out = np.zeros(len(seqs))
        for w in set(widths):
            i = [j for j, x in enumerate(widths) if x == w]
            gain = self.expected_gain(self.acceptance([seqs[j] for j in i], w))  # [n_w, K + 1]
            out[i] = gain[np.arange(len(i)), np.asarray(lengths, np.int64)[i]]
        return out

    def expected(
        self, seqs: list[Sequence], rows: list[VerifyRow], plan: RoundPlan
    ) -> dict[SeqId, float]:
        """expected_accepted of the drafted rows of a round, by sequence (before the commits
        update the estimates): a row of n drafts as planned, a tree's depth as planned."""
        drafted = [(s, r) for s, r in zip(seqs, rows) if r.num_draft]
        if not drafted:
            return {}
        got = self.expected_accepted(
            [s for s, _ in drafted],
            [min(r.num_draft, plan.of(s).draft) for s, r in drafted],
            [plan.of(s).blocks if r.is_tree else 1 for s, r in drafted],
        )
        return {s.seq_id: float(e) for (s, _), e in zip(drafted, got)}

    @staticmethod
    def expected_gain(a: np.ndarray) -> np.ndarray:
        """[n, K+1] expected accepted tokens for draft lengths 0..K, from acceptance a [n, K]."""
        return np.concatenate(
            [np.zeros((len(a), 1)), np.cumsum(np.cumprod(a, axis=1), axis=1)], axis=1
        )

    # -- the choice --------------------------------------------------------------
    def plan(self, seqs: list[Sequence], blocks: int = 1) -> RoundPlan:
        """This round's plan: each sequence's draft length, whether it drafts a tree (up to
        `blocks` blocks from independent noise, or its request's tree_blocks) where the larger
        verify pays (`_search`), whether its row brings features, the probes."""
        probing, shadow, width = False, {}, 1
        caps = {s.seq_id: (s.draft_cap(context=False) if not s.context.lost else 0) for s in seqs}
        gaps = {s.seq_id for s in seqs if s.context_gap() is not None}
        catch_up: set[SeqId] = set()  # chosen to draft, their context has a gap: rows fetch it
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
            key = (self.drafted_rounds, tuple((s.seq_id, s.prefilled) for s in seqs))
            seen, age = self._nothing
            if key == seen and age + 1 < self.cfg.recheck_every:
                choice, self._nothing = {i: 0 for i in caps}, (key, age + 1)
            else:
                choice, width = self._search(seqs, caps, blocks)
                self._nothing = (key, 0) if not any(choice.values()) else (None, 0)
        # Probes: while speculation is off, every `probe_every` tokens the request that has gone
        # longest without a draft drafts its whole block, so the per-slot acceptance (and the draft
        # cost) stays current and speculation can come back. One request: a probe pads every row
        # of the verify to its length and adds to the draft call. Probes that keep finding
        # speculation off come rarer; a round the search lets draft starts over.
        speculating = any(choice.values())
        if speculating:
            self.probe_every, self.since_probe = self.cfg.probe_every, 0
        elif idle:
            self.since_probe += self.cfg.plain_tokens if all(s.prefilled for s in seqs) else 1
            first = self.verify_cost.n == 0
            probe = max(idle, key=idle.__getitem__)  # the first of the longest idle
            due = self.since_probe >= self.probe_every
            shadowed = (
                due
                and self.cfg.shadow_probes
                and not first
                and self.probes % self.cfg.verify_probe_every != 0
                and next(s for s in seqs if s.seq_id == probe).params.greedy
            )
            if shadowed and self._may_probe():  # its row fetches any missing features: no catch-up
                shadow = {probe: caps[probe]}
                self.probe_every = min(2 * self.probe_every, self.cfg.max_probe_every)
                self.since_probe = 0
                self.probes += 1
            elif due and probe in gaps:
                catch_up.add(probe)  # it probes once its context is whole; the schedule waits
            elif due and not shadowed and (first or self._may_probe()):
                i = probe
                choice[i] = caps[i]
                self.probe_every = min(2 * self.probe_every, self.cfg.max_probe_every)
                self.since_probe = 0
                probing = not first and self.probes % self.cfg.verify_probe_every != 0
                self.probes += 1
        for i in pinned:
            choice[i] = caps[i]
        for i in gaps:
            if choice[i]:
                choice[i] = 0
                catch_up.add(i)
        self.idle = {i: n for i, n in idle.items() if not choice[i] and i not in shadow}
        drafting = speculating and any(choice.values())
        lazy = self.cfg.lazy_features and not drafting
        prompts_fetch = self.verify_cost.n == 0 or self.drafted_last
        if any(caps.values()):
            self.drafted_last = drafting
        keep = catch_up | pinned | shadow.keys()
        # A seeded sampling request keeps its own tree width too (its text depends on it).
        tree = lambda s: s.request.tree_blocks or blocks  # noqa: E731
        plans = {
            s.seq_id: SeqPlan(
                choice[s.seq_id],
                tree(s) if width > 1 or s.seq_id in pinned else 1,
                s.may_draft()
                and not (lazy and s.seq_id not in keep and (s.prefilled or not prompts_fetch)),
            )
            for s in seqs
        }
        return RoundPlan(plans, self.cfg.plain_tokens, probing, shadow, choice)

    # What plan() changes (each attribute is reassigned, never mutated).
    _PLAN_STATE = (
        "probe_every",
        "since_probe",
        "probe_credit",
        "_nothing",
        "idle",
        "probes",
        "drafted_last",
    )

    def peek(self, seqs: list[Sequence]) -> RoundPlan:
        """The plan `plan(seqs)` would make now, without making it (the probe schedule and the
        search's memo stay as they are)."""
        state = {k: getattr(self, k) for k in self._PLAN_STATE}
        try:
            return self.plan(seqs)
        finally:
            for k, v in state.items():
                setattr(self, k, v)

    def _probe_s(self) -> float:
        """What a probe costs: about one drafting request's call and K verified tokens."""
        return sum(self.draft_cost.coef) + self.verify_cost.coef[2] * self.block_size

    def _may_probe(self) -> bool:
        """Within the budget (probe_budget)."""
        if self.cfg.probe_budget is None:
            return True
        cost = self._probe_s()
        if self.probe_credit < cost:
            return False
        self.probe_credit -= cost
        return True

    def _search(
        self, seqs: list[Sequence], caps: dict[SeqId, int], blocks: int = 1
    ) -> tuple[dict[SeqId, int], int]:
        """The best plan's draft lengths and tree width: chains (width 1), or trees of `blocks`
        blocks, each drafted token verified `width` times over and the draft call drawing as
        many blocks; the width whose plan promises the higher rate."""
        dec = [s for s in seqs if s.prefilled]
        prompts = [len(s.tokens) for s in seqs if not s.prefilled]  # prefill rows: the prompt
        if not dec:
            return {s.seq_id: 0 for s in seqs}, 1
        cap = np.array([caps[s.seq_id] for s in dec], np.int64)
        search = search_packed if self.cfg.packed else search_shared
        most = max(1, self.cfg.explore_factor * self.most_drafting)
        best = None
        for width in sorted({1, blocks}):
            gain = self.expected_gain(self.acceptance(dec, width))  # [nd, K + 1]
            lengths, rate = search(self, len(seqs), prompts, gain, cap, most, width)
            if best is None or (lengths.any() and rate > best[1]):
                best = (lengths, rate, width)
        chosen = {s.seq_id: int(m) for s, m in zip(dec, best[0])}
        return {s.seq_id: chosen.get(s.seq_id, 0) for s in seqs}, best[2]

    def _plan_tokens(self, prompts: list[int], nd: int, m: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[len(m), len(b)] query tokens of a verify with these prefill rows and nd decode rows,
        b of them drafting m tokens (rows of m + 1) and the others rows of 1."""
        mm, bb = np.meshgrid(m, b, indexing="ij")  # [M, B]
        if self.cfg.packed:
            return sum(prompts) + nd + bb * mm
        longest = np.maximum(np.where(bb > 0, mm + 1, 1), max(prompts, default=1))
        return (len(prompts) + nd) * longest

    def _plain_rate(self, n: int, verify_s: float, prompts: list[int]) -> float:
        """Tokens per second of this round without drafts: one verify of `verify_s` seconds, or
        with plain_tokens > 1 and no prompt, plain_tokens tokens per row in the time the plain
        fit measured (until it has a round: as if the extra steps were free, so the first
        round without drafts runs them and measures). A round of S steps costs at most S
        one-token verifies (the same forwards, one call instead of S): the bound keeps a plain
        fit that has not seen this many rows from pricing plain rounds out (a fit from one round
        of one row can price many rows far above their cost, and if the plans then draft, no
        plain round comes to correct it); a plain round chosen is measured."""
        S = self.cfg.plain_tokens
        if S == 1 or prompts:
            return n / max(verify_s, 1e-9)
        plain = self.plain_cost(n) if self.plain_cost.n else verify_s
        if verify_s > 0:  # a verify fit from rounds of one row count can say 0 here: no bound then
            plain = min(plain, S * verify_s)
        return n * S / max(plain, 1e-9)

    def _verify_s(self, rows: int, tokens):
        """The verify fit at `rows` rows and `tokens` query tokens (scalar or array)."""
        c0, c_row, c_tok = self.verify_cost.coef
        return c0 + c_row * rows + c_tok * (tokens - rows)

    def verify_tokens(self, lengths: list[int]) -> int:
        """The x of the verify-cost fit for a verify of rows with these lengths."""
        return sum(lengths) if self.cfg.packed else len(lengths) * max(lengths, default=0)

    # -- learning ----------------------------------------------------------------
    def observe(self, out: RoundResult) -> None:
        """One round's measurements: its rows, query tokens (`verify_tokens`) and seconds outside
        the draft call, the drafting requests and the draft call's seconds, and per drafted
        request what it accepted; then the shadow probes its commits decide. A round with a
        prompt row (attention over the whole prompt is not what a decode round's tokens cost)
        leaves the verify fit alone. A round without drafts that decoded plain_tokens > 1
        tokens per row feeds the plain fit when that is the configured count; a mixed probe
        round (drafts beside multi-step rows) feeds neither."""
        self.observe_shadows([r.seq for r in out.sequences])
        rows, rest_s = len(out.row_lengths), out.rest_s
        if self.cfg.probe_budget is not None:  # at most a few probes' worth saved up
            self.probe_credit = min(
                self.probe_credit + self.cfg.probe_budget * (rest_s + out.draft_s),
                3 * self._probe_s(),
            )
        drafted = [r for r in out.sequences if r.drafted]
        if out.plain_tokens > 1:
            plain = not drafted and out.plain_tokens == self.cfg.plain_tokens
            if rest_s > 0 and not out.prefill and plain:
                self.plain_cost.add(rows, rest_s)
        elif rest_s > 0 and not out.prefill:
            self.verify_cost.add((rows, self.verify_tokens(out.row_lengths) - rows), rest_s)
        self.observe_draft(out.drafting, out.draft_s)
        self.drafted_rounds += bool(drafted)
        for r in drafted:
            p = out.plan.of(r.seq)  # a tree verifies more nodes than its depth, the plan's length
            reach = min(r.drafted, p.draft or r.drafted, r.accepted + 1)
            self._count(r.seq.params.greedy, reach, r.accepted, p.blocks)

    def observe_draft(self, drafting: int, draft_s: float) -> None:
        """A draft call's seconds for `drafting` requests (a round's, or a shadow probe's)."""
        if drafting and draft_s > 0:
            self.draft_cost.add(drafting, draft_s)
            self.most_drafting = max(self.most_drafting, drafting)

    def _count(self, greedy: bool, verified: int, accepted: int, width: int = 1) -> None:
        """One block's (or tree's of `width` blocks) outcome in the global per-slot counts: its
        first `verified` slots were reached, the first `accepted` accepted."""
        ver, acc = self._counts(greedy, width)
        ver *= 0.999  # slow forgetting: the prior follows the workload
        acc *= 0.999
        ver[:verified] += 1
        acc[:accepted] += 1

    def observe_shadows(self, seqs: list[Sequence]) -> None:
        """Count the shadow blocks the committed text now decides (flashmap.shadow_probes)."""
        for verified, accepted in self.shadow.decide(seqs):
            self._count(True, verified, accepted)
            self.drafted_rounds += 1  # acceptance news: the search runs again
