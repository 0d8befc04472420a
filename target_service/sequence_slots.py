"""Which Triton sequence holds which KV slot of the target engine, and what it may send next.

Each Triton sequence (correlation id) owns one slot from its START to its END, its release,
or its idle timeout (Triton's sequence batcher drops idle sequences without telling the
model, so they are freed here after the same time). A row may only start where its
sequence's last verify left it: between the end of its accepted prefix and the end of what
it wrote, so no request reads or overwrites positions its sequence did not commit. A row
without drafts leaves the last token it decoded uncached; a continuation row (TOKENS
[FOLLOW_TOKEN]) is fed that token.

Not thread-safe: the Triton model holds one lock around every call.
"""

from __future__ import annotations

import numpy as np

from flashmap import target_wire
from flashmap.types import FOLLOW_REFUSED, FOLLOW_TOKEN, InvalidRequest
from target_service.engine import NoFreeSlot


class SequenceSlots:
    def __init__(self, engine, idle_timeout_s: float, metrics):
        """metrics: where freed idle sequences are counted and logged (inc, log)."""
        self.engine = engine
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics
        self.slots: dict[int, int] = {}  # correlation id -> engine slot
        # correlation id -> (lo, hi): the START_POS its next request may have (the anchor
        # follows the last verify's accepted prefix).
        self.next_pos: dict[int, tuple[int, int]] = {}
        self.last_use: dict[int, float] = {}  # correlation id -> time.monotonic() of last request
        # correlation id -> (position, token): the last token a row without drafts decoded,
        # not yet in the cache; what a continuation row (TOKENS [FOLLOW_TOKEN]) is fed.
        self.follow: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def release(self, corrid: int) -> bool:
        slot = self.slots.pop(corrid, None)
        self.last_use.pop(corrid, None)
        self.next_pos.pop(corrid, None)
        self.follow.pop(corrid, None)
        if slot is None:
            return False
        self.engine.release(slot)
        return True

    def release_all(self) -> None:
        for corrid in list(self.slots):
            self.release(corrid)

    def allocate(self, now: float) -> int | None:
        """A free slot, or None. Triton admits at most n_slots sequences, so a new one finding
        every slot taken means Triton already dropped an idle sequence that the reaper has not
        freed yet (the two idle clocks start at slightly different times): free the least
        recently used one if it has been idle for a while."""
        try:
            return self.engine.allocate()
        except NoFreeSlot:
            pass
        if not self.last_use:
            return None
        lru = min(self.last_use, key=self.last_use.get)
        if now - self.last_use[lru] < self.idle_timeout_s / 2:
            return None
        self.release(lru)
        self.metrics.inc("flashmap_target_idle_released_total")
        self.metrics.log("info", f"flashmap_target: freed idle sequence {lru} for a new one")
        return self.engine.allocate()

    def reap_idle(self, now: float) -> list[int]:
        """Free the sequences idle longer than the timeout; returns their ids."""
        stale = [c for c, t in self.last_use.items() if now - t > self.idle_timeout_s]
        for c in stale:
            self.release(c)
        if stale:
            self.metrics.inc("flashmap_target_idle_released_total", len(stale))
            self.metrics.log(
                "info", f"flashmap_target: freed {len(stale)} idle sequence(s): {stale}"
            )
        return stale

    def admit(self, corrid: int, start: bool, end: bool, row, now: float):
        """One row of a sequence: its release, or its slot and START_POS checked and row.slot
        set. Returns the row's outcome when it needs no forward (("released",), or no free
        slot), None when it is to be verified. Raises InvalidRequest."""
        if row is None:
            if not end:
                raise InvalidRequest(
                    "TOKENS is empty (send END without tokens to release the sequence)"
                )
            # Release / cancel of a sequence this model holds; no other id is acknowledged.
            if not self.release(corrid):
                raise InvalidRequest("unknown sequence")
            return ("released",)
        if len(row.tokens) == 1 and row.tokens[0] == FOLLOW_TOKEN:
            pos, token = self.follow.get(corrid, (None, 0))
            if start or row.num_draft or pos != row.start_pos:
                raise InvalidRequest(
                    FOLLOW_REFUSED + " a verify of its sequence without drafts that ended at "
                    "its START_POS, with no drafts of its own"
                )
            row.tokens = np.array([token], np.int64)
        if start:
            self.release(corrid)  # a restarted sequence gets a fresh slot
            slot = self.allocate(now)
            if slot is None:
                return (
                    target_wire.ROW_UNAVAILABLE,
                    f"no free KV slot (all {self.engine.n_slots} in use)",
                )
            self.slots[corrid] = slot
        elif corrid not in self.slots:
            raise InvalidRequest(
                "unknown sequence (never started, ended, or idle for more than "
                f"{self.idle_timeout_s:g}s); send START"
            )
        lo, hi = self.next_pos.get(corrid, (0, 0))
        if not lo <= row.start_pos <= hi:
            raise InvalidRequest("START_POS does not continue this sequence")
        # NEXT_SEEDS: the decoded tokens but the last are cached too.
        n = len(row.tokens) + len(row.next_seeds)
        self.next_pos[corrid] = (row.start_pos + n - row.num_draft, row.start_pos + n)
        self.last_use[corrid] = now
        row.slot = self.slots[corrid]
        return None

    def verified(self, corrid: int, row, outcome) -> None:
        """After a row's verify: remember what a continuation of it is fed."""
        if outcome[0] == "ok" and row.num_draft == 0:
            decoded = outcome[1].decoded(row.params.greedy)
            self.follow[corrid] = (
                row.start_pos + len(row.tokens) + len(row.next_seeds),
                int(decoded[-1]),
            )
        else:
            self.follow.pop(corrid, None)
