"""One speculative round for a batch of sequences: the round loop of every runtime.

The in-process decoder (flashmap.inprocess) and the orchestrator (orchestrator.scheduler)
both call `speculative_round`; they differ only in what they plug in:

    Drafter   local proposer (inprocess.LocalDrafter) | drafter service (orchestrator.drafter_client)
    Target    local engine (inprocess.LocalTarget)    | Triton (orchestrator.target_client)

A round: plan (flashmap.round_metadata: what each sequence drafts), draft (one call for every
sequence that drafts), verify (one call for every row: drafted rows, rows without a draft,
prompts), commit (rejection sampling, Sequence.commit). A sequence without a draft decodes
autoregressively, which keeps the output exact; when nobody drafts (or only the controller's
probe does) each row decodes up to `plain_tokens` tokens in the same call. Several blocks of
one sequence, or a drafter's own tree, are verified as one tree; the sequence commits the path
the target accepts as if that path alone had been its draft. Rounds sent before the one they
follow has answered, and shadow probes, are flashmap.pipeline.

The protocols are async so the remote clients can await the network; the local ones never
suspend, so `run_local` drives a round without an event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from flashmap.drafts import Draft
from flashmap.round_metadata import (
    DraftBatch,
    RoundPlan,
    RoundResult,
    SeqPlan,
    SequenceRound,
    plan_round,
)
from flashmap.sequence import Sequence
from flashmap.shadow_probes import start_shadow_probes
from flashmap.types import TargetLost, VerifyRow

TREE_SAMPLING = ("pick", "rejection", "siblings")
# More accepted than "pick" for the same blocks (docs/results/trees.md, dev prompts).
DEFAULT_TREE_SAMPLING = "rejection"


if TYPE_CHECKING:
    from flashmap.pipeline import Ahead
    from flashmap.speculation import SpeculationController


class Drafter(Protocol):
    block_size: int

    async def draft(self, seqs: list[Sequence], plans: list[SeqPlan]) -> DraftBatch:
        """Blocks after each sequence's anchor as its plan says (flashmap.draft_call: the ask
        carries the sequence's unacknowledged context first; an answer's error loses the
        sequence's context). A drafter whose calls can overlap (a shadow probe's beside a
        round's) says so in `busy`; while it is not busy, `draft` reads the sequences before it
        first suspends."""

    async def release(self, seqs: list[Sequence]) -> None:
        """Forget these sequences' context."""


class Target(Protocol):
    max_seq_len: int

    async def verify(self, rows: list[VerifyRow], last: list[bool] | None = None) -> list:
        """One verify for every row: per row (VerifyResult, path) or the exception that failed
        it; path: the accepted drafts of a tree row (VerifyRow.parents), whose result is that
        path's (empty for a chain). last[i]: this verify surely ends row i's sequence
        (Sequence.ends_with), so the target may free it in the same call; `release` stays safe
        to call afterwards."""


async def speculative_round(
    seqs: list[Sequence],
    target: Target,
    drafter: Drafter | None = None,
    controller: SpeculationController | None = None,
    blocks: int = 1,
    plain_tokens: int = 1,
    send_ahead: Callable[[list[Sequence], list[VerifyRow], RoundPlan], Ahead | None] | None = None,
    tree_sampling: str = DEFAULT_TREE_SAMPLING,
    sibling_depth: int = 0,
) -> RoundResult:
    """plan -> draft -> verify -> commit for every sequence in `seqs` (none finished).
    controller: chooses each sequence's draft length from measured costs (None: the whole
    block). blocks: blocks from independent noise per greedy sequence (one tree). plain_tokens:
    tokens per row of a round without drafts. send_ahead(seqs, rows, plan): called once the
    verify is on its way, when the round drafts nothing (flashmap.pipeline.ahead_sender).
    tree_sampling, sibling_depth: how a row's blocks at T > 0 are verified (`merged_draft`)."""
    t_round = time.perf_counter()
    if controller is not None and drafter is not None:
        plan = controller.plan(seqs, blocks)
    else:
        plan = plan_round(seqs, drafter is not None, blocks, plain_tokens)
    batch = await draft_blocks(seqs, plan, drafter)
    drafts = [merged_draft(s, batch, target, tree_sampling, sibling_depth) for s in seqs]
    rows = verify_rows(seqs, plan, drafts)
    expected = controller.expected(seqs, rows, plan) if controller is not None else {}
    call = target.verify(rows, [s.ends_with(r) for s, r in zip(seqs, rows)])
    ahead = None
    if send_ahead is not None and not any(r.num_draft for r in rows):
        ahead = send_ahead(seqs, rows, plan)  # a task: it goes out after this verify
    t_verify = time.perf_counter()
    results = await call
    verify_s = time.perf_counter() - t_verify
    if ahead is not None:
        ahead.since = t_verify + verify_s
    out = commit_round(seqs, plan, rows, drafts, results, batch, expected)
    out.verify_s, out.ahead = verify_s, ahead
    return learn(out, t_round, controller, drafter)


