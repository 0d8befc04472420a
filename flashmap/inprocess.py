"""The in-process decoder: target engine + proposer + rejection sampling in one loop.

`decode` runs any number of requests with continuous batching over the engine's KV
slots: each iteration is one batched draft and one batched verify for every active
sequence. With `proposer=None` it is the autoregressive baseline (one token per
verify), which the lossless tests and the benchmarks compare against. The servers
run the same per-sequence logic (orchestrator.sequence) across processes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from drafter_service.proposer import Proposer, ProposeRequest
from flashmap.types import Draft
from orchestrator.sequence import GenerationRequest, Sequence, SequenceStats


@dataclass
class Timings:
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    iterations: int = 0

    @property
    def other_s(self) -> float:
        return self.total_s - self.draft_s - self.verify_s


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: SequenceStats
    timings: Timings = field(default_factory=Timings)


def _draft_requests(seqs: list[Sequence]) -> list[ProposeRequest]:
    return [
        ProposeRequest(
            seq_id=str(s.seq_id),
            anchor=s.anchor,
            temperature=s.params.temperature,
            seed=s.draft_seed(),
            steps=s.request.draft_steps,
        )
        for s in seqs
    ]


def _tree_fits(engine, row, n_branches: int) -> bool:
    """Verify this row as a tree: it drafted, has other branches, and they fit the context
    (else the plain block is verified)."""
    return bool(row.num_draft) and n_branches > 0 and \
        row.start_pos + len(row.tokens) + row.num_draft * n_branches <= engine.max_seq_len


def decode(engine, requests: list[GenerationRequest], proposer: Proposer | None = None, steps: int = 1,
           tree_blocks: int = 1) -> list[GenerationResult]:
    """Decode all requests to completion; results come back in request order.

    tree_blocks > 1 (greedy requests, a proposer with `propose_blocks`): each round drafts that
    many blocks from independent noise and verifies them as a tree (TargetEngine.verify_tree);
    the sequence commits the branch the target accepts furthest."""
    for r in requests:
        r.validate(engine.vocab_size, engine.max_seq_len)
    if tree_blocks > 1:
        if proposer is None or not hasattr(proposer, "propose_blocks"):
            raise ValueError("tree verification needs a proposer that drafts several blocks (propose_blocks)")
        if any(not r.params.greedy for r in requests):
            raise ValueError("tree verification is greedy-only: every request needs temperature 0")
    block = proposer.block_size if proposer is not None else 16
    waiting = deque(enumerate(requests))
    active: dict[int, tuple[Sequence, int]] = {}  # index -> (sequence, slot)
    results: list[GenerationResult | None] = [None] * len(requests)
    timings = Timings()
    t_start = time.perf_counter()
    while waiting or active:
        while waiting and engine.free_slots > 0:
            i, req = waiting.popleft()
            active[i] = (Sequence(i, req, block), engine.allocate())
        seqs = [s for s, _ in active.values()]
        drafts: dict[int, Draft] = {}
        branches: dict[int, list[Draft]] = {}  # tree rounds: the other blocks
        to_draft = [s for s in seqs if s.draft_budget() > 0] if proposer is not None else []
        if to_draft:
            t0 = time.perf_counter()
            for s in to_draft:
                ctx = s.take_pending_context()
                if ctx is not None:
                    proposer.extend(str(s.seq_id), *ctx)
            if tree_blocks > 1:
                for s, blocks in zip(to_draft, proposer.propose_blocks(_draft_requests(to_draft), steps, tree_blocks)):
                    n = min([s.draft_budget()] + [len(d.tokens) for d in blocks])  # a tree's branches share K
                    drafts[s.seq_id], *branches[s.seq_id] = (d.truncate(n) for d in blocks)
            else:
                for s, d in zip(to_draft, proposer.propose(_draft_requests(to_draft), steps)):
                    drafts[s.seq_id] = d.truncate(s.draft_budget())
            timings.draft_s += time.perf_counter() - t0
        rows = [s.verify_row(drafts.get(s.seq_id), slot) for s, slot in active.values()]
        t0 = time.perf_counter()
        tree = [_tree_fits(engine, r, len(branches.get(s.seq_id, ()))) for r, (s, _) in zip(rows, active.values())]
        flat = [i for i, t in enumerate(tree) if not t]
        outs: list = [None] * len(rows)
        for i, out in zip(flat, engine.verify([rows[i] for i in flat])):
            outs[i] = out
        for i, (s, _) in enumerate(active.values()):
            if tree[i]:  # commit the winning branch as if it alone had been verified
                blocks = [drafts[s.seq_id], *branches[s.seq_id]]
                outs[i], best = engine.verify_tree(rows[i], [b.tokens for b in blocks[1:]])
                win = drafts[s.seq_id] = blocks[best]
                prefix = rows[i].tokens[:len(rows[i].tokens) - len(win.tokens)]  # [.., anchor]
                rows[i] = replace(rows[i], tokens=np.concatenate([prefix, win.tokens]), support_ids=win.support_ids)
        timings.verify_s += time.perf_counter() - t0
        timings.iterations += 1
        for (i, (s, slot)), row, out in zip(list(active.items()), rows, outs):
            s.commit(row, drafts.get(s.seq_id), out)
            if s.finished:
                engine.release(slot)
                if proposer is not None:
                    proposer.release(str(s.seq_id))
                del active[i]
                results[i] = GenerationResult(s.request.request_id, list(s.request.prompt_ids), s.generated, s.finish_reason, s.stats)
    timings.total_s = time.perf_counter() - t_start
    for r in results:
        r.timings = timings  # shared: the batch ran as one
    return results
