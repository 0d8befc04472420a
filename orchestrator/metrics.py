"""Prometheus metrics of the orchestrator (prefix flashmap_).

Counters follow vLLM's spec-decode shape so existing PromQL carries over:
mean acceptance length = 1 + num_accepted_tokens / num_drafts.
Each server gets its own registry so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets start at 100 microseconds (DESIGN.md).
LATENCY_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
LABELS = ("model", "drafter", "steps")


class OrchestratorMetrics:
    def __init__(self, block_size: int = 16, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.block_size = block_size
        self._per_pos_ready: set[tuple] = set()
        self.num_drafts = Counter("flashmap_num_drafts", "Speculative rounds that verified a draft", LABELS, registry=r)
        self.num_draft_tokens = Counter("flashmap_num_draft_tokens", "Draft tokens sent to verification", LABELS, registry=r)
        self.num_accepted_tokens = Counter("flashmap_num_accepted_tokens", "Draft tokens accepted", LABELS, registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "flashmap_num_accepted_tokens_per_pos", "Draft tokens accepted at each slot (1-based)", LABELS + ("position",), registry=r
        )
        self.acceptance_length = Histogram(
            "flashmap_acceptance_length", "Tokens committed per speculative round (gamma)", LABELS,
            buckets=tuple(range(1, block_size + 2)), registry=r,
        )
        self.draft_latency = Histogram("flashmap_draft_latency_seconds", "Drafter call latency", LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.verify_latency = Histogram("flashmap_verify_latency_seconds", "Target verify latency", ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.round_latency = Histogram("flashmap_round_latency_seconds", "Whole round latency (draft + verify + commit)", LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("flashmap_time_to_first_token_seconds", "Time to first token", ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("flashmap_inter_token_latency_seconds", "Time between streamed tokens, per token", ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("flashmap_requests", "Finished requests by status", ("model", "status"), registry=r)
        self.active_requests = Gauge("flashmap_active_requests", "Requests holding a KV slot", ("model",), registry=r)
        self.queued_requests = Gauge("flashmap_queued_requests", "Requests waiting for a KV slot", ("model",), registry=r)
        self.drafter_steps = Gauge("flashmap_drafter_steps", "Current drafter step count (flow-map jumps)", ("drafter",), registry=r)
        self.fallback_rounds = Counter("flashmap_fallback_rounds", "Rounds decoded autoregressively because the drafter was down or late", ("model", "reason"), registry=r)
        self.generated_tokens = Counter("flashmap_generated_tokens", "Tokens streamed to clients", ("model",), registry=r)
        self.prompt_tokens = Counter("flashmap_prompt_tokens", "Prompt tokens prefilled", ("model",), registry=r)
        self.verify_batch_size = Histogram(
            "flashmap_verify_batch_size", "Sequences served by one target verify forward", ("model",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )

    def record_round(self, labels: dict, num_draft: int, num_accepted: int) -> None:
        """One verified draft of num_draft tokens of which the first num_accepted were accepted."""
        if num_draft == 0:
            return
        key = tuple(sorted(labels.items()))
        if key not in self._per_pos_ready:
            # Every position exists from the first draft on, at 0 until accepted (vLLM does the
            # same): a never-accepted slot reads 0, not "no data", and the first acceptance at
            # a slot is an increase that rate() can see.
            self._per_pos_ready.add(key)
            for pos in range(1, self.block_size + 1):
                self.num_accepted_tokens_per_pos.labels(**labels, position=str(pos))
        self.num_drafts.labels(**labels).inc()
        self.num_draft_tokens.labels(**labels).inc(num_draft)
        self.num_accepted_tokens.labels(**labels).inc(num_accepted)
        for pos in range(1, num_accepted + 1):
            self.num_accepted_tokens_per_pos.labels(**labels, position=str(pos)).inc()
        self.acceptance_length.labels(**labels).observe(num_accepted + 1)
