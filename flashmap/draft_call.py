"""One draft call, end to end: what each sequence asks the drafter for (`ask`), how a proposer
answers a batch of asks (`answer`), and what an answer does to the sequence (`take`).

Every runtime goes through these three: the in-process drafter (flashmap.inprocess) calls
them back to back; the orchestrator's client (orchestrator.drafter_client) sends the asks
over gRPC and takes the answers; the drafter service (drafter_service.server) answers them.
The asks and answers cross the wire as flashmap.wire encodes them.

A proposer is any drafter_service.proposer.Proposer (duck-typed here: the core imports no
drafter code). Numpy only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flashmap.drafts import TOP_M, Draft, ProposeRequest
from flashmap.round_metadata import DraftBatch, SeqPlan
from flashmap.sequence import Sequence

log = logging.getLogger("flashmap.draft")


@dataclass
class DraftAnswer:
    """A proposer's answer to one ask: its blocks, or why there are none."""

    drafts: list[Draft] = field(default_factory=list)
    error: str = ""


def ask(
    s: Sequence, plan: SeqPlan, top_m: int = TOP_M, draft_steps: int | None = None
) -> ProposeRequest:
    """What `s` asks the drafter for this round: its unacknowledged context, then `plan.draft`
    tokens (`plan.blocks` blocks) after its anchor. draft_steps: the step count when the
    request has none of its own (None: the drafter's)."""
    unsent = s.context.unsent()
    start, ids, features = unsent or (s.context.seen, np.zeros(0, np.int64), [])
    return ProposeRequest(
        s.seq_id,
        s.anchor,
        s.params.temperature,
        top_m,
        s.draft_seed(),
        s.request.draft_steps or draft_steps,
        plan.draft,
        plan.blocks,
        start,
        ids,
        features,
    )


def take(
    seqs: list[Sequence], asks: list[ProposeRequest], answers: list[DraftAnswer], out: DraftBatch
) -> None:
    """Apply a call's answers: the context each ask carried is acknowledged and its blocks go
    into `out`; an error means the drafter lost the sequence (it decodes without drafts)."""
    for s, a, ans in zip(seqs, asks, answers):
        if ans.error:
            log.warning(
                "sequence %s: drafter: %s; continuing autoregressively", s.seq_id, ans.error
            )
            s.context.lose()
            continue
        s.context.acknowledged(len(a.new_tokens))
        out.blocks[s.seq_id] = ans.drafts


def answer(
    proposer,
    asks: list[ProposeRequest],
    check: Callable[[ProposeRequest], str] = lambda a: "",
    on_group: Callable[[int, list[ProposeRequest], float], None] | None = None,
) -> list[DraftAnswer]:
    """Answer a batch of asks with one context extension for all of them, then one batched
    draft per (step count, blocks). check(ask): "" or why this ask is refused (the service's
    step counts). on_group(steps, asks, seconds): after each batched draft. A failure answers
    the asks it concerns with an error; it never raises."""
    out: list[DraftAnswer | None] = [None] * len(asks)
    for i, a in enumerate(asks):
        a.blocks = min(max(a.blocks, 1), proposer.max_blocks)  # a drafter with a tree of its own: 1
        err = check(a) or _rollback(proposer, a)
        if err:
            out[i] = DraftAnswer(error=err)
    extend = [i for i, a in enumerate(asks) if out[i] is None and len(a.new_tokens)]
    if extend:  # every sequence's new positions in one pass
        try:
            refused = proposer.extend_many(
                [(asks[i].seq_id, asks[i].new_tokens, asks[i].new_features) for i in extend]
            )
        except Exception as e:  # noqa: BLE001 - e.g. a bad tensor: these sequences fall back
            refused = {asks[i].seq_id: e for i in extend}
        for i in extend:
            if asks[i].seq_id in refused:
                out[i] = DraftAnswer(error=str(refused[asks[i].seq_id]))
    groups: dict[tuple[int, int], list[int]] = {}
    for i, a in enumerate(asks):
        if out[i] is None:
            steps = a.draft_steps or proposer.steps
            groups.setdefault((steps, max(a.blocks, 1)), []).append(i)
    for (steps, blocks), idx in groups.items():
        group = [asks[i] for i in idx]
        for a in group:
            a.draft_steps = steps
        t0 = time.perf_counter()
        try:
            drafts = proposer.draft(group, blocks)
        except Exception as e:  # noqa: BLE001 - e.g. slots exhausted: these sequences fall back
            for i in idx:
                out[i] = DraftAnswer(error=str(e))
            continue
        if on_group is not None:
            on_group(steps, group, time.perf_counter() - t0)
        for i, ds in zip(idx, drafts):
            for d in ds:
                d.draft_steps = steps
            out[i] = DraftAnswer(ds)
    return out


def _rollback(proposer, a: ProposeRequest) -> str:
    """The new context must start where the drafter stands (a resend after a timed-out call
    starts earlier: roll back); "" when it fits, else the ask's error."""
    have = proposer.context_length(a.seq_id)
    if a.context_start > have:
        return f"context gap: drafter holds {have} positions of {a.seq_id}, request starts at {a.context_start}"
    if not len(a.new_tokens) and a.context_start == 0 and have == 0:
        return f"no context for {a.seq_id}"
    try:
        if a.context_start < have:
            proposer.truncate(a.seq_id, a.context_start)
    except Exception as e:  # noqa: BLE001 - a proposer that cannot roll back
        return str(e)
    return ""
