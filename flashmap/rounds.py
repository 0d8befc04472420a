"""One speculative round for a batch of sequences: the round loop of every runtime.

The in-process decoder (flashmap.inprocess) and the orchestrator (orchestrator.server)
both call `speculative_round`; they differ only in what they plug in:

    Drafter   local proposer (inprocess.LocalDrafter) | drafter service (orchestrator.drafter_client)
    Target    local engine (inprocess.LocalTarget)    | Triton (orchestrator.target_client)

A round: every sequence that can draft asks the drafter for a block (or `tree_blocks`
blocks from independent noise, greedy requests only); sequences without a block decode
one token autoregressively, which keeps the output exact (when nobody drafts, or only the
controller's probe does, up to `decode_steps` tokens each in the same call:
VerifyRow.next_seeds). Then one verify call covers every sequence (a prefill next to
drafted rows). A greedy draft may be a tree (a drafter's own, as EAGLE-3's, or several blocks
merged into one: Draft.merged); the target verifies it in the same call and answers for the
path it accepts, which commits as if that path alone had been the draft. Rejection sampling
commits the accepted tokens plus one (Sequence.commit).

Pipelining (the orchestrator's --pipeline): a round without drafts or prompts may send the
next round before its own answer arrives (`Ahead`, `send_ahead`), when that one would draft
nothing either. Its rows are Sequence.follow_row: the token [FOLLOW_TOKEN], which the target
replaces with the last token it decoded for the sequence, and the seeds the next round would
draw, so the target runs the rounds back to back and the text does not change.

The protocols are async so the remote clients can await the network; the local ones
never suspend, so `run_local` drives a round without an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from flashmap.sequence import Sequence
from flashmap.speculation import SpeculationController
from flashmap.types import FOLLOW_REFUSED, Draft, InvalidRequest, VerifyRow

log = logging.getLogger("flashmap.rounds")


@dataclass
class DraftBatch:
    """A drafter's answer for one round: blocks per sequence id (one block, a chain or a tree;
    several greedy blocks are verified as one tree). Sequences missing here draft nothing this
    round; `failure` says why when the whole call failed ("unavailable", "timeout")."""

    blocks: dict[int, list[Draft]] = field(default_factory=dict)
    failure: str = ""


class Drafter(Protocol):
    block_size: int

    async def draft(
        self, seqs: list[Sequence], n_blocks: list[int], max_draft_tokens: list[int] | None = None
    ) -> DraftBatch:
        """Blocks after each sequence's anchor, n_blocks[i] of them for seqs[i], of at most
        max_draft_tokens[i] tokens (default Sequence.draft_budget: the round loop takes them as
        they come). Sends the sequence's unacknowledged
        context first (Sequence.context_for_drafter); calls Sequence.lose_drafter when the
        drafter can no longer serve a sequence. A drafter whose calls can overlap (a shadow
        probe's beside a round's) says so in `busy`; while it is not busy, `draft` reads the
        sequences before it first suspends."""

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


@dataclass
class SequenceRound:
    """One sequence's part of a round."""

    seq: Sequence
    new_tokens: list[int]  # committed this round (the first response token at prefill)
    prefill: bool
    drafted: int = 0  # draft tokens verified
    accepted: int = 0
    fallback: str = (
        ""  # why a sequence that wanted a draft had none: unavailable | timeout | context_lost
    )
    error: BaseException | None = None


@dataclass
class RoundResult:
    sequences: list[SequenceRound]
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_steps: int = 0  # step count of this round's blocks (0: none drafted)
    decode_steps: int = 1  # most tokens a row without a draft decoded in the verify call
    plan: dict[int, int] | None = (
        None  # the controller's draft length per sequence id (None: no controller)
    )
    ahead: Ahead | None = None  # the next round, already sent (send_ahead)
    shadows: int = 0  # shadow probes started after this round (SpeculationController.shadow)
    # With a controller: the draft tokens it expected the drafted rows to have accepted (its
    # estimate before the verify) and what they did accept, over the rows verified without error.
    expected_accepted: float = 0.0
    accepted: int = 0


