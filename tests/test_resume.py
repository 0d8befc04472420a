"""Requests that outlive their target, in one process: a round whose target died
(flashmap.types.TargetLost) commits nothing and rewinds its sequences; their caches are
rebuilt from the committed tokens (Sequence.rebuild_row) and the rounds go on. The text is the
one an uninterrupted run gives: greedy and seeded sampled requests, drafted by the untrained
FlashMap drafter, with the target having run the lost round before it died (its cache moved
on, then was lost). The real processes (kill -9 of tritonserver) are tests/test_target_restart.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from drafter_service.factory import load_proposer
from flashmap.inprocess import LocalDrafter, LocalTarget, decode
from flashmap.round_metadata import RoundPlan, SeqPlan
from flashmap.rounds import run_local, speculative_round
from flashmap.sequence import Sequence
from flashmap.types import GenerationRequest, SamplingParams, TargetLost
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3
from tests.drafter_helpers import one_thread  # noqa: F401 - fixture

MAX_NEW = 40


class DyingTarget:
    """The engine runs the round, then the target 'dies' before answering: every slot it held
    is gone (a restarted target holds nothing)."""

    def __init__(self, target: LocalTarget, seqs: list[Sequence]):
        self.target, self.seqs = target, seqs
        self.max_seq_len = target.max_seq_len

    async def verify(self, rows, last=None):
        await self.target.verify(rows, last)
        engine = self.target.engine
        for s in self.seqs:
            if not s.finished:
                engine.release(s.handle)
                s.handle = engine.allocate()
        return [TargetLost("the target died")] * len(rows)


def _decode_dying(
    engine, requests, proposer, die_at: set[int], controller=None, plain_tokens: int = 1
) -> list[list[int]]:
    """decode(), but the target dies in the rounds numbered in die_at; then every sequence's
    cache is rebuilt (one call) and the rounds go on."""
    target, drafter = LocalTarget(engine), LocalDrafter(proposer)
    seqs = [
        Sequence(str(i), r, proposer.block_size, handle=engine.allocate())
        for i, r in enumerate(requests)
    ]
    n = 0
    while active := [s for s in seqs if not s.finished]:
        dying = n in die_at
        t = DyingTarget(target, active) if dying else target
        run_local(speculative_round(active, t, drafter, controller, 1, plain_tokens))
        if dying:
            assert not any(s.finished for s in active), "a lost round ended a request"
            rows = [r for s in active if (r := s.rebuild_row()) is not None]
            assert all(not isinstance(x, BaseException) for x in run_local(target.verify(rows)))
        n += 1
    for s in seqs:
        engine.release(s.handle)
        run_local(drafter.release([s]))
    return [s.generated for s in seqs]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = make_random_qwen3(tmp_path_factory.mktemp("resume"), with_tokenizer=False, seed=5)
    engine = TargetEngine(path, n_slots=8, max_seq_len=128)
    proposer = load_proposer("init", str(path), n_slots=8, max_context=128)
    rng = np.random.default_rng(4)
    prompts = [
        rng.integers(3, engine.vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(6)
    ]
    return engine, proposer, prompts


@pytest.mark.parametrize("die_at", [{0}, {2, 3}, {5, 9, 17}])
def test_lost_rounds_resume_to_the_uninterrupted_text(world, die_at):
    """Greedy and seeded sampled requests (top-k too) whose target dies at the prompt round,
    in consecutive rounds and mid-stream end with the tokens of a run where it never did."""
    engine, proposer, prompts = world
    params = [
        SamplingParams(),
        SamplingParams(),
        SamplingParams(1.0, seed=11),
        SamplingParams(0.8, top_k=20, seed=12),
        SamplingParams(),
        SamplingParams(1.0, seed=13),
    ]
    requests = [GenerationRequest(p, MAX_NEW, sp) for p, sp in zip(prompts, params)]
    want = [r.token_ids for r in decode(engine, requests, proposer)]
    got = _decode_dying(engine, requests, proposer, die_at)
    assert got == want


class Phases:
    """A speculation policy of the sequences' own state, so two runs plan alike: by the tokens
    generated, a sequence decodes without drafts and without features (its drafter context gets
    a gap), then without drafts fetching what it lacks (VerifyRow.features_from), then drafts."""

    def plan(self, seqs, blocks=1):
        phase = {s.seq_id: len(s.generated) // 5 % 3 for s in seqs}
        plans = {
            s.seq_id: SeqPlan(s.draft_cap() if phase[s.seq_id] == 2 else 0, 1, phase[s.seq_id] > 0)
            for s in seqs
        }
        return RoundPlan(plans, plain_tokens=3)

    def expected(self, seqs, rows, plan):
        return {}

    def observe(self, out):
        pass


def test_lost_rounds_with_gaps_in_the_drafter_context_resume_exactly(world, monkeypatch):
    """Rows without features (a gap in the drafter's context), rows fetching them and drafted
    rows, with the target dying in each kind: greedy text as without the deaths. Seeded text
    only where the drafts come out the same: the features of a gap are fetched from the rebuilt
    cache, whose prefill differs in the last bits from the steps that first wrote them, and the
    untrained drafter's near-tied top-m can turn that into another draft (orchestrator.resume:
    the target's law in any case; tests/test_lossless.py checks it)."""
    engine, proposer, prompts = world
    rows, verify = [], engine.verify
    monkeypatch.setattr(engine, "verify", lambda b, **kw: rows.extend(b) or verify(b, **kw))
    params = [SamplingParams(), SamplingParams(1.0, seed=21), SamplingParams()] * 2
    requests = [GenerationRequest(p, MAX_NEW, sp) for p, sp in zip(prompts, params)]
    want = [r.token_ids for r in decode(engine, requests, proposer, controller=Phases())]
    rows.clear()
    got = _decode_dying(engine, requests, proposer, {1, 3, 4, 6, 8, 11}, Phases(), 3)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [got[i] for i in greedy] == [want[i] for i in greedy]
    assert all(len(g) == MAX_NEW for g in got)
    assert any(not r.features for r in rows if r.start_pos > 0), "no row went without features"
    assert any(r.features_from >= 0 for r in rows), "no row fetched the features it lacked"
    assert any(r.num_draft for r in rows), "nothing was drafted"


def test_rewind_undoes_the_draws_of_the_rounds_lost():
    """The generator goes back to where it stood before the first round not committed,
    rounds sent ahead included; a committed round's draws stay."""
    s = Sequence("1", GenerationRequest([3, 4, 5], 20, SamplingParams(1.0, seed=7)))
    s.prefilled, s.tokens = True, [3, 4, 5, 6]
    before = s.rng.bit_generator.state
    row = s.verify_row(None, steps=3)
    s.follow_row(row, 3)  # the round after it, sent ahead
    s.rewind()
    assert s.rng.bit_generator.state == before
    again = s.verify_row(None, steps=3)
    assert (
        again.round_seed == row.round_seed and again.next_seeds.tolist() == row.next_seeds.tolist()
    )
    after = s.rng.bit_generator.state
    rebuilt = s.rebuild_row()
    assert rebuilt.start_pos == 0 and rebuilt.tokens.tolist() == [3, 4, 5]
    assert not rebuilt.features and rebuilt.steps == 1
    assert s.rng.bit_generator.state == after  # a rebuild draws nothing
