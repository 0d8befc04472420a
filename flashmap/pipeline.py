"""Rounds sent before the round they follow has answered (the orchestrator's --pipeline).

A round without drafts or prompts may send the next round before its own answer arrives,
when that one would draft nothing either (`ahead_sender`, speculative_round's send_ahead). Its
rows are Sequence.follow_row: the token [FOLLOW_TOKEN], which the target replaces with the
last token it decoded for the sequence, and the seeds the next round would draw, so the target
runs the rounds back to back and the text does not change. `finish_ahead` commits such a round
once it answers (and may send the next one the same way).

Numpy only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from flashmap.round_metadata import DraftBatch, RoundPlan, RoundResult, plan_round
from flashmap.rounds import (
    DEFAULT_TREE_SAMPLING,
    Drafter,
    Target,
    commit_round,
    learn,
    speculative_round,
)
from flashmap.sequence import Sequence
from flashmap.speculation import SpeculationController
from flashmap.types import FOLLOW_REFUSED, InvalidRequest, VerifyRow


@dataclass
class Ahead:
    """A round without drafts sent before the round it follows has answered: one
    Sequence.follow_row per sequence that round could not end."""

    seqs: list[Sequence]
    rows: list[VerifyRow]
    call: asyncio.Future  # the verify, a task: in flight
    plan: RoundPlan
    since: float = 0.0  # perf_counter when the round before it answered (its cost starts there)


Sender = Callable[[list[Sequence], list[VerifyRow], RoundPlan], Ahead | None]


def ahead_sender(
    target: Target,
    drafter: Drafter | None,
    controller: SpeculationController | None,
    plain_tokens: int,
) -> Sender:
    """speculative_round's send_ahead: the next round, sent now, when it drafts nothing either."""
    return lambda seqs, rows, plan: _send_ahead(
        seqs, rows, target, drafter, controller, plain_tokens
    )


async def finish_ahead(
    ahead: Ahead,
    target: Target,
    drafter: Drafter | None = None,
    controller: SpeculationController | None = None,
    send_ahead: Sender | None = None,
) -> RoundResult:
    """Commit a round sent ahead (its sequences that ended since commit nothing); send_ahead:
    the round after it goes out the same way, before this one's answer is awaited."""
    seqs, rows, plan = ahead.seqs, ahead.rows, ahead.plan
    gone = frozenset(s.seq_id for s in seqs if s.finished)
    nxt = send_ahead(seqs, rows, plan) if send_ahead is not None else None
    results = await ahead.call
    rows, results = await _followed(seqs, rows, results, target)
    now = time.perf_counter()
    if nxt is not None:
        nxt.since = now
    out = commit_round(seqs, plan, rows, [None] * len(rows), results, DraftBatch(), {}, gone)
    out.verify_s, out.ahead = now - ahead.since, nxt
    return learn(out, ahead.since, controller, drafter)


async def pipelined_round(
    seqs: list[Sequence],
    target: Target,
    drafter: Drafter | None = None,
    controller: SpeculationController | None = None,
    blocks: int = 1,
    plain_tokens: int = 1,
    ahead: Ahead | None = None,
    send: bool = False,
    tree_sampling: str = DEFAULT_TREE_SAMPLING,
    sibling_depth: int = 0,
) -> RoundResult:
    """The next round: the one sent ahead when there is one (then on its own sequences), else a
    new round of `seqs`; send: the round after it goes out before its answer when it can."""
    sender = ahead_sender(target, drafter, controller, plain_tokens) if send else None
    if ahead is not None:
        return await finish_ahead(ahead, target, drafter, controller, sender)
    return await speculative_round(
        seqs,
        target,
        drafter,
        controller,
        blocks,
        plain_tokens,
        sender,
        tree_sampling,
        sibling_depth,
    )


def _send_ahead(
    seqs: list[Sequence],
    rows: list[VerifyRow],
    target: Target,
    drafter: Drafter | None,
    controller: SpeculationController | None,
    plain_tokens: int,
) -> Ahead | None:
    """A follow_row for every sequence this round (rows without drafts, in flight) cannot end;
    None when the next round would draft, or when every sequence ends here."""
    pairs = [(s, r) for s, r in zip(seqs, rows) if not s.finished and not s.ends_with(r)]
    if not pairs:
        return None
    nxt = [s for s, _ in pairs]
    fresh = [s for s in nxt if not s.prefilled]
    for s in fresh:  # the next round is planned as after this one commits their prompts
        s.prefilled = True
    try:
        if controller is None or drafter is None:
            plan = plan_round(nxt, drafter is not None, 1, plain_tokens)
            if any(plan.of(s).draft > 0 and not s.context.lost for s in nxt):
                return None
        elif any(controller.peek(nxt).chosen.values()):
            return None
        else:
            plan = controller.plan(nxt)
    finally:
        for s in fresh:
            s.prefilled = False
    follow = [s.follow_row(r, plain_tokens, plan.of(s).features) for s, r in pairs]
    last = [s.ends_with(f, ahead=r.steps) for (s, r), f in zip(pairs, follow)]
    return Ahead(nxt, follow, asyncio.ensure_future(target.verify(follow, last)), plan)


async def _followed(
    seqs: list[Sequence], rows: list[VerifyRow], results: list, target: Target
) -> tuple[list[VerifyRow], list]:
    """An ahead round's rows with their real token (Sequence.followed) and its results. A
    continuation the target refused because it came before the round it follows (calls may
    overtake each other) is verified again, now with its token (the same seeds: the same text)."""
    rows, results = list(rows), list(results)
    again = []
    for i, (s, res) in enumerate(zip(seqs, results)):
        if s.finished:
            continue
        try:
            rows[i] = s.followed(rows[i])
        except ValueError as e:  # never commit a step the target did not take after its last
            results[i] = e
            continue
        if isinstance(res, InvalidRequest) and str(res).startswith(FOLLOW_REFUSED):
            again.append(i)
    if again:
        redo = await target.verify(
            [rows[i] for i in again], [seqs[i].ends_with(rows[i]) for i in again]
        )
        for i, res in zip(again, redo):
            results[i] = res
    return rows, results