@dataclass
class Ahead:
    """A round without drafts sent before the round it follows has answered (pipelining): one
    Sequence.follow_row per sequence that round could not end, fed by the target with the last
    token it decoded, so the target starts it the moment it finishes the round before.
    `speculative_round(..., ahead=...)` completes it."""

    seqs: list[Sequence]
    rows: list[VerifyRow]
    call: asyncio.Future  # the verify, a task: in flight
    plan: dict[int, int] | None = None
    since: float = (
        0.0  # perf_counter when the round before it answered (its round's cost starts there)
    )
    shadow: dict[int, int] = field(
        default_factory=dict
    )  # its plan's shadow probes (SpeculationController.shadow)


async def speculative_round(
    seqs: list[Sequence],
    target: Target,
    drafter: Drafter | None = None,
    tree_blocks: int = 1,
    controller: SpeculationController | None = None,
    decode_steps: int = 1,
    ahead: Ahead | None = None,
    send_ahead: bool = False,
) -> RoundResult:
    """One draft + verify + commit for every sequence in `seqs` (none finished). controller:
    chooses each sequence's draft length from measured costs (None: the whole block).
    decode_steps: tokens per row of a round without drafts (one verify call for all of them).
    ahead: this round was sent ahead (`seqs` is then ahead.seqs; the finished ones commit
    nothing). send_ahead: if this round drafts nothing and the next would draft nothing either,
    send the next round now (RoundResult.ahead), for the sequences this one cannot end."""
    out = RoundResult([])
    t_round = time.perf_counter() if ahead is None else ahead.since
    batch, asked, lost, gone, shadow, expected = DraftBatch(), set(), set(), set(), {}, {}
    if ahead is not None:
        seqs, rows, out.plan, shadow = ahead.seqs, ahead.rows, ahead.plan, ahead.shadow
        gone = {
            s.seq_id for s in seqs if s.finished
        }  # ended after this round was sent: not part of it
        drafts = [None] * len(rows)
        call = ahead.call
    else:
        if controller is not None and drafter is not None:
            out.plan, shadow = controller.plan(seqs), controller.shadow
        wanted = [s for s in seqs if s.draft_budget() > 0] if drafter is not None else []
        ask = [s for s in wanted if not s.drafter_lost]
        asked = {s.seq_id for s in ask}
        lost = {s.seq_id for s in wanted if s.drafter_lost}
        if ask:
            t0 = time.perf_counter()
            batch = await drafter.draft(ask, [tree_blocks if s.params.greedy else 1 for s in ask])
            out.draft_s = time.perf_counter() - t0
        rows, drafts = _rows(
            seqs,
            batch,
            target,
            decode_steps,
            probing=out.plan is not None and controller.probing,
            drafter=drafter is not None,
        )
        if controller is not None and any(
            r.num_draft for r in rows
        ):  # before the commits update the estimates
            drafted = [(s, r.num_draft) for s, r in zip(seqs, rows) if r.num_draft]
            expected = dict(
                zip(
                    [s.seq_id for s, _ in drafted],
                    controller.expected_accepted([s for s, _ in drafted], [n for _, n in drafted]),
                )
            )
        # A coroutine, not a task: awaited below, it goes out before any round sent ahead (a
        # task, started when this one first waits), and a local round needs no event loop.
        call = target.verify(rows, [s.ends_with(r) for s, r in zip(seqs, rows)])
    for draft in drafts:
        if draft is not None and draft.draft_steps:
            out.draft_steps = draft.draft_steps
    out.decode_steps = max(r.steps for r in rows)
    if send_ahead and not any(r.num_draft for r in rows):
        out.ahead = _send_ahead(seqs, rows, target, drafter, controller, decode_steps)
    t0 = time.perf_counter() if ahead is None else ahead.since
    results = await call
    if ahead is not None:
        rows, results = await _followed(seqs, rows, results, target)
    now = time.perf_counter()
    out.verify_s = now - t0
    if out.ahead is not None:
        out.ahead.since = now

    for s, row, draft, res in zip(seqs, rows, drafts, results):
        if s.seq_id in gone:
            continue
        s.stats.draft_s += out.draft_s if s.seq_id in asked else 0.0
        s.stats.verify_s += out.verify_s
        prefill = not s.prefilled
        fallback = ""
        if s.seq_id in asked | lost and draft is None:
            fallback = "context_lost" if s.drafter_lost else (batch.failure or "context_lost")
            s.stats.fallback_rounds += 1
        if isinstance(res, BaseException):
            s.fail(res)
            out.sequences.append(SequenceRound(s, [], prefill, fallback=fallback, error=res))
            continue
        result, path = res
        drafted, tree = row.num_draft, None
        if row.is_tree:  # the accepted path, committed as if it alone had been the draft
            tree, draft = draft, Draft.greedy(draft.tokens[path], draft.draft_steps)
            row = replace(
                row,
                tokens=np.concatenate([row.tokens[: len(row.tokens) - drafted], draft.tokens]),
                support_ids=draft.support_ids,
                parents=np.zeros(0, np.int64),
            )
        new, accepted = s.commit(row, draft, result, tree)
        out.sequences.append(SequenceRound(s, new, prefill, drafted, accepted, fallback))
        if s.seq_id in expected:
            out.expected_accepted += float(expected[s.seq_id])
            out.accepted += accepted
    if controller is not None:
        controller.observe_shadows(seqs)
        probes = [s for s in seqs if s.seq_id in shadow and s.seq_id not in gone]
        if probes and drafter is not None:
            out.shadows = len(probes)
            _spawn(_shadow_probe(probes, [shadow[s.seq_id] for s in probes], drafter, controller))
        tokens = controller.verify_tokens([len(r.tokens) for r in rows])
        rest_s = (
            time.perf_counter() - t_round - out.draft_s
        )  # the verify call and the round's own work
        controller.observe(
            len(rows),
            tokens,
            rest_s,
            len(asked),
            out.draft_s,
            [(r.seq.params.greedy, r.drafted, r.accepted) for r in out.sequences],
            prefill=any(r.prefill for r in out.sequences),
            decode_steps=out.decode_steps,
        )
    return out


