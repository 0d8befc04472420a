"""The speculation controller (flashmap.speculation): its choices from measured costs, and
that switching speculation on and off mid-request keeps T = 0 output exact."""

from __future__ import annotations

import numpy as np
import pytest

from bench.controller_sim import controller, simulate
from drafter_service.oracle import OracleProposer
from flashmap.inprocess import decode
from flashmap.sequence import Sequence
from flashmap.speculation import ControllerConfig, OnlineLinear, SpeculationController
from flashmap.types import GenerationRequest, SamplingParams
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3

K = 16


def _seqs(n: int, acceptance: float, rounds: int = 50) -> list[Sequence]:
    """n prefilled greedy sequences whose history accepted each slot with `acceptance`."""
    out = []
    for i in range(n):
        s = Sequence(i, GenerationRequest([1, 2, 3], max_new_tokens=500), K)
        s.prefilled = True
        s.tokens.append(4)
        rng = np.random.default_rng(i)
        for _ in range(rounds):
            acc = 0
            while acc < K and rng.random() < acceptance:
                acc += 1
            s.stats.record_round(K, acc)
        out.append(s)
    return out


def _controller(
    verify: tuple[float, float], draft: tuple[float, float], packed: bool = True
) -> SpeculationController:
    """A controller whose cost fits have seen rounds of verify_s = v0 + v1 * tokens (rows and
    drafted tokens alike), draft_s = d0 + d1 * batch."""
    c = SpeculationController(K, ControllerConfig(probe_every=10**9, packed=packed))  # no probes
    for rows in (1, 4, 16):
        for extra in (0, 3, 16, 64, 240):
            c.verify_cost.add((rows, extra), verify[0] + verify[1] * (rows + extra))
    for b in (1, 2, 8, 16):
        c.draft_cost.add(b, draft[0] + draft[1] * b)
    c.most_drafting = 16  # the draft calls those were
    return c


def test_online_linear_recovers_a_cost_line():
    f = OnlineLinear((0.0, 0.0))
    for x in range(1, 40):
        f.add(x, 0.003 + 0.0002 * x)
    assert f.coef == pytest.approx((0.003, 0.0002), rel=1e-3)


def test_cost_fit_keeps_the_token_price_while_speculation_is_off():
    """Rows and drafted tokens are fitted apart. After rounds that drafted, hundreds of rounds
    without drafts (the token direction does not vary) leave the token price where the
    drafted rounds put it, instead of letting the per-row cost or noise take it over."""
    rng = np.random.default_rng(0)
    f = OnlineLinear((1e-2, 1e-4, 1e-4))
    cost = lambda rows, extra: 0.004 + 4e-4 * rows + 1.4e-4 * extra  # noqa: E731
    for _ in range(40):
        rows, extra = int(rng.integers(2, 17)), int(rng.integers(0, 60))
        f.add((rows, extra), cost(rows, extra))
    for _ in range(300):
        rows = int(rng.integers(14, 17))
        f.add((rows, 0), cost(rows, 0) * (1 + 0.05 * rng.standard_normal()))
    c0, c_row, c_tok = f.coef
    assert c_tok == pytest.approx(1.4e-4, rel=0.1) and c_row == pytest.approx(4e-4, rel=0.3)


def test_a_packed_target_lets_the_best_requests_draft_alone():
    """Two requests that accept nearly everything among fourteen that accept nothing, on a
    compute-bound target: padded to one pass, every row would pay for their 17 tokens and
    speculation is off; a packed target (target_service.packing) charges only their own
    tokens, so those two draft (most of) their block."""
    seqs = _seqs(2, acceptance=0.99) + _seqs(14, acceptance=0.02)
    for i, s in enumerate(seqs):
        s.seq_id = i
    padded = _controller(verify=(0.004, 1e-4), draft=(0.001, 1e-5), packed=False)
    assert set(padded.plan(seqs).values()) == {0}
    packed = _controller(verify=(0.004, 1e-4), draft=(0.001, 1e-5))
    plan = packed.plan(seqs)
    assert {i for i, n in plan.items() if n} == {0, 1} and min(plan[0], plan[1]) >= K // 2


def test_full_block_when_acceptance_is_high_and_verify_is_cheap():
    c = _controller(verify=(0.010, 1e-6), draft=(0.001, 1e-5))  # memory-bound device: flat verify
    seqs = _seqs(4, acceptance=0.95)
    assert set(c.plan(seqs).values()) == {K}
    assert all(s.draft_budget() == K for s in seqs)


