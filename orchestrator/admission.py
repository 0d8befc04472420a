"""Burst admission: requests that a client sends together start in one prefill.

Clients often send requests together: a batch job's workers, or a closed loop whose requests
end together and come back together. The first of them to reach an idle scheduler would start
a round alone, and the rest, arriving during that round's forward, would prefill in the next:
the burst pays a forward more, and with rounds of many tokens a call (its first decode goes
out behind its prompt) the first one runs that call alone and the rest end a call after it.
So when the scheduler wakes from idle into a burst, it waits until no request has arrived for
`gap_s` (or `window_s` has passed, or the slots are full) and starts them all in one round.
Triton's dynamic batcher has the same knob (max_queue_delay_microseconds), fixed; this one
waits only for bursts: when more than one request is already waiting, when requests have
arrived less than `gap_s` apart since the last start from idle, or when that start took in
more than one request (the closed loop's next burst, whose first request may wake the
scheduler alone). Traffic without bursts (one client at a time, requests spread out) never
waits, but once after a burst.

The defaults weigh the wait against what a split burst costs: the gap is longer than a
client takes to send the requests of a burst, the window short next to the call that a split
burst pays (a one-token round for all, or a multi-token call run for the first alone);
docs/experiments/2026-12-03-bursts-that-split.md measured both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BurstConfig:
    window_s: float = 0.025  # the longest a start from idle waits for its burst; 0 = never wait
    gap_s: float = (
        0.0025  # requests closer than this are one burst; the wait ends after this long without one
    )


class BurstGate:
    """The scheduler's wait for the rest of a burst when it wakes from idle. Times are the
    caller's clock (seconds)."""

    def __init__(self, cfg: BurstConfig | None = None):
        self.cfg = cfg or BurstConfig()
        self.last_arrival = -math.inf
        self._opened = -math.inf  # when the scheduler last woke from idle
        self._bursty = False  # two requests arrived less than gap_s apart since then
        self._last_start = 0  # requests the last start from idle took in (started)
        self._waited = False  # the last wake from idle waited for a burst

    def arrived(self, now: float) -> None:
        """A request was submitted."""
        if now - self.last_arrival <= self.cfg.gap_s:
            self._bursty = True
        self.last_arrival = now

    def open(self, now: float, waiting: int) -> bool:
        """The scheduler woke from idle with `waiting` requests: True when it should wait for
        the rest of a burst (then `until` says how long)."""
        wait = self.cfg.window_s > 0 and (self._bursty or waiting > 1 or self._last_start > 1)
        self._opened, self._bursty, self._waited = now, False, wait
        return wait

    def started(self, n: int) -> None:
        """The start from idle took in `n` requests (after its wait, if any)."""
        self._last_start = n

    @property
    def in_burst(self) -> bool:
        """Requests are coming together: the last wake from idle waited for a burst, or two
        arrived less than gap_s apart since. A request that started alone after such a wait
        may be the first of a burst whose rest is late, so it does not send its first decode
        behind its prompt (orchestrator.server): that call would run it alone."""
        return self._bursty or self._waited

    def until(self, now: float) -> float | None:
        """While waiting: when to look again, or None when the burst is over (start now)."""
        t = min(self.last_arrival + self.cfg.gap_s, self._opened + self.cfg.window_s)
        return t if t > now else None
