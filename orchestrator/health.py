"""What the orchestrator says about the target: gRPC health (grpc.health.v1, SERVING /
NOT_SERVING) and `ok` for its own Health RPC and the HTTP /health, never a call that could hang
on a stalled part. Busy, the verify calls tell (`set` after each round); idle, or when no verify
has succeeded for a while, a probe request through the model does (`watch`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

log = logging.getLogger("flashmap.orchestrator")


class TargetHealth:
    def __init__(self, service_name: str, interval_s: float):
        self.servicer = health.aio.HealthServicer()  # what the gRPC server exports
        self.service_name = service_name
        self.interval_s = interval_s
        self.ok = True
        self._last_ok = time.monotonic()

    async def set(self, ok: bool, why: str = "") -> None:
        """NOT_SERVING while the target cannot verify, SERVING once it can."""
        if ok:
            self._last_ok = time.monotonic()
        if ok == self.ok:
            return
        self.ok = ok
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for svc in ("", self.service_name):
            await self.servicer.set(svc, status)
        log.warning(
            "target %s%s",
            "usable again: SERVING" if ok else "unusable: NOT_SERVING",
            f" ({why})" if why else "",
        )

    async def watch(self, target, busy: Callable[[], bool]) -> None:
        """Probe the target (orchestrator.target_client.TargetClient) whenever the rounds do not
        tell: nothing is `busy`, or no verify has succeeded for three intervals."""
        while True:
            await asyncio.sleep(self.interval_s)
            stale = time.monotonic() - self._last_ok > max(3 * self.interval_s, 5.0)
            if busy() and not stale:
                continue
            ok = await target.probe(timeout_s=max(self.interval_s, 2.0))
            await self.set(ok, "probe request failed" if not ok else "")