@pytest.mark.parametrize("packed", [True, False])
def test_plans_draft_for_at_most_twice_the_requests_a_measured_draft_call_had(packed):
    """A draft-cost fit that has only seen probes (one request per call: how the cost grows
    with the batch is unknown) does not let a whole batch draft at its guess: a plan drafts
    for at most explore_factor x the most requests measured, and each wider call measured lets
    the next plans go wider."""
    c = _controller(verify=(0.010, 1e-6), draft=(0.001, 1e-5), packed=packed)
    c.draft_cost, c.most_drafting = (
        type(c.draft_cost)((1e-2, 1e-4), c.cfg.forget, prior_weight=1e-3),
        0,
    )
    for _ in range(4):
        c.observe(1, 17, 0.011, 1, 0.012, [(True, K, K)])  # probes: one request per draft call
    assert c.most_drafting == 1
    seqs = _seqs(12, acceptance=0.95)
    widths = []
    for _ in range(4):
        plan = c.plan(seqs)
        widths.append(sum(1 for v in plan.values() if v))
        c.observe(
            12,
            12 + widths[-1] * K,
            0.011,
            widths[-1],
            0.012 + 0.001 * widths[-1],
            [(True, K, K)] * widths[-1] + [(True, 0, 0)] * (12 - widths[-1]),
        )
    assert widths == [2, 4, 8, 12]


def test_a_plain_fit_from_one_small_round_does_not_price_plain_rounds_out():
    """With decode_steps = 8, a plain fit that has seen one round of one row (43 ms) says
    nothing about 16 rows; its line put them at 290 ms, so drafting looked better than plain
    rounds that take ~100 ms and none ran to correct it. A round of S steps costs at most S
    one-token verifies: with that bound the controller keeps the 8-step rounds."""
    c = SpeculationController(
        K, ControllerConfig(probe_every=10**9, decode_steps=8, recheck_every=1)
    )
    for rows, extra in ((1, 16), (16, 0), (16, 3), (16, 16)):
        c.verify_cost.add((rows, extra), 0.010 + 0.0005 * rows + 0.0002 * extra)
    for b in (1, 2, 4, 8):
        c.draft_cost.add(b, 0.008 + 0.0013 * b)
    c.most_drafting = 8
    seqs = _seqs(16, acceptance=0.5)
    c.plain_cost.add(1, 0.043)
    assert c.plain_cost(16) > 8 * c._verify_s(16, 16)  # the one-point line's guess
    assert not any(c.plan(seqs).values())
    assert any(c.plan(_seqs(16, acceptance=0.95)).values())  # where drafting pays, it still drafts


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_a_verify_fit_that_says_zero_for_plain_rows_does_not_break_the_plan(decode_steps):
    """Rounds of one row count only (4 rows, with and without drafted tokens) leave the row
    cost unidentified; the fit can put it all on the drafted tokens and price a verify
    without drafts at 0 s. plan() still chooses (no division by zero)."""
    c = SpeculationController(K, ControllerConfig(probe_every=10**9, decode_steps=decode_steps))
    # The fit's state in a run of test_mixed_probe_rounds_are_exact (two rounds, 4 rows each).
    c.verify_cost.A = np.array(
        [[1.98, 7.92, 47.68], [7.92, 31.68, 190.72], [47.68, 190.72, 1274.88]]
    )
    c.verify_cost.b, c.verify_cost.n = np.array([0.005823288, 0.023293153, 0.158694597]), 2
    c.plain_cost.add(4, 0.02)
    c.draft_cost.add(1, 0.003)
    assert c._verify_s(4, 4) == 0.0
    assert set(c.plan(_seqs(4, acceptance=0.5)).values()) <= set(range(K + 1))


def test_no_speculation_when_verify_cost_per_token_exceeds_the_gain():
    # Compute-bound: every query token costs as much as a whole one-token step's overhead.
    c = _controller(verify=(0.001, 0.004), draft=(0.003, 0.001))
    seqs = _seqs(16, acceptance=0.3)
    assert set(c.plan(seqs).values()) == {0}
    assert all(s.draft_budget() == 0 for s in seqs)


def test_multi_step_plain_rounds_raise_the_rate_a_plan_must_beat():
    """decode_steps = 8: a round without drafts decodes 8 tokens per call. Where a verify's
    fixed cost dominates, moderate acceptance beats one-token rounds but not 8-token rounds
    that cost what the plain fit measured; a high acceptance still drafts, and plain rounds
    measured as slow bring speculation back."""
    seqs = _seqs(4, acceptance=0.6)
    assert all(_controller(verify=(0.010, 1e-4), draft=(0.002, 1e-4)).plan(seqs).values())
    c = _controller(verify=(0.010, 1e-4), draft=(0.002, 1e-4))
    c.cfg.decode_steps = 8
    assert set(c.plan(seqs).values()) == {
        0
    }  # nothing measured: the extra steps look free, so it runs them
    for _ in range(20):  # measured: the call's 10 ms once, then 1.5 ms a step
        c.observe(4, 4, 0.010 + 0.0004 + 7 * 0.0015, 0, 0.0, [], decode_steps=8)
    c.observe(
        4, 4, 0.5, 0, 0.0, [], decode_steps=3
    )  # a shorter round (requests near their end): not fitted
    assert c.plain_cost.n == 20 and c.verify_cost.n == 15
    assert set(c.plan(seqs).values()) == {0}
    good = _seqs(4, acceptance=0.98)
    for s in good:
        s.seq_id += 100  # other requests (the search reruns)
    assert min(c.plan(good).values()) >= K // 2
    for _ in range(200):  # plain rounds as slow as 8 one-token verifies
        c.observe(4, 4, 8 * 0.0104, 0, 0.0, [], decode_steps=8)
    assert all(c.plan(seqs).values())


