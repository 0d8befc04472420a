"""The metric catalogue: every Prometheus metric FlashMap Serve exports (prefix flashmap_).

This is the contract the dashboard, the alert rules and the tests check against. The
orchestrator and the drafter build their registries from these specs (`build`); the
Triton model registers TARGET_MODEL through Triton's own metric API; Triton's own
nv_inference_* series are listed in TRITON. `exported_series` gives every series name a
scrape can hold, with the labels allowed on it.

Counters follow vLLM's spec-decode shape so existing PromQL carries over:
mean acceptance length = 1 + num_accepted_tokens / num_drafts.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

from flashmap.types import BLOCK_SIZE

# Latency buckets start at 100 microseconds (docs/ARCHITECTURE.md).
LATENCY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
SPEC = ("model", "drafter", "steps")  # labels of the per-round speculation series


@dataclass(frozen=True)
class Metric:
    name: str  # as registered (a counter's samples carry _total)
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms

    def series(self) -> dict[str, set[str]]:
        """Series names a scrape holds for this metric -> label names on them."""
        labels = set(self.labels)
        if self.kind == "counter":
            return {f"{self.name}_total": labels, f"{self.name}_created": labels}
        if self.kind == "histogram":
            return {
                f"{self.name}_bucket": labels | {"le"},
                f"{self.name}_count": labels,
                f"{self.name}_sum": labels,
                f"{self.name}_created": labels,
            }
        return {self.name: labels}


def orchestrator_metrics(block_size: int = BLOCK_SIZE) -> tuple[Metric, ...]:
    """The orchestrator's metrics; the acceptance-length buckets are 1..K+1."""
    M = Metric
    return (
        M("flashmap_num_drafts", "counter", "Speculative rounds that verified a draft", SPEC),
        M("flashmap_num_draft_tokens", "counter", "Draft tokens sent to verification", SPEC),
        M("flashmap_num_accepted_tokens", "counter", "Draft tokens accepted", SPEC),
        M(
            "flashmap_num_accepted_tokens_per_pos",
            "counter",
            "Draft tokens accepted at each slot (1-based)",
            SPEC + ("position",),
        ),
        M(
            "flashmap_acceptance_length",
            "histogram",
            "Tokens committed per speculative round (gamma)",
            SPEC,
            tuple(range(1, block_size + 2)),
        ),
        M(
            "flashmap_draft_length",
            "histogram",
            "Draft tokens verified per request and decode round (0 = a plain "
            "decode step: the speculation controller chose none, or no draft came)",
            ("model",),
            tuple(range(0, block_size + 1)),
        ),
        M(
            "flashmap_speculation_off_rounds",
            "counter",
            "Rounds in which the controller verified no draft for any request (speculation off)",
            ("model",),
        ),
        M(
            "flashmap_plain_tokens",
            "histogram",
            "Tokens per request decoded in one call by a round without drafts "
            "(--plain-tokens; fewer near a request's end, 1 in a round with a new prompt)",
            ("model",),
            (1, 2, 4, 8, 16, 32, 64),
        ),
        M(
            "flashmap_rounds_ahead",
            "counter",
            "Rounds sent to the target before the round they follow had "
            "answered (--pipeline: queued at Triton while the round before runs)",
            ("model",),
        ),
        M(
            "flashmap_controller_accepted_tokens",
            "counter",
            "Draft tokens of the rounds the speculation "
            "controller let draft: the number it expected accepted when it chose (kind=expected) and the number "
            "the verify accepted (kind=accepted); their ratio is the calibration of its acceptance estimates",
            ("model", "kind"),
        ),
        M(
            "flashmap_shadow_probes",
            "counter",
            "Probes of greedy requests drafted beside the rounds while "
            "speculation is off and checked against the text the target commits, nothing verified (--pipeline)",
            ("model",),
        ),
        M(
            "flashmap_burst_wait_seconds",
            "histogram",
            "Starts from idle that waited for the rest of a burst of "
            "requests (to prefill them in one round), by the time waited",
            ("model",),
            LATENCY_BUCKETS,
        ),
        M(
            "flashmap_draft_latency_seconds",
            "histogram",
            "Drafter call latency",
            SPEC,
            LATENCY_BUCKETS,
        ),
        M(
            "flashmap_verify_latency_seconds",
            "histogram",
            "Target verify latency",
            ("model",),
            LATENCY_BUCKETS,
        ),
        M(
            "flashmap_round_latency_seconds",
            "histogram",
            "Whole round latency (draft + verify + commit)",
            SPEC,
            LATENCY_BUCKETS,
        ),
        M(
            "flashmap_time_to_first_token_seconds",
            "histogram",
            "Time to first token",
            ("model",),
            LATENCY_BUCKETS,
        ),
        M(
            "flashmap_inter_token_latency_seconds",
            "histogram",
            "Time between streamed tokens, per token",
            ("model",),
            LATENCY_BUCKETS,
        ),
        M("flashmap_requests", "counter", "Finished requests by status", ("model", "status")),
        M("flashmap_active_requests", "gauge", "Requests holding a KV slot", ("model",)),
        M("flashmap_queued_requests", "gauge", "Requests waiting for a KV slot", ("model",)),
        M(
            "flashmap_drafter_steps",
            "gauge",
            "Current drafter step count (flow-map jumps)",
            ("drafter",),
        ),
        M(
            "flashmap_fallback_rounds",
            "counter",
            "Rounds decoded autoregressively because the drafter was down or late",
            ("model", "reason"),
        ),
        M(
            "flashmap_resumed_requests",
            "counter",
            "Requests continued on a restarted target after it lost them (one per restart)",
            ("model",),
        ),
        M("flashmap_generated_tokens", "counter", "Tokens streamed to clients", ("model",)),
        M("flashmap_prompt_tokens", "counter", "Prompt tokens prefilled", ("model",)),
        M(
            "flashmap_verify_batch_size",
            "histogram",
            "Sequences served by one target verify forward",
            ("model",),
            BATCH_BUCKETS,
        ),
    )


