"""Burst admission: requests that a client sends together start in one prefill.

Clients often send requests together: a batch job's workers, or a closed loop whose requests
end together and come back together. The first of them to reach an idle scheduler would start
a round alone, and the rest, arriving during that round's forward, would wait for it and
prefill in the next: the burst pays a forward more, and most of it gets its first token a
forward later. So when the scheduler wakes from idle into a burst, it waits until no request
has arrived for `gap_s` (or `window_s` has passed, or the slots are full) and starts them all
in one round. Triton's dynamic batcher has the same knob (max_queue_delay_microseconds), fixed;
this one waits only for bursts: when more than one request is already waiting, or requests
have arrived less than `gap_s` apart since the last start from idle. Traffic without bursts
(one client at a time, requests spread out) never waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BurstConfig:
    window_s: float = 0.010  # the longest a start from idle waits for its burst; 0 = never wait
    gap_s: float = 0.001  # requests closer than this are one burst; the wait ends after this long without one


class BurstGate:
    """The scheduler's wait for the rest of a burst when it wakes from idle. Times are the
    caller's clock (seconds)."""

    def __init__(self, cfg: BurstConfig | None = None):
        self.cfg = cfg or BurstConfig()
        self.last_arrival = -math.inf
        self._opened = -math.inf  # when the scheduler last woke from idle
        self._bursty = False  # two requests arrived less than gap_s apart since then

    def arrived(self, now: float) -> None:
        """A request was submitted."""
        if now - self.last_arrival <= self.cfg.gap_s:
            self._bursty = True
        self.last_arrival = now

    def open(self, now: float, waiting: int) -> bool:
        """The scheduler woke from idle with `waiting` requests: True when it should wait for
        the rest of a burst (then `until` says how long)."""
        wait = self.cfg.window_s > 0 and (self._bursty or waiting > 1)
        self._opened, self._bursty = now, False
        return wait

    @property
    def in_burst(self) -> bool:
        """Two requests arrived less than gap_s apart since the scheduler last woke from idle."""
        return self._bursty

    def until(self, now: float) -> float | None:
        """While waiting: when to look again, or None when the burst is over (start now)."""
        t = min(self.last_arrival + self.cfg.gap_s, self._opened + self.cfg.window_s)
        return t if t > now else None