def test_a_long_prompt_beside_decode_rows_does_not_make_drafting_free():
    """A round with a 200-token prompt: padded to one pass, the decode rows' drafts would ride
    on the prompt's padding for free. The engine packs the rows (target_service.packing), and
    the controller prices each plan so: drafts that do not pay in a decode round do not pay
    beside the prompt either, and good ones still do."""
    c = _controller(verify=(0.010, 2e-5), draft=(0.003, 5e-4))
    prompt = Sequence(99, GenerationRequest(list(range(3, 203)), max_new_tokens=10), K)
    poor, good = _seqs(8, acceptance=0.05), _seqs(8, acceptance=0.97)
    assert set(c.plan(poor).values()) == set(c.plan(poor + [prompt]).values()) == {0}
    assert min(c.plan(good).values()) >= K // 2
    assert {v for i, v in c.plan(good + [prompt]).items() if i != 99} == {K}


@pytest.mark.parametrize("packed", [True, False])
def test_plan_price_is_what_the_round_is_charged(packed):
    """The search prices a plan with the count the cost fit is fed after the round."""
    c = _controller(verify=(0.010, 2e-5), draft=(0.003, 5e-4), packed=packed)
    for prompts in ([], [200], [30, 7]):
        for m, b in ((0, 0), (3, 5), (K, 8), (1, 1)):
            rows = prompts + [m + 1] * b + [1] * (8 - b)
            assert c._plan_tokens(prompts, 8, np.array([max(m, 1)]), np.array([b]))[
                0, 0
            ] == c.verify_tokens(rows)


def test_length_between_follows_the_per_slot_acceptance():
    c = _controller(verify=(0.010, 2e-4), draft=(0.002, 1e-4))
    lengths = [max(c.plan(_seqs(2, acceptance=a)).values()) for a in (0.5, 0.8, 0.97)]
    assert 0 < lengths[0] < lengths[1] <= lengths[2] <= K


def test_on_a_padded_target_drafting_requests_share_one_length():
    """The verify pads rows to the longest, so a request that drafts less than the others
    pays as much: the requests that draft get one length (their caps permitting), and one
    whose acceptance does not pay its part of the draft call drafts nothing."""
    c = _controller(verify=(0.010, 2e-4), draft=(0.002, 0.004), packed=False)
    seqs = _seqs(3, acceptance=0.95) + _seqs(1, acceptance=0.05)
    seqs[-1].seq_id = 3
    plan = c.plan(seqs)
    assert len({plan[i] for i in range(3)}) == 1 and plan[0] > 0
    assert plan[3] == 0


def test_on_a_packed_target_each_request_gets_its_best_length():
    """Each drafted token costs its own verify time: the plan is the best of every plan of
    per-request lengths (brute force over all of them), longer for requests that accept more."""
    import itertools

    for verify, draft in (
        ((0.010, 2e-4), (0.002, 0.004)),
        ((0.004, 1e-3), (0.001, 1e-4)),
        ((0.01, 1e-5), (0.003, 1e-3)),
    ):
        c = _controller(verify=verify, draft=draft)
        seqs = _seqs(1, acceptance=0.97) + _seqs(1, acceptance=0.8) + _seqs(1, acceptance=0.4)
        for i, s in enumerate(seqs):
            s.seq_id = i
        plan = c.plan(seqs)
        gain = c.expected_gain(c.acceptance(seqs))
        d0, d1 = c.draft_cost.coef

        def rate(ls):
            drafting = sum(1 for x in ls if x)
            cost = c._verify_s(3, 3 + sum(ls)) + (d0 + d1 * drafting if drafting else 0.0)
            return (3 + sum(gain[i, x] for i, x in enumerate(ls))) / cost

        best = max(itertools.product(range(K + 1), repeat=3), key=rate)
        assert rate([plan[i] for i in range(3)]) == pytest.approx(rate(best), rel=1e-9)
        assert plan[0] >= plan[1] >= plan[2]
    assert plan[0] > plan[2]  # cheap tokens, dear draft calls: the lengths differ