DRAFTER = (
    Metric(
        "flashmap_drafter_forward_latency_seconds",
        "histogram",
        "One batched draft (all flow steps)",
        ("drafter", "steps"),
        LATENCY_BUCKETS,
    ),
    Metric(
        "flashmap_drafter_batch_size",
        "histogram",
        "Sequences drafted by one batched forward",
        ("drafter",),
        BATCH_BUCKETS,
    ),
    Metric(
        "flashmap_drafter_active_sequences",
        "gauge",
        "Sequences whose context the drafter holds",
        ("drafter",),
    ),
    Metric(
        "flashmap_drafter_context_tokens",
        "gauge",
        "Context positions cached over all sequences",
        ("drafter",),
    ),
    Metric("flashmap_drafter_step_count", "gauge", "Current default step count", ("drafter",)),
    Metric("flashmap_drafter_blocks", "counter", "Draft blocks produced", ("drafter", "steps")),
    Metric(
        "flashmap_drafter_released_sequences",
        "counter",
        "Sequences dropped, by reason",
        ("drafter", "reason"),
    ),
)

# Registered by the Triton Python-backend model (target_service/model_repository) through
# pb_utils.MetricFamily, labelled by model. Triton writes every name as given (a counter's
# name carries its own _total).
TARGET_MODEL = (
    Metric("flashmap_target_active_sequences", "gauge", "Sequences holding a KV slot", ("model",)),
    Metric("flashmap_target_slots", "gauge", "KV slots (max concurrent sequences)", ("model",)),
    Metric(
        "flashmap_target_batch_size", "gauge", "Sequences in the last verify forward", ("model",)
    ),
    Metric("flashmap_target_verify_batches_total", "counter", "Verify forward passes", ("model",)),
    Metric(
        "flashmap_target_verify_rows_total",
        "counter",
        "Sequences verified (sum of batch sizes)",
        ("model",),
    ),
    Metric(
        "flashmap_target_idle_released_total",
        "counter",
        "Slots freed by the idle timeout",
        ("model",),
    ),
    # The model is decoupled: Triton's compute time is only the hand-over, these are the work.
    Metric(
        "flashmap_target_batches_total", "counter", "Batches Triton handed to the model", ("model",)
    ),
    Metric(
        "flashmap_target_batch_wait_seconds_total",
        "counter",
        "Seconds batches waited in the model for the one before them",
        ("model",),
    ),
    Metric(
        "flashmap_target_batch_run_seconds_total",
        "counter",
        "Seconds the model spent running batches (verify forwards and their answers)",
        ("model",),
    ),
    Metric(
        "flashmap_target_batch_answer_seconds_total",
        "counter",
        "Of the run, seconds spent handing the answers to Triton",
        ("model",),
    ),
    Metric(
        "flashmap_target_batch_cpu_seconds_total",
        "counter",
        "Of the run, seconds the model's worker thread was on a CPU (the rest it waited: for the GIL, "
        "for Triton to take an answer, or for its CPU)",
        ("model",),
    ),
)

