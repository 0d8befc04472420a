"""Requests that outlive their target: when Triton dies under them, they continue on the
restarted one with the text they would have had.

A round whose verify never reached a live model (flashmap.types.TargetLost: tritonserver
killed or restarting, its model not loaded) commits nothing and rewinds its sequences
(flashmap.sequence.Sequence.rewind): their committed tokens are final, and the random draws of
the rounds lost are undone. The scheduler parks them here. A parked sequence is in no round (a
round sent ahead with one of them is dropped, and its other sequences are rewound and parked
too: nobody knows what the target ran of it), and every RETRY_S one call tries to write each
one's committed positions but the anchor into the target's new cache (Sequence.rebuild_row,
with START: a restarted target knows none of them). Once it answers they rejoin the rounds. The
round retried draws the seeds the lost one drew, and the drafter, which kept its context,
drafts again from the same context and seed: the same tokens at temperature 0, and for a
seeded request the same text whenever that block comes out the same (the target's law in any
case). A request whose deadline passes first ends with DEADLINE_EXCEEDED; one that waits longer
than --resume-timeout-s ends with UNAVAILABLE; both say that the target was down.
"""

from __future__ import annotations

import asyncio
import time

from flashmap.drafts import SeqId
from flashmap.pipeline import Ahead
from flashmap.sequence import Sequence
from flashmap.types import TargetLost
from orchestrator.target_client import TargetUnavailable, TritonTarget

RETRY_S = 0.5  # between tries to rebuild the parked sequences on the target


class Parking:
    def __init__(self, target: TritonTarget, timeout_s: float):
        self.target = target
        self.timeout_s = timeout_s
        self.since: dict[SeqId, float] = {}  # parked sequence -> when it lost the target
        self._next_try = 0.0

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.since

    def park(self, s: Sequence) -> None:
        self.since.setdefault(s.seq_id, time.monotonic())

    def forget(self, seq_id: SeqId) -> None:
        self.since.pop(seq_id, None)

    def overdue(self, seq_id: SeqId, now: float, deadline: float | None) -> Exception | None:
        """Why a parked request ends now (its deadline passed, or it waited longer than the
        resume timeout), or None."""
        since = self.since.get(seq_id)
        if since is None:
            return None
        if deadline is not None and now > deadline:
            return TimeoutError(
                f"the request's deadline passed while the target was down ({now - since:.1f} s)"
            )
        if now - since > self.timeout_s:
            return TargetUnavailable(
                f"the target was down for {now - since:.0f} s (resume timeout "
                f"{self.timeout_s:g} s); the request could not continue"
            )
        return None

    def drop_ahead(self, ahead: Ahead | None) -> Ahead | None:
        """The round sent ahead, unless one of its sequences is parked: then it is dropped
        (its answer is never read) and its other sequences are parked too."""
        if ahead is None or not any(s.seq_id in self.since for s in ahead.seqs):
            return ahead
        for s in ahead.seqs:
            if not s.finished and s.seq_id not in self.since:
                s.rewind()
                self.park(s)
        return None

    async def resume(self, seqs: list[Sequence]) -> list[Sequence]:
        """Try to continue these parked sequences, at most every RETRY_S: one call rebuilds the
        caches of the prefilled ones (for a prompt that was lost, its own row does it: a probe
        says whether the target is back). Returns the sequences that rejoin the rounds; a row
        the target refuses for another reason than being down fails its request."""
        now = time.monotonic()
        if not seqs or now < self._next_try:
            return []
        self._next_try = now + RETRY_S
        rows = [(s, r) for s in seqs if (r := s.rebuild_row()) is not None]
        if rows:
            results = await self.target.verify([r for _, r in rows])
            if any(isinstance(res, TargetLost) for res in results):
                return []
            for (s, _), res in zip(rows, results):
                if isinstance(res, BaseException):
                    s.fail(res)
        elif not await self.target.client.probe(timeout_s=max(RETRY_S, 2.0)):
            return []
        for s in seqs:
            self.forget(s.seq_id)
        return [s for s in seqs if not s.finished]

    async def idle(self, wake: asyncio.Event) -> None:
        """Every request is parked: wait for the next try, or for the scheduler to be woken."""
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), max(self._next_try - time.monotonic(), 0.01))
        except TimeoutError:
            pass