def test_probe_turns_speculation_back_on():
    c = _controller(verify=(0.001, 0.004), draft=(0.003, 0.001))
    c.cfg.probe_every = c.probe_every = 3
    c.cfg.probe_budget = None  # the schedule alone
    seqs = _seqs(2, acceptance=0.3)
    plans = [c.plan(seqs) for _ in range(22)]
    assert {v for p in plans for v in p.values()} == {0, K}
    assert all(sum(1 for v in p.values() if v) <= 1 for p in plans)  # one probe per round
    # A probe after 3 rounds without speculation, then 2x rarer each time, the request longest
    # without a draft first.
    probes = [[r for r, p in enumerate(plans) if p[s.seq_id]] for s in seqs]
    assert probes == [[2, 20], [8]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_random_qwen3(
        tmp_path_factory.mktemp("spec") / "t",
        vocab_size=256,
        num_hidden_layers=2,
        seed=5,
        with_tokenizer=False,
    )
    return TargetEngine(path, n_slots=4, max_seq_len=256)


def test_switching_speculation_on_and_off_mid_request_is_exact(tiny):
    """A controller that alternates between no draft, a partial draft and the full block (and
    whose first rounds speculate fully): every T = 0 output equals the target alone's."""
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13], [14]]
    reqs = lambda: [GenerationRequest(p, 40, SamplingParams()) for p in prompts]  # noqa: E731
    alone = [r.token_ids for r in decode(tiny, reqs())]
    refs = [p + a for p, a in zip(prompts, alone)]

    class Alternating(SpeculationController):
        calls = 0

        def plan(self, seqs):
            Alternating.calls += 1
            for s in seqs:
                s.draft_limit = None
                s.draft_limit = min(s.draft_budget(), (0, 3, K)[Alternating.calls % 3])
            return {s.seq_id: s.draft_limit for s in seqs}

    oracle = OracleProposer(refs, K, tiny.vocab_size, error_rate=0.1, seed=2)
    out = decode(tiny, reqs(), oracle, controller=Alternating(K))
    assert [r.token_ids for r in out] == alone
    lens = {int(n) for r in out for n in np.nonzero(r.stats.drafted_per_slot)[0]}
    assert (
        Alternating.calls > 6 and max(lens) == K - 1 and 2 in lens
    )  # full and partial drafts happened
    assert all(r.stats.rounds > r.stats.drafts > 0 for r in out)  # and rounds without a draft

    # The real controller, learning on this CPU, is exact too.
    out = decode(
        tiny,
        reqs(),
        OracleProposer(refs, K, tiny.vocab_size, error_rate=0.1, seed=2),
        controller=SpeculationController(K),
    )
    assert [r.token_ids for r in out] == alone


@pytest.mark.parametrize("packed", [True, False])
def test_a_plan_must_beat_no_speculation_by_the_margin(packed):
    """The margin is the throughput a plan must promise beyond no speculation: the same plan
    that is taken at margin 0 is refused once the margin exceeds what it promises."""
    c = _controller(verify=(0.010, 2e-4), draft=(0.002, 1e-4), packed=packed)
    seqs = _seqs(4, acceptance=0.8)
    c.cfg.margin = 0.0
    plan = c.plan(seqs)
    assert any(plan.values())
    gain = c.expected_gain(c.acceptance(seqs))
    d0, d1 = c.draft_cost.coef
    lengths = [plan[s.seq_id] for s in seqs]
    tokens = c.verify_tokens([m + 1 for m in lengths])
    promised = (4 + sum(gain[i, m] for i, m in enumerate(lengths))) / (
        c._verify_s(4, tokens) + d0 + d1 * sum(map(bool, lengths))
    )
    over = promised / (4 / c._verify_s(4, 4)) - 1
    c.cfg.margin = over * 0.9
    assert c.plan(seqs) == plan
    c.cfg.margin = over * 1.1
    assert not any(c.plan(seqs).values())


def test_probes_stay_within_their_share_of_the_time():
    """With speculation off and probes due every round, the probes' estimated cost stays within
    probe_budget of the rounds' measured time."""
    c = _controller(verify=(0.004, 1e-3), draft=(0.003, 0.001))
    c.cfg.probe_every = c.probe_every = c.cfg.max_probe_every = 1
    c.cfg.probe_budget = 0.02
    seqs = _seqs(4, acceptance=0.1)
    probes, spent = 0, 0.0
    for _ in range(400):
        plan = c.plan(seqs)
        drafted = sum(1 for v in plan.values() if v)
        probes += drafted
        round_s = 0.008 + (0.004 + 0.016 if drafted else 0.0)
        spent += round_s
        c.observe(4, 4 + sum(plan.values()), round_s, drafted, 0.004 if drafted else 0.0, [])
    d0, d1 = c.draft_cost.coef
    per_probe = d0 + d1 + c.verify_cost.coef[2] * K
    assert probes >= 3 and probes * per_probe <= c.cfg.probe_budget * spent + 3 * per_probe