# Triton's own per-model metrics (port 8002), from prometheus-cpp: counters carry no _total
# suffix. Failures also carry a reason in recent releases.
TRITON: dict[str, set[str]] = {
    "nv_inference_request_success": {"model", "version"},
    "nv_inference_request_failure": {"model", "version", "reason"},
    "nv_inference_count": {"model", "version"},
    "nv_inference_exec_count": {"model", "version"},
    "nv_inference_request_duration_us": {"model", "version"},
    "nv_inference_queue_duration_us": {"model", "version"},
    "nv_inference_compute_infer_duration_us": {"model", "version"},
}

# Series Prometheus itself attaches to every scrape (alert rules use `up`).
PROMETHEUS_SYNTHETIC = (
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
)
TARGET_LABELS = {"job", "instance"}  # labels Prometheus adds to every scraped series


def build(specs, registry) -> dict:
    """prometheus_client metrics for `specs` in `registry`: name -> metric."""
    from prometheus_client import Counter, Gauge, Histogram

    out = {}
    for m in specs:
        if m.kind == "counter":
            out[m.name] = Counter(m.name, m.help, m.labels, registry=registry)
        elif m.kind == "gauge":
            out[m.name] = Gauge(m.name, m.help, m.labels, registry=registry)
        else:
            out[m.name] = Histogram(m.name, m.help, m.labels, buckets=m.buckets, registry=registry)
    return out


def exported_series() -> dict[str, set[str]]:
    """Every series a dashboard or rule may reference: {series name: allowed label names}."""
    out: dict[str, set[str]] = {}
    for m in orchestrator_metrics() + DRAFTER:
        for name, labels in m.series().items():
            out[name] = labels | TARGET_LABELS
    for m in TARGET_MODEL:
        out[m.name] = set(m.labels) | TARGET_LABELS
    for name, labels in TRITON.items():
        out[name] = labels | TARGET_LABELS
    for name in PROMETHEUS_SYNTHETIC:
        out[name] = set(TARGET_LABELS)
    return out


# ----------------------------------------------------------------------------- reading a scrape

_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s+(\S+)")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format -> samples (series name, labels, value).

    Names exactly as written, which is what Prometheus stores. (prometheus_client's parser
    appends _total to every counter sample, so Triton's unsuffixed nv_inference_count would
    come back as nv_inference_count_total, a series no Prometheus ever has.)"""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_LINE.match(line)
        if not m:
            raise ValueError(f"unparseable exposition line: {line!r}")
        out.append((m.group(1), dict(_LABEL_PAIR.findall(m.group(2) or "")), float(m.group(3))))
    return out


def scrape(url: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """GET a /metrics endpoint: its samples (`parse_exposition`)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_exposition(r.read().decode())


def series_labels(samples) -> dict[str, set[str]]:
    """{series name: label names seen on it} of scraped samples."""
    out: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        out.setdefault(name, set()).update(labels)
    return out


def totals(samples) -> dict[str, float]:
    """{series name: sum of its values over all label sets} of scraped samples."""
    out: dict[str, float] = {}
    for name, _, value in samples:
        out[name] = out.get(name, 0.0) + value
    return out
