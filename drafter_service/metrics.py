"""The drafter service's Prometheus registry (prefix flashmap_drafter_), built from the
catalogue (flashmap.metrics.DRAFTER)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from flashmap.metrics import DRAFTER, build


class DrafterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        m = build(DRAFTER, self.registry)
        self.forward_latency = m["flashmap_drafter_forward_latency_seconds"]
        self.batch_size = m["flashmap_drafter_batch_size"]
        self.active_sequences = m["flashmap_drafter_active_sequences"]
        self.context_tokens = m["flashmap_drafter_context_tokens"]
        self.step_count = m["flashmap_drafter_step_count"]
        self.blocks = m["flashmap_drafter_blocks"]
        self.released = m["flashmap_drafter_released_sequences"]