def test_a_negative_weight_is_refitted_not_clipped():
    """Rounds of nearly one row count where fewer rows happened to be slower: the unconstrained
    row weight is negative; fixed at 0, the intercept is refitted, and the prediction at the
    usual row count stays what was measured."""
    f = OnlineLinear((1e-2, 1e-4, 1e-4))
    for i in range(200):
        rows = 4 if i % 10 else 3
        f.add(
            (rows, 0 if i % 5 else 16),
            (0.0092 if rows == 4 else 0.0110) + (0.003 if i % 5 == 0 else 0.0),
        )
    c0, c_row, c_tok = f.coef
    assert min(c0, c_row, c_tok) >= 0
    assert f((4, 0)) == pytest.approx(0.0092, rel=0.1)


def test_a_search_that_found_nothing_is_rerun_only_when_something_changed():
    """Speculation off: the search runs every recheck_every rounds, and at once after a round
    with drafts (new acceptance) or when the requests change."""
    c = _controller(verify=(0.001, 0.004), draft=(0.003, 0.001))
    calls = []
    search = c._search
    c._search = lambda seqs, caps: calls.append(len(seqs)) or search(seqs, caps)
    seqs = _seqs(4, acceptance=0.3)
    for _ in range(16):
        assert not any(c.plan(seqs).values())
    assert len(calls) == 16 // c.cfg.recheck_every
    c.observe(4, 20, 0.01, 1, 0.005, [(True, 16, 2)])  # a probe's round
    c.plan(seqs)
    c.plan(seqs[:3])  # a request left
    assert len(calls) == 16 // c.cfg.recheck_every + 2


class _SilentDrafter:
    """A drafter that drafts nothing and keeps no context (the sequences keep it pending)."""

    block_size = K

    async def draft(self, seqs, n_blocks):
        from flashmap.rounds import DraftBatch

        return DraftBatch()

    async def release(self, seqs):
        pass


def test_multi_step_rounds_give_the_drafter_the_same_context(tiny):
    """What a sequence holds for the drafter (context tokens and the target's features) after
    rounds of 5 tokens per call equals what one-token rounds give: the decoded tokens line up
    with the features of the steps that took them as input."""
    from flashmap.inprocess import LocalTarget
    from flashmap.rounds import run_local, speculative_round

    contexts = {}
    for steps in (1, 5):
        seq = Sequence(
            1, GenerationRequest([3, 4, 5, 6, 7], 13, SamplingParams()), K, handle=tiny.allocate()
        )
        while not seq.finished:
            run_local(
                speculative_round([seq], LocalTarget(tiny), _SilentDrafter(), decode_steps=steps)
            )
        tiny.release(seq.handle)
        contexts[steps] = (seq.generated, seq.context_for_drafter())
    (gen1, (start1, ids1, f1)), (gen5, (start5, ids5, f5)) = contexts[1], contexts[5]
    assert gen1 == gen5 and start1 == start5 == 0
    assert ids5.tolist() == ids1.tolist() == [3, 4, 5, 6, 7] + gen1[:-1]
    np.testing.assert_allclose(np.concatenate(f5), np.concatenate(f1), rtol=1e-5, atol=1e-5)


def test_probes_beside_multi_step_rounds_let_the_others_decode_on():
    """decode_steps = 8: after the first, most probes are mixed rounds (`probing`: the others
    decode 8 tokens each) whose seconds fit neither cost model; every verify_probe_every-th
    probe is a one-token round that measures the verify cost."""
    c = _controller(verify=(0.010, 1e-3), draft=(0.002, 1e-4))
    c.cfg.decode_steps, c.cfg.verify_probe_every = 8, 3
    c.cfg.probe_every = c.cfg.max_probe_every = c.probe_every = 16  # 2 rounds of 8 tokens
    seqs = _seqs(4, acceptance=0.2)
    kinds = []
    for _ in range(16):
        plan = c.plan(seqs)
        if any(plan.values()):
            kinds.append("mixed" if c.probing else "one-token")
        else:
            assert not c.probing
    assert kinds == ["one-token", "mixed", "mixed"] * 2 + ["one-token", "mixed"]
    fits = (c.verify_cost.n, c.plain_cost.n, c.draft_cost.n)
    c.observe(4, 4 + K, 0.2, 1, 0.003, [(True, K, 2)], decode_steps=8)  # a mixed round
    assert (c.verify_cost.n, c.plain_cost.n, c.draft_cost.n) == (fits[0], fits[1], fits[2] + 1)
    assert c.drafted_rounds == 1  # its acceptance counts


