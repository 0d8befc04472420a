"""The in-process runtime: the target engine and a proposer in one process, driven by the
round loop every runtime shares (flashmap.rounds).

`decode` runs any number of requests with continuous batching over the engine's KV
slots: each iteration is one `speculative_round` for every active sequence. With
`proposer=None` it is the autoregressive baseline (one token per verify), which the
lossless tests and the benchmarks compare against.

The engine and the proposer are taken as they are (target_service.engine.TargetEngine,
any drafter_service proposer); this module imports neither.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from flashmap.draft_call import answer, ask, take
from flashmap.drafts import TOP_M
from flashmap.round_metadata import DraftBatch, SeqPlan
from flashmap.rounds import DEFAULT_TREE_SAMPLING, run_local, speculative_round
from flashmap.sequence import Sequence
from flashmap.types import BLOCK_SIZE, GenerationRequest, SpecStats, TokenLogprob, VerifyRow


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats
    wall_s: float = 0.0  # the whole decode call (shared by the requests it ran together)
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asks (logprobs)


class LocalDrafter:
    """A proposer (drafter_service.proposer.Proposer) as the round loop's Drafter: the asks of a
    round answered in this process (flashmap.draft_call), the engine's device tensors handed
    over as they are. draft_steps: every request's unless it has its own (None: the
    proposer's step count)."""

    def __init__(self, proposer, draft_steps: int | None = None, top_m: int = TOP_M):
        self.proposer = proposer
        self.draft_steps, self.top_m = draft_steps, top_m
        self.block_size = proposer.block_size

    async def draft(self, seqs: list[Sequence], plans: list[SeqPlan]) -> DraftBatch:
        asks = [ask(s, p, self.top_m, self.draft_steps) for s, p in zip(seqs, plans)]
        out = DraftBatch()
        take(seqs, asks, answer(self.proposer, asks), out)
        return out

    async def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.proposer.release(s.seq_id)


class LocalTarget:
    """A TargetEngine as the round loop's Target: plain rows in one forward, trees in another."""

    def __init__(self, engine):
        self.engine = engine
        self.max_seq_len = engine.max_seq_len

    async def verify(self, rows: list[VerifyRow], last: list[bool] | None = None) -> list:
        # `last` is not used: freeing a local slot costs nothing, decode() frees it when the request ends.
        # Features stay on the engine's device: the drafter in this process reads them there.
        out: list = [None] * len(rows)
        flat = [i for i, r in enumerate(rows) if not r.is_tree]
        done = self.engine.verify([rows[i] for i in flat], features_on_device=True) if flat else []
        for i, res in zip(flat, done):
            out[i] = (res, np.zeros(0, np.int64))
        trees = [i for i, r in enumerate(rows) if r.is_tree]
        if trees:
            done = self.engine.verify_trees([rows[i] for i in trees], features_on_device=True)
            for i, res in zip(trees, done):
                out[i] = res
        return out


def decode(
    engine,
    requests: list[GenerationRequest],
    proposer=None,
    draft_steps: int | None = None,
    tree_blocks: int = 1,
    controller=None,
    plain_tokens: int = 1,
    tree_sampling: str = DEFAULT_TREE_SAMPLING,
    top_m: int = TOP_M,
    sibling_depth: int = 0,
) -> list[GenerationResult]:
    """Decode all requests to completion; results come back in request order. draft_steps:
    every request's unless it has its own (None: the proposer's step count).

    tree_blocks > 1 (requests without their own tree_blocks): each round drafts that many blocks
    (at most what the proposer draws) from independent
    noise and verifies them as a tree (TargetEngine.verify_tree); the sequence commits the
    branch the target accepts furthest. controller: a flashmap.speculation.SpeculationController
    choosing each round's draft lengths (None: the whole block every round). plain_tokens:
    tokens per request of a round without drafts, in one engine call (flashmap.rounds).
    top_m: the drafter's support size per slot at T > 0 (the orchestrator's --top-m);
    tree_sampling, sibling_depth: how a tree at T > 0 is verified (flashmap.rounds)."""
    for r in requests:
        r.validate(engine.vocab_size, engine.max_seq_len)
    block = proposer.block_size if proposer is not None else BLOCK_SIZE
    target = LocalTarget(engine)
    drafter = LocalDrafter(proposer, draft_steps, top_m) if proposer is not None else None
    waiting = deque(enumerate(requests))
    active: dict[int, Sequence] = {}  # request index -> sequence (handle: its engine slot)
    results: list[GenerationResult | None] = [None] * len(requests)
    t_start = time.perf_counter()
    while waiting or active:
        while waiting and engine.free_slots > 0:
            i, req = waiting.popleft()
            active[i] = Sequence(str(i), req, block, handle=engine.allocate())
        seqs = list(active.values())
        round_ = speculative_round(
            seqs,
            target,
            drafter,
            controller,
            tree_blocks,
            plain_tokens,
            None,
            tree_sampling,
            sibling_depth,
        )
        run_local(round_)
        for i, s in list(active.items()):
            if s.finished:
                engine.release(s.handle)
                if drafter is not None:
                    run_local(drafter.release([s]))
                del active[i]
                results[i] = GenerationResult(
                    s.request.request_id,
                    list(s.request.prompt_ids),
                    s.generated,
                    s.finish_reason,
                    s.stats,
                    logprobs=s.logprobs if s.top_logprobs >= 0 else None,
                )
    wall = time.perf_counter() - t_start
    for r in results:
        r.wall_s = wall
    return results