async def draft_blocks(
    seqs: list[Sequence], plan: RoundPlan, drafter: Drafter | None
) -> DraftBatch:
    """The round's one draft call, for the sequences the plan lets draft and whose context the
    drafter still holds (the others are counted as fallbacks)."""
    if drafter is None:
        return DraftBatch()
    want = [s for s in seqs if plan.of(s).draft > 0]
    ask = [s for s in want if not s.context.lost]
    if not ask:
        return DraftBatch(lost={s.seq_id for s in want})
    t0 = time.perf_counter()
    batch = await drafter.draft(ask, [plan.of(s) for s in ask])
    batch.seconds = time.perf_counter() - t0
    batch.asked = {s.seq_id for s in ask}
    batch.lost = {s.seq_id for s in want if s.seq_id not in batch.asked}
    return batch


def merged_draft(
    s: Sequence,
    batch: DraftBatch,
    target: Target,
    tree_sampling: str = DEFAULT_TREE_SAMPLING,
    sibling_depth: int = 0,
) -> Draft | None:
    """The sequence's draft this round: its block, or its blocks as one tree when that fits the
    context (else the first block alone). "pick": the blocks merged (shared prefixes once), the
    target picks its own token at each node and follows it (target_service.tree); "rejection"
    (T > 0): each block a chain of its own with its proposal law, multi-draft rejection
    sampling; "siblings" (T > 0): that, with each drafted token's other support tokens beside
    it as leaves (Draft.with_siblings; sibling_depth > 0: beside the first that many depths
    only), also for one block."""
    blocks = batch.blocks.get(s.seq_id, [])
    siblings = tree_sampling == "siblings" and not s.params.greedy
    if len(blocks) <= 1 and not (siblings and blocks and blocks[0].parents is None):
        return blocks[0] if blocks else None
    if siblings:
        tree = Draft.forest(blocks, blocks[0].draft_steps) if len(blocks) > 1 else blocks[0]
        tree = tree.with_siblings(sibling_depth)
    elif tree_sampling == "rejection" and not s.params.greedy:
        tree = Draft.forest(blocks, blocks[0].draft_steps)
    else:
        tree = Draft.merged([b.tokens for b in blocks], blocks[0].draft_steps)
    return tree if len(s.tokens) + len(tree.tokens) <= target.max_seq_len else blocks[0]


def verify_rows(
    seqs: list[Sequence], plan: RoundPlan, drafts: list[Draft | None]
) -> list[VerifyRow]:
    """Each sequence's verify row. A round without a new prompt (whose first token is not held
    back) decodes up to `plan.plain_tokens` tokens per row without a draft, when nobody drafts
    or the only drafting is the controller's probe (the others do not wait for it)."""
    plain = all(d is None or len(d.tokens) == 0 for d in drafts)
    steps = plan.plain_tokens if all(s.prefilled for s in seqs) and (plain or plan.probing) else 1
    return [s.verify_row(d, steps, plan.of(s).features) for s, d in zip(seqs, drafts)]


def commit_round(
    seqs: list[Sequence],
    plan: RoundPlan,
    rows: list[VerifyRow],
    drafts: list[Draft | None],
    results: list,
    batch: DraftBatch,
    expected: dict,
    skip: frozenset = frozenset(),
) -> RoundResult:
    """Rejection sampling for every row verified (skip: sequences that ended before it). A row
    that failed ends its request, unless the target was lost (TargetLost): then the sequence
    commits nothing and rewinds (Sequence.rewind)."""
    out = RoundResult(plan, row_lengths=[len(r.tokens) for r in rows], draft_s=batch.seconds)
    out.drafting = len(batch.asked)
    out.plain_tokens = max(r.steps for r in rows)
    out.draft_steps = next((d.draft_steps for d in drafts if d is not None and d.draft_steps), 0)
    for s, row, draft, res in zip(seqs, rows, drafts, results):
        if s.seq_id in skip:
            continue
        s.stats.draft_s += batch.seconds if s.seq_id in batch.asked else 0.0
        prefill, fallback = not s.prefilled, ""
        if s.seq_id in batch.asked | batch.lost and draft is None:
            fallback = "context_lost" if s.context.lost else (batch.failure or "context_lost")
            s.stats.fallback_rounds += 1
        if isinstance(res, BaseException):
            if isinstance(res, TargetLost):  # nothing verified: the request may resume
                s.rewind()
            else:
                s.fail(res)
            out.sequences.append(SequenceRound(s, [], prefill, fallback=fallback, error=res))
            continue
        result, path = res
        new, accepted = s.commit(row, draft, result, path)
        logprobs = s.logprobs[len(s.logprobs) - len(new) :] if s.top_logprobs >= 0 else None
        out.sequences.append(
            SequenceRound(s, new, prefill, row.num_draft, accepted, fallback, logprobs=logprobs)
        )
        if s.seq_id in expected:
            out.expected_accepted += float(expected[s.seq_id])
            out.accepted += accepted
    return out


def learn(
    out: RoundResult,
    t_round: float,
    controller: SpeculationController | None,
    drafter: Drafter | None,
) -> RoundResult:
    """The round's timings on its sequences, and its measurements to the controller (which may
    start shadow probes, flashmap.pipeline)."""
    for r in out.sequences:
        r.seq.stats.verify_s += out.verify_s
    out.rest_s = time.perf_counter() - t_round - out.draft_s
    if controller is not None:
        controller.observe(out)
        out.shadows = start_shadow_probes(out, drafter, controller)
    return out


def run_local(coro):
    """Run a coroutine whose awaits never suspend (the local drafter and target) without an
    event loop: a round in one process costs no scheduling."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a local round awaited I/O: use an event loop for remote parts")
