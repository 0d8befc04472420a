"""Prometheus metrics of the drafter service (prefix flashmap_drafter_)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.metrics import LATENCY_BUCKETS


class DrafterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.forward_latency = Histogram(
            "flashmap_drafter_forward_latency_seconds", "One batched draft (all flow steps)", ("drafter", "steps"),
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "flashmap_drafter_batch_size", "Sequences drafted by one batched forward", ("drafter",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )
        self.active_sequences = Gauge("flashmap_drafter_active_sequences", "Sequences whose context the drafter holds", ("drafter",), registry=r)
        self.context_tokens = Gauge("flashmap_drafter_context_tokens", "Context positions cached over all sequences", ("drafter",), registry=r)
        self.step_count = Gauge("flashmap_drafter_step_count", "Current default step count", ("drafter",), registry=r)
        self.blocks = Counter("flashmap_drafter_blocks", "Draft blocks produced", ("drafter", "steps"), registry=r)
        self.released = Counter("flashmap_drafter_released_sequences", "Sequences dropped, by reason", ("drafter", "reason"), registry=r)