def test_mixed_probe_rounds_are_exact(tiny):
    """The real controller with 8 tokens per call, probing often: probe rounds verify one
    request's draft beside the others' 8-token rows in one call, and every T = 0 output equals
    the target alone's."""
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13], [14]]
    reqs = lambda: [GenerationRequest(p, 40, SamplingParams()) for p in prompts]  # noqa: E731
    alone = [r.token_ids for r in decode(tiny, reqs())]
    calls = []
    verify = tiny.verify

    def recording(rows, **kw):
        calls.append([(r.num_draft, r.steps) for r in rows])
        return verify(rows, **kw)

    tiny.verify = recording
    try:
        ctl = SpeculationController(
            K,
            ControllerConfig(
                decode_steps=8, probe_every=16, max_probe_every=16, verify_probe_every=2
            ),
        )
        oracle = OracleProposer(
            [p + a for p, a in zip(prompts, alone)], K, tiny.vocab_size, error_rate=0.9, seed=3
        )
        out = decode(tiny, reqs(), oracle, controller=ctl, decode_steps=8)
    finally:
        del tiny.verify
    assert [r.token_ids for r in out] == alone
    mixed = [c for c in calls if any(k for k, _ in c) and any(s > 1 for _, s in c)]
    assert mixed and all(
        sum(1 for k, _ in c if k) == 1 for c in mixed
    )  # one probing request beside 8-token rows


def test_peek_is_the_plan_without_making_it():
    """peek returns what plan would choose (here a probe) and leaves the schedule, the search
    memo and the draft limits as they were; plan then makes that choice."""
    c = _controller(verify=(0.010, 1e-3), draft=(0.002, 1e-4))
    c.cfg.probe_every = c.probe_every = 2
    seqs = _seqs(3, acceptance=0.2)
    assert not any(c.plan(seqs).values())
    state = (
        c.since_probe,
        c.probe_every,
        c.probes,
        c._nothing,
        dict(c.idle),
        [s.draft_limit for s in seqs],
    )
    peeked = c.peek(seqs)
    assert any(peeked.values())  # the probe is due
    assert (
        c.since_probe,
        c.probe_every,
        c.probes,
        c._nothing,
        c.idle,
        [s.draft_limit for s in seqs],
    ) == state
    assert c.plan(seqs) == peeked


def test_sequences_that_never_draft_ask_for_no_features(tiny):
    """Without a drafter, with speculation off for the request, or once the drafter lost its
    context, a sequence's rows ask the target for no features (empty in the result) and it
    keeps no context for a drafter; the text is the same as with features."""
    from flashmap.inprocess import LocalTarget
    from flashmap.rounds import run_local, speculative_round

    rows = []

    class Recording(LocalTarget):
        async def verify(self, rs, last=None):
            out = await super().verify(rs, last)
            rows.extend(
                (r.features, res[0].features.shape[0], len(r.tokens) + len(r.next_seeds))
                for r, res in zip(rs, out)
            )
            return out

    def run(drafter, max_draft, lose=False):
        rows.clear()
        seq = Sequence(
            1,
            GenerationRequest([3, 4, 5, 6, 7], 13, SamplingParams(), max_draft_tokens=max_draft),
            K,
            handle=tiny.allocate(),
        )
        if lose:
            seq.lose_drafter()
        while not seq.finished:
            run_local(speculative_round([seq], Recording(tiny), drafter, decode_steps=4))
        tiny.release(seq.handle)
        return seq.generated, seq.context_for_drafter(), list(rows)

    text, ctx, with_features = run(_SilentDrafter(), None)
    assert ctx is not None and all(f and n == m for f, n, m in with_features)  # [L + steps - 1, F]
    for drafter, max_draft, lose in (
        (None, None, False),
        (_SilentDrafter(), 0, False),
        (_SilentDrafter(), None, True),
    ):
        got, ctx, seen = run(drafter, max_draft, lose)
        assert got == text and ctx is None
        assert seen and all(not f and n == 0 for f, n, _ in seen)


def test_prompts_beside_a_request_that_only_catches_up_fetch_no_features():
    """lazy_features: a round whose only request chosen to draft has a context gap (it catches
    up, drafting from the next round) counts as one without drafts, so the prompts beside it go
    without features (a prompt row would fetch every prompt position's); once a request drafts,
    the rows beside it keep their features, so the others can draft next round without a gap."""
    c = _controller(verify=(0.010, 1e-5), draft=(0.001, 1e-5))
    c.cfg.lazy_features = True
    decoding = _seqs(1, acceptance=0.9)
    prompts = [
        Sequence(10 + i, GenerationRequest(list(range(3, 40)), max_new_tokens=500), K)
        for i in range(3)
    ]
    decoding[0]._gap = 2  # its earlier rows went without features
    c.plan(decoding + prompts)
    assert decoding[0].draft_limit == 0 and not decoding[0].lazy_features  # catches up
    assert all(p.lazy_features for p in prompts)
    decoding[0]._gap = None  # caught up
    c.plan(decoding + prompts)
    assert decoding[0].draft_limit > 0
    assert not any(p.lazy_features for p in prompts)