def _rows(
    seqs: list[Sequence],
    batch: DraftBatch,
    target: Target,
    decode_steps: int,
    probing: bool,
    drafter: bool,
):
    """Each sequence's verify row and draft (or None) for this round."""
    rows, drafts, picked = [], [], []
    for s in seqs:
        blocks = batch.blocks.get(s.seq_id, [])
        draft = blocks[0] if blocks else None
        if len(blocks) > 1:  # greedy blocks from independent noise: one tree (a trie)
            tree = Draft.merged([b.tokens for b in blocks], draft.draft_steps)
            if len(s.tokens) + len(tree.tokens) <= target.max_seq_len:  # else block 0 alone
                draft = tree
        picked.append(draft)
    # A round without a new prompt (whose first token is not held back) decodes up to
    # `decode_steps` tokens per row without a draft in its one verify call, when nobody drafts
    # or the only drafting is the controller's probe (the others do not wait for it).
    plain = all(d is None or len(d.tokens) == 0 for d in picked)
    multi = all(s.prefilled for s in seqs) and (plain or probing)
    for s, draft in zip(seqs, picked):
        rows.append(s.verify_row(draft, decode_steps if multi else 1, drafter))
        drafts.append(draft)
    return rows, drafts


def _send_ahead(
    seqs: list[Sequence],
    rows: list[VerifyRow],
    target: Target,
    drafter: Drafter | None,
    controller: SpeculationController | None,
    decode_steps: int,
) -> Ahead | None:
    """The next round, sent now, when it drafts nothing either: a follow_row for every sequence
    this round (rows without drafts, in flight) cannot end. None when it would draft, or when
    every sequence ends here."""
    pairs = [(s, r) for s, r in zip(seqs, rows) if not s.finished and not s.ends_with(r)]
    if not pairs:
        return None
    nxt = [s for s, _ in pairs]
    plan, shadow = None, {}
    if drafter is not None:
        fresh = [s for s in nxt if not s.prefilled]
        for s in fresh:  # the next round is planned as after this one commits their prompts
            s.prefilled = True
        try:
            if controller is None:
                if any(s.wants_draft() for s in nxt):
                    return None
            elif any(controller.peek(nxt).values()):
                return None
            else:
                plan, shadow = controller.plan(nxt), controller.shadow
        finally:
            for s in fresh:
                s.prefilled = False
    follow = [s.follow_row(r, decode_steps, drafter is not None) for s, r in pairs]
    last = [s.ends_with(f, ahead=r.steps) for (s, r), f in zip(pairs, follow)]
    return Ahead(
        nxt,
        follow,
        asyncio.ensure_future(target.verify(follow, last)),
        plan,
        shadow=shadow,
    )


