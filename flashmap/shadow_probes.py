"""Shadow probes: a greedy request drafts a block while the rounds go on, and nothing of it is
verified; the speculation controller counts how much of it the committed text accepts
(SpeculationController.observe_shadows), as a verify would have at T = 0.

Numpy only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from weakref import WeakKeyDictionary

import numpy as np

from flashmap.round_metadata import RoundResult, SeqPlan
from flashmap.sequence import Sequence

log = logging.getLogger("flashmap.rounds")

_SHADOWS: set[asyncio.Task] = set()  # probes in flight: the event loop holds its tasks weakly


class ShadowBlocks:
    """The shadow probes' blocks not decided yet, and per sequence the slots its decided blocks
    reached and had accepted. Keyed by the Sequence itself, held weakly: an entry ends with its
    request."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.decided = 0  # blocks whose acceptance was counted
        self._blocks: WeakKeyDictionary[Sequence, tuple[int, np.ndarray]] = WeakKeyDictionary()
        self._counts: WeakKeyDictionary[Sequence, np.ndarray] = WeakKeyDictionary()
        self._none = np.zeros((2, block_size), np.int64)

    def drafted(self, s: Sequence, start: int, block: np.ndarray) -> None:
        """A probe drafted `block` [k] for s's tokens start.. (not committed yet)."""
        self._blocks[s] = (start, block)

    def pending(self, s: Sequence) -> bool:
        return s in self._blocks

    def counts(self, s: Sequence) -> np.ndarray:
        """[2, K] the slots s's decided blocks reached (row 0) and had accepted (row 1)."""
        return self._counts.get(s, self._none)

    def decide(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(slots verified, slots accepted) of each block the committed text now decides: its
        tokens are accepted up to the first that differs from the committed one (that slot
        verified, not accepted); a block the request ended inside counts the slots it reached.
        Shadows never enter the request's own SpecStats."""
        out = []
        for s in seqs:
            if s not in self._blocks:
                continue
            pos, block = self._blocks[s]
            seen = np.asarray(s.tokens[pos : pos + len(block)], np.int64)
            same = seen == block[: len(seen)]
            accepted = int(np.argmin(np.append(same, False)))  # the leading matches
            if accepted == len(seen) < len(block) and not s.finished:
                continue  # every committed token matched so far: the rest decides
            verified = min(len(block), accepted + 1) if accepted < len(seen) else accepted
            counts = self._counts.setdefault(s, np.zeros((2, self.block_size), np.int64))
            counts[0, :verified] += 1
            counts[1, :accepted] += 1
            del self._blocks[s]
            self.decided += 1
            out.append((verified, accepted))
        return out


def start_shadow_probes(out: RoundResult, drafter, controller) -> int:
    """Start the probes the round's plan asked for (RoundPlan.shadow); how many."""
    probes = [r.seq for r in out.sequences if r.seq.seq_id in out.plan.shadow]
    if not probes or drafter is None:
        return 0
    task = asyncio.ensure_future(
        _shadow_probe(probes, [out.plan.shadow[s.seq_id] for s in probes], drafter, controller)
    )
    _SHADOWS.add(task)
    task.add_done_callback(_SHADOWS.discard)
    return len(probes)


async def _shadow_probe(seqs: list[Sequence], lengths: list[int], drafter, controller) -> None:
    """Draft a block of up to lengths[i] tokens after each sequence's anchor as it stands now.
    Skipped when the drafter is busy or a sequence cannot draft now (ended, its context
    incomplete, a block still undecided). Never raises: a lost probe only leaves the estimates
    as they were."""
    if getattr(drafter, "busy", False):
        return
    keep = [
        (s, min(n, s.request.max_new_tokens - len(s.generated) - 1))
        for s, n in zip(seqs, lengths)
        if not s.finished
        and not s.context.lost
        and not controller.shadow.pending(s)
        and s.context_gap() is None
    ]
    keep = [(s, n) for s, n in keep if n > 0]
    if not keep:
        return
    seqs = [s for s, _ in keep]
    starts = [len(s.tokens) for s in seqs]  # where each block's first token will be committed
    t0 = time.perf_counter()
    try:
        batch = await drafter.draft(seqs, [SeqPlan(n) for _, n in keep])
    except Exception:  # noqa: BLE001 - a probe must not take the scheduler down
        log.exception("shadow probe failed")
        return
    if not batch.blocks:
        return
    controller.observe_draft(len(seqs), time.perf_counter() - t0)
    for s, start in zip(seqs, starts):
        blocks = batch.blocks.get(s.seq_id)
        if blocks and len(blocks[0].tokens):
            controller.shadow.drafted(s, start, np.asarray(blocks[0].tokens, np.int64))
    controller.observe_shadows(seqs)
