"""The orchestrator's Prometheus registry, built from the catalogue (flashmap.metrics).

Each server gets its own registry so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from flashmap.metrics import build, orchestrator_metrics
from flashmap.types import BLOCK_SIZE


class OrchestratorMetrics:
    def __init__(self, block_size: int = BLOCK_SIZE, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.block_size = block_size
        self._drafts_ready: set[tuple] = set()
        m = build(orchestrator_metrics(block_size), self.registry)
        self.num_drafts = m["flashmap_num_drafts"]
        self.num_draft_tokens = m["flashmap_num_draft_tokens"]
        self.num_accepted_tokens = m["flashmap_num_accepted_tokens"]
        self.num_accepted_tokens_per_pos = m["flashmap_num_accepted_tokens_per_pos"]
        self.acceptance_length = m["flashmap_acceptance_length"]
        self.draft_length = m["flashmap_draft_length"]
        self.speculation_off_rounds = m["flashmap_speculation_off_rounds"]
        self.plain_tokens = m["flashmap_plain_tokens"]
        self.rounds_ahead = m["flashmap_rounds_ahead"]
        self.shadow_probes = m["flashmap_shadow_probes"]
        self.controller_accepted = m["flashmap_controller_accepted_tokens"]
        self.burst_wait = m["flashmap_burst_wait_seconds"]
        self.draft_latency = m["flashmap_draft_latency_seconds"]
        self.verify_latency = m["flashmap_verify_latency_seconds"]
        self.round_latency = m["flashmap_round_latency_seconds"]
        self.ttft = m["flashmap_time_to_first_token_seconds"]
        self.itl = m["flashmap_inter_token_latency_seconds"]
        self.requests = m["flashmap_requests"]
        self.active_requests = m["flashmap_active_requests"]
        self.queued_requests = m["flashmap_queued_requests"]
        self.drafter_steps = m["flashmap_drafter_steps"]
        self.fallback_rounds = m["flashmap_fallback_rounds"]
        self.generated_tokens = m["flashmap_generated_tokens"]
        self.prompt_tokens = m["flashmap_prompt_tokens"]
        self.verify_batch_size = m["flashmap_verify_batch_size"]
        self.resumed_requests = m["flashmap_resumed_requests"]

    def start_at_zero(self, model: str, draft_labels: list[dict] = ()) -> None:
        """Export the series that alerts divide by, at 0, from the start: a series that first
        appears at its first increment has no rate() for that increment. draft_labels: the
        (model, drafter, steps) label sets of the drafted rounds to expect."""
        for labels in draft_labels:
            self._start_drafts_at_zero(labels)
        for reason in ("unavailable", "timeout", "context_lost"):
            self.fallback_rounds.labels(model=model, reason=reason)
        for status in ("length", "stop", "abort", "error"):
            self.requests.labels(model=model, status=status)
        for kind in ("expected", "accepted"):
            self.controller_accepted.labels(model=model, kind=kind)
        for metric in (
            self.draft_length,
            self.speculation_off_rounds,
            self.rounds_ahead,
            self.shadow_probes,
            self.burst_wait,
            self.plain_tokens,
            self.resumed_requests,
        ):
            metric.labels(model=model)

    def record_result(self, res, model: str) -> None:
        """A finished round's counts (flashmap.round_metadata.RoundResult) but the drafter's."""
        decoding = [r for r in res.sequences if not r.prefill and r.error is None]
        for r in decoding:
            self.draft_length.labels(model=model).observe(r.drafted)
        if res.plan.chosen is not None and decoding and not any(res.plan.chosen.values()):
            self.speculation_off_rounds.labels(model=model).inc()
        if decoding and not any(r.drafted for r in decoding):
            self.plain_tokens.labels(model=model).observe(res.plain_tokens)
        if res.ahead is not None:
            self.rounds_ahead.labels(model=model).inc()
        if res.shadows:
            self.shadow_probes.labels(model=model).inc(res.shadows)
        if res.expected_accepted:
            self.controller_accepted.labels(model=model, kind="expected").inc(res.expected_accepted)
            self.controller_accepted.labels(model=model, kind="accepted").inc(res.accepted)
        self.verify_latency.labels(model=model).observe(res.verify_s)
        self.verify_batch_size.labels(model=model).observe(len(res.sequences))

    def _start_drafts_at_zero(self, labels: dict) -> None:
        key = tuple(sorted(labels.items()))
        if key in self._drafts_ready:
            return
        # Every position exists from the first draft on, at 0 until accepted (vLLM does the
        # same): a never-accepted slot reads 0, not "no data", and the first acceptance at a
        # slot is an increase that rate() can see.
        self._drafts_ready.add(key)
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
            metric.labels(**labels)
        self.acceptance_length.labels(**labels)
        for pos in range(1, self.block_size + 1):
            self.num_accepted_tokens_per_pos.labels(**labels, position=str(pos))

    def record_round(self, labels: dict, num_draft: int, num_accepted: int) -> None:
        """One verified draft of num_draft tokens of which the first num_accepted were accepted."""
        if num_draft == 0:
            return
        self._start_drafts_at_zero(labels)
        self.num_drafts.labels(**labels).inc()
        self.num_draft_tokens.labels(**labels).inc(num_draft)
        self.num_accepted_tokens.labels(**labels).inc(num_accepted)
        for pos in range(1, num_accepted + 1):
            self.num_accepted_tokens_per_pos.labels(**labels, position=str(pos)).inc()
        self.acceptance_length.labels(**labels).observe(num_accepted + 1)