def test_a_prompt_fetches_its_features_when_its_first_decode_round_may_draft():
    """lazy_features: a prompt row goes with its features before anything is measured (its
    first decode round is the first probe, which must not wait for a catch-up round) and after
    a plan that drafted; while the search keeps speculation off it goes without."""

    def prompt(i):
        return Sequence(100 + i, GenerationRequest(list(range(3, 20)), max_new_tokens=500), K)

    fresh = SpeculationController(K, ControllerConfig(lazy_features=True))
    p = prompt(0)
    fresh.plan([p])
    assert not p.lazy_features
    p.prefilled = True
    p.tokens.append(4)
    assert fresh.plan([p])[p.seq_id] == K  # the first probe, at once: the context has no gap

    off = _controller(verify=(0.001, 0.004), draft=(0.003, 0.001))  # drafting never pays
    off.cfg.lazy_features = True
    decoding, p = _seqs(1, acceptance=0.02), prompt(1)
    assert not any(off.plan(decoding + [p]).values())
    assert p.lazy_features
    off.plan([prompt(2)])  # a plan of prompts alone leaves what the last decoding plan did
    q = prompt(3)
    off.plan([q])
    assert q.lazy_features

    on = _controller(verify=(0.010, 1e-5), draft=(0.001, 1e-5))  # drafting pays
    on.cfg.lazy_features = True
    decoding = _seqs(1, acceptance=0.9)
    assert on.plan(decoding)[0] > 0
    p = prompt(4)
    on.plan([p])  # the request alone now, say after the others ended
    assert not p.lazy_features


def test_shadow_probes_replace_the_probes_that_do_not_measure_the_verify():
    """shadow_probes: a greedy request's probe, other than every verify_probe_every-th (a
    one-token verified round), drafts nothing into the round (its plan length stays 0, the round
    can be sent ahead) and is named in `shadow`; each goes to the request longest without one."""
    c = _controller(verify=(0.010, 1e-3), draft=(0.002, 1e-4))
    c.cfg.decode_steps, c.cfg.verify_probe_every, c.cfg.shadow_probes = 8, 3, True
    c.cfg.probe_every = c.cfg.max_probe_every = c.probe_every = 16  # 2 rounds of 8 tokens
    seqs = _seqs(4, acceptance=0.2)
    kinds, shadowed = [], []
    for _ in range(16):
        plan = c.plan(seqs)
        assert not c.probing  # no mixed rounds: the others never wait for a probe
        if any(plan.values()):
            kinds.append("verified")
        elif c.shadow:
            kinds.append("shadow")
            ((i, n),) = c.shadow.items()
            shadowed.append(i)
            assert n == K
    assert kinds == ["verified", "shadow", "shadow"] * 2 + ["verified", "shadow"]
    assert len(set(shadowed[:3])) == 3  # the one longest without a probe each time
    sampling = _seqs(1, acceptance=0.2)[0]
    sampling.params = SamplingParams(temperature=1.0)
    c.probe_every = c.since_probe = 2
    c.probes = 1
    assert (
        any(c.plan([sampling]).values()) and not c.shadow
    )  # T > 0: acceptance needs the target's probabilities


def test_a_shadow_block_counts_what_the_committed_text_accepts():
    c = SpeculationController(K, ControllerConfig())
    s = Sequence(0, GenerationRequest([1, 2, 3], max_new_tokens=12), K)
    s.prefilled = True
    s.tokens.append(9)
    s.shadow = (4, np.arange(5, 5 + K))
    before = c.acceptance([s])[0]
    s.tokens += [5, 6]
    c.observe_shadows([s])
    assert (
        s.shadow is not None and c.shadows == 0
    )  # every committed token matched so far: undecided
    s.tokens += [1]
    c.observe_shadows([s])
    assert s.shadow is None and c.shadows == 1
    assert s.shadow_counts[0].tolist() == [1, 1, 1] + [0] * (K - 3)  # slots reached
    assert s.shadow_counts[1].tolist() == [1, 1] + [0] * (K - 2)  # slots accepted
    after = c.acceptance([s])[0]
    assert after[0] > before[0] and after[2] < before[2]
    assert (
        s.stats.drafts == 0 and s.stats.verified_per_slot.sum() == 0
    )  # not the request's own record
    # A block the request ends inside counts the slots it reached, all accepted.
    s.shadow = (len(s.tokens), np.arange(20, 20 + K))
    s.tokens += [20, 21]
    s.finish("length")
    c.observe_shadows([s])
    assert (
        s.shadow is None
        and s.shadow_counts[0, :3].tolist() == [2, 2, 1]
        and s.shadow_counts[1, :3].tolist() == [2, 2, 0]
    )


