"""The Triton model's custom metrics and log lines, recorded by any thread and sent by one.

The stub's objects (pb_utils metrics and Logger) are handed in, so this module imports
without a Triton server (tests use stand-ins).
"""

from __future__ import annotations

import threading
import time


class SideChannel:
    """Triton custom metrics and log lines, recorded anywhere and sent by the worker thread.

    Every metric update and log line is an IPC round trip from the stub to the server, paid
    on the worker's time. The worker and the reaper record them here; the worker sends
    them (`flush`) once it has sent a batch's responses, at most every `interval_s` and when
    it has waited that long for the next batch: coalesced (counts summed, a gauge only when it
    changed), logs in order, at most `max_logs` kept (the oldest dropped). All of the model's
    calls into the stub are made by one thread: metric updates from a second thread, beside the
    worker's responses, could stop returning (a counter stood still for good; shutdown waited
    on one past Triton's exit timeout)."""

    def __init__(
        self,
        metrics: dict,
        logger,
        interval_s: float = 0.25,
        wake=lambda: None,
        max_logs: int = 1000,
    ):
        self._metrics = metrics  # name -> pb_utils Metric
        self._logger = logger  # pb_utils.Logger: log_info, log_warn, log_error
        # Called when something is recorded and nothing was: the worker may be idle.
        self._wake = wake
        self._counts: dict[str, float] = {}  # name -> increment not sent yet
        self._gauges: dict[str, float] = {}  # name -> value to set
        self._shown: dict[str, float] = {}  # name -> value Triton shows
        self._logs: list[tuple[str, str]] = []  # (level, message) not sent yet
        self._max_logs = max_logs  # a stub that keeps refusing them must not grow this without end
        self._lock = threading.Lock()  # the reaper records too
        self._interval_s = interval_s
        self._due: float | None = None  # time.monotonic() when what is recorded should go out

    def _record(self) -> None:
        if self._due is None:
            self._due = time.monotonic() + self._interval_s
            self._wake()

    def inc(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n
            self._record()

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value
            self._record()

    def log(self, level: str, message: str) -> None:
        """level: "info", "warn" or "error" (pb_utils.Logger.log_<level>)."""
        with self._lock:
            self._logs.append((level, message))
            del self._logs[: -self._max_logs]
            self._record()

    def wait_s(self) -> float | None:
        """Seconds until what is recorded is due (0: now), None when nothing is."""
        due = self._due
        return None if due is None else max(0.0, due - time.monotonic())

    def flush(self) -> None:
        """Send what is recorded, if it is due."""
        with self._lock:
            if self._due is None or time.monotonic() < self._due:
                return
            counts, self._counts = self._counts, {}
            gauges, self._gauges = self._gauges, {}
            logs, self._logs = self._logs, []
            self._due = None
        try:
            while logs:
                getattr(self._logger, f"log_{logs[0][0]}")(logs[0][1])
                del logs[0]
            for name, n in list(counts.items()):
                if n:
                    self._metrics[name].increment(n)
                del counts[name]
            for name, v in list(gauges.items()):
                if self._shown.get(name) != v:
                    self._metrics[name].set(v)
                    self._shown[name] = v
                del gauges[name]
        finally:  # what a failed call did not send goes with the next flush, not lost
            with self._lock:
                for name, n in counts.items():
                    self._counts[name] = self._counts.get(name, 0) + n
                for name, v in gauges.items():
                    self._gauges.setdefault(name, v)
                self._logs[:0] = logs
                if counts or gauges or logs:
                    self._record()