_SHADOWS: set[asyncio.Task] = (
    set()
)  # shadow probes in flight: the event loop holds its tasks weakly


def _spawn(coro) -> None:
    task = asyncio.ensure_future(coro)
    _SHADOWS.add(task)
    task.add_done_callback(_SHADOWS.discard)


async def _shadow_probe(
    seqs: list[Sequence], lengths: list[int], drafter: Drafter, controller: SpeculationController
) -> None:
    """Draft a block of up to lengths[i] tokens after each sequence's anchor as it stands now,
    while the rounds go on; the controller counts how much of it the committed text accepts
    (SpeculationController.observe_shadows). Skipped when the drafter is busy or a sequence
    cannot draft now (ended, its context incomplete, a block still undecided). Never raises:
    a lost probe only leaves the estimates as they were."""
    if getattr(drafter, "busy", False):
        return
    keep = [
        (s, min(n, s.request.max_new_tokens - len(s.generated) - 1))
        for s, n in zip(seqs, lengths)
        if not s.finished and not s.drafter_lost and s.shadow is None and s.context_gap() is None
    ]
    keep = [(s, n) for s, n in keep if n > 0]
    if not keep:
        return
    seqs, lengths = [s for s, _ in keep], [n for _, n in keep]
    starts = [len(s.tokens) for s in seqs]  # where each block's first token will be committed
    t0 = time.perf_counter()
    try:
        batch = await drafter.draft(seqs, [1] * len(seqs), lengths)
    except Exception:  # noqa: BLE001 - a probe must not take the scheduler down
        log.exception("shadow probe failed")
        return
    if not batch.blocks:
        return
    controller.observe_draft(len(seqs), time.perf_counter() - t0)
    for s, start in zip(seqs, starts):
        blocks = batch.blocks.get(s.seq_id)
        if blocks and len(blocks[0].tokens):
            s.shadow = (start, np.asarray(blocks[0].tokens, np.int64))
    controller.observe_shadows(seqs)


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
        except (
            ValueError
        ) as e:  # never commit a step the target did not take after this sequence's last
            results[i] = e
            continue
        if isinstance(res, InvalidRequest) and str(res).startswith(FOLLOW_REFUSED):
            again.append(i)
    if again:
        redo = await target.verify(
            [rows[i] for i in again],
            [seqs[i].ends_with(rows[i]) for i in again],
        )
        for i, res in zip(again, redo):
            results[i] = res
    return rows, results


def run_local(coro):
    """Run a coroutine whose awaits never suspend (the local drafter and target) without an
    event loop: a round in one process costs no scheduling."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a local round awaited I/O: use an event loop for remote parts")