def test_shadow_probes_beside_the_rounds_are_exact_and_line_up_with_the_text(tiny):
    """The round loop under an event loop (as in the orchestrator), speculation kept off (a
    margin no plan beats), shadow probes on: every T = 0 output equals the target alone's, the
    probes ran, and with a drafter that drafts the true continuation every shadow block is
    accepted in every slot it reached (its tokens are compared at the right positions)."""
    import asyncio

    from flashmap.inprocess import LocalDrafter, LocalTarget
    from flashmap.rounds import speculative_round

    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13]]
    reqs = [GenerationRequest(p, 72, SamplingParams()) for p in prompts]
    alone = [r.token_ids for r in decode(tiny, reqs)]
    oracle = OracleProposer(
        [p + a for p, a in zip(prompts, alone)], K, tiny.vocab_size, error_rate=0.0, seed=3
    )
    ctl = SpeculationController(
        K,
        ControllerConfig(
            decode_steps=8, probe_every=16, max_probe_every=16, shadow_probes=True, margin=1e9
        ),
    )

    async def run():
        target, drafter = LocalTarget(tiny), LocalDrafter(oracle)
        seqs = [Sequence(i, r, K, handle=tiny.allocate()) for i, r in enumerate(reqs)]
        while live := [s for s in seqs if not s.finished]:
            await speculative_round(live, target, drafter, controller=ctl, decode_steps=8)
            await asyncio.sleep(
                0
            )  # the probes' drafts run between rounds, as beside the orchestrator's
        for s in seqs:
            tiny.release(s.handle)
        return seqs

    seqs = asyncio.run(run())
    assert [s.generated for s in seqs] == alone
    counts = np.sum([s.shadow_counts for s in seqs], axis=0)  # [2, K]
    assert ctl.shadows >= 3 and counts[0, 0] == ctl.shadows
    np.testing.assert_array_equal(
        counts[1], counts[0]
    )  # the true continuation: every slot reached is accepted
    assert counts[0, K // 2] > 0  # and the blocks reached far


def test_a_round_reports_what_the_controller_expected_its_drafts_to_accept(tiny):
    """RoundResult.expected_accepted / accepted (flashmap_controller_accepted_tokens): over the
    rounds the controller let draft, its estimate before each verify and what the verify accepted."""
    from flashmap.inprocess import LocalDrafter, LocalTarget
    from flashmap.rounds import run_local, speculative_round

    prompts = [[3, 4, 5, 6], [7, 8]]
    reqs = [GenerationRequest(p, 40, SamplingParams()) for p in prompts]
    alone = [r.token_ids for r in decode(tiny, reqs)]
    oracle = OracleProposer(
        [p + a for p, a in zip(prompts, alone)], K, tiny.vocab_size, error_rate=0.2, seed=5
    )
    ctl = SpeculationController(
        K, ControllerConfig(margin=-0.99)
    )  # drafting always beats a plain round
    target, drafter = LocalTarget(tiny), LocalDrafter(oracle)
    seqs = [Sequence(i, r, K, handle=tiny.allocate()) for i, r in enumerate(reqs)]
    drafted_rounds = 0
    while live := [s for s in seqs if not s.finished]:
        res = run_local(speculative_round(live, target, drafter, controller=ctl))
        rows = [r for r in res.sequences if r.drafted]
        assert res.accepted == sum(r.accepted for r in rows)
        assert (res.expected_accepted > 0) == bool(rows) and res.expected_accepted <= sum(
            r.drafted for r in rows
        )
        drafted_rounds += bool(rows)
    for s in seqs:
        tiny.release(s.handle)
    assert [s.generated for s in seqs] == alone and drafted_rounds >= 3


@pytest.mark.parametrize("acceptance", [0.93, 0.5, 0.05])
def test_the_controller_serves_near_the_better_of_full_and_off(acceptance):
    """The whole loop at this VM's costs with 16-token plain rounds, from a fresh controller:
    its tokens/s are at least 3/4 of the better of "always the whole block" and "never draft",
    whether the drafter is good (0.93 per slot: about 10 tokens a round, DFlash-eq's 9.8 on math),
    middling or useless. Its only news while it does not draft is a probe, so one good probe
    must be able to turn speculation on (with priors that outweighed a probe, it served the
    good drafter at about the speed of "never draft": 0.52-0.72 of full over 6 seeds)."""
    full, _ = simulate("full", acceptance)
    off, _ = simulate("off", acceptance)
    auto, share = simulate(controller(), acceptance)
    assert auto >= 0.75 * max(full, off), (auto, full, off, share)
    if full > 1.5 * off:
        assert share > 0.6  # it drafts most of the text
