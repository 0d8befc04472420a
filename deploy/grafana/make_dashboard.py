"""Generates deploy/grafana/dashboards/flashmap.json (the FlashMap Serve dashboard; one module:
the dashboard's panels, one after the other).

The dashboard is code so that its PromQL is reviewable in one place and the tests can check it;
edit here, then run

    .venv/bin/python deploy/grafana/make_dashboard.py

tests/test_deploy_static.py fails when the committed JSON differs from this script's output.
Every expression may only use metric names the services export (see tests/prometheus_harness.py).

One idea: the dashboard's panels, one after the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "flashmap.json"

# The provisioned datasource (deploy/grafana/provisioning/datasources/prometheus.yml).
DATASOURCE_UID = "flashmap-prometheus"
DS = {"type": "prometheus", "uid": "${datasource}"}

# Filters shared by the orchestrator's spec-decode series (labels model, drafter, steps).
SPEC = 'model=~"$model", drafter=~"$drafter", steps=~"$steps"'
MODEL = 'model=~"$model"'
DRAFTER = 'drafter=~"$drafter"'
TRITON = 'model=~"$triton_model"'
RI = "$__rate_interval"


def rate(metric: str, sel: str, by: str = "") -> str:
    """sum [by (...)] (rate(metric{sel}[$__rate_interval]))"""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{sel}}}[{RI}]))"


def quantile(q: float, hist: str, sel: str, by: str = "") -> str:
    grouping = ", ".join(["le"] + ([by] if by else []))
    return f"histogram_quantile({q}, sum by ({grouping}) (rate({hist}_bucket{{{sel}}}[{RI}])))"


# Mean acceptance length (gamma): 1 + accepted / drafts (vLLM's spec-decode counters).
def mean_gamma(by: str = "") -> str:
    return f"1 + {rate('flashmap_num_accepted_tokens_total', SPEC, by)} / {rate('flashmap_num_drafts_total', SPEC, by)}"


# Rounds decoded autoregressively / all rounds (speculative + fallback).
FALLBACK_FRACTION = (
    f"{rate('flashmap_fallback_rounds_total', MODEL)} / "
    f"({rate('flashmap_fallback_rounds_total', MODEL)} + {rate('flashmap_num_drafts_total', MODEL)})"
)


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += self.row_h
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self._id(),
                "collapsed": False,
                "panels": [],
                "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1},
            }
        )
        self.y += 1
        self.x = self.row_h = 0

    def add(self, panel: dict, w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self.y += self.row_h
            self.x = self.row_h = 0
        panel["id"] = self._id()
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(expr: str, legend: str, ref: str, **extra) -> dict:
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
        "range": True,
        **extra,
    }


def timeseries(
    title: str,
    desc: str,
    targets: list[dict],
    unit: str = "short",
    min_=None,
    max_=None,
    stack=False,
) -> dict:
    defaults = {
        "unit": unit,
        "custom": {
            "lineWidth": 1,
            "fillOpacity": 10 if stack else 0,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
    }


def quantile_panel(title: str, desc: str, hist: str, sel: str, by: str = "") -> dict:
    suffix = f" {{{{{by}}}}}" if by else ""
    return timeseries(
        title,
        desc,
        [
            target(quantile(q, hist, sel, by), f"p{int(q * 100)}{suffix}", "")
            for q in (0.5, 0.9, 0.99)
        ],
        unit="s",
        min_=0,
    )


def stat(
    title: str, desc: str, expr: str, unit: str = "short", decimals: int = 2, thresholds=None
) -> dict:
    steps = thresholds or [{"color": "green", "value": None}]
    return {
        "type": "stat",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "decimals": decimals,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        },
        "targets": [target(expr, title, "A", instant=False)],
    }


def build() -> dict:
    L = Layout()

    # ---- Speculative decoding ------------------------------------------------------------
    L.row("Speculative decoding")
    L.add(
        stat(
            "Mean acceptance length",
            "Tokens committed per speculative round (gamma) over the selected drafts: "
            "1 + accepted / drafts. Block size 16 allows up to 17.",
            mean_gamma(),
            thresholds=[
                {"color": "red", "value": None},
                {"color": "orange", "value": 2},
                {"color": "green", "value": 3},
            ],
        ),
        w=4,
        h=8,
    )
    L.add(
        stat(
            "Draft tokens accepted",
            "Accepted draft tokens / draft tokens sent to verification.",
            f"{rate('flashmap_num_accepted_tokens_total', SPEC)} / {rate('flashmap_num_draft_tokens_total', SPEC)}",
            unit="percentunit",
            decimals=1,
        ),
        w=4,
        h=8,
    )
    L.add(
        timeseries(
            "Mean acceptance length over time",
            "1 + rate(accepted tokens) / rate(drafts), per drafter step count. A drop at constant "
            "traffic means the drafter and target disagree (wrong checkpoint, changed sampling).",
            [target(mean_gamma(), "all", ""), target(mean_gamma("steps"), "steps={{steps}}", "")],
            min_=1,
        ),
        w=16,
        h=8,
    )
    L.add(
        {
            "type": "heatmap",
            "title": "Acceptance length distribution",
            "description": "Histogram of tokens committed per round (buckets 1..17), as rounds per interval.",
            "datasource": DS,
            "fieldConfig": {
                "defaults": {"custom": {"scaleDistribution": {"type": "linear"}}},
                "overrides": [],
            },
            "options": {
                "calculate": False,
                "cellGap": 1,
                "yAxis": {"axisPlacement": "left", "unit": "short"},
                "color": {
                    "mode": "scheme",
                    "scheme": "Oranges",
                    "scale": "exponential",
                    "exponent": 0.5,
                },
                "rowsFrame": {"layout": "le"},
                "tooltip": {"mode": "single", "yHistogram": True},
                "legend": {"show": True},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
            },
            "targets": [
                target(
                    f"sum by (le) (increase(flashmap_acceptance_length_bucket{{{SPEC}}}[{RI}]))",
                    "{{le}}",
                    "A",
                    format="heatmap",
                )
            ],
        },
        w=12,
        h=9,
    )
    L.add(
        {
            "type": "barchart",
            "title": "Acceptance per slot",
            "description": "Fraction of drafts whose slot k was accepted (slot k is only reachable when slots "
            "1..k-1 were). Sums to mean acceptance length - 1.",
            "datasource": DS,
            "fieldConfig": {
                "defaults": {"unit": "percentunit", "min": 0, "max": 1},
                "overrides": [],
            },
            "options": {
                "orientation": "vertical",
                "xField": "position",
                "showValue": "auto",
                "legend": {"showLegend": False, "displayMode": "list", "placement": "bottom"},
                "tooltip": {"mode": "single"},
            },
            "targets": [
                target(
                    f"{rate('flashmap_num_accepted_tokens_per_pos_total', SPEC, 'position')} "
                    f"/ ignoring(position) group_left {rate('flashmap_num_drafts_total', SPEC)}",
                    "{{position}}",
                    "A",
                    format="table",
                    instant=True,
                    range=False,
                )
            ],
            "transformations": [
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True},
                        "renameByName": {"Value": "acceptance"},
                    },
                },
                {
                    "id": "convertFieldType",
                    "options": {
                        "conversions": [{"targetField": "position", "destinationType": "number"}]
                    },
                },
                {"id": "sortBy", "options": {"sort": [{"field": "position"}]}},
                {
                    "id": "convertFieldType",
                    "options": {
                        "conversions": [{"targetField": "position", "destinationType": "string"}]
                    },
                },
            ],
        },
        w=12,
        h=9,
    )

    L.add(
        timeseries(
            "Speculation control",
            "What the goodput controller chose: the mean draft length it "
            "verified per request and round (0 = a plain decode step), the share of rounds in "
            "which it verified no draft at all (speculation off: drafting does not pay at this load), "
            "the tokens per request such rounds decoded in one call (--plain-tokens), and the "
            "share of rounds queued at the target before the round they follow had answered "
            "(--pipeline), the probes drafted beside the rounds per round (checked against the "
            "committed text, never verified), and the draft tokens the verify accepted over those the "
            "controller expected when it let them draft (1 = its acceptance estimates are calibrated; "
            "below 1 it drafts where it should not).",
            [
                target(
                    f"{rate('flashmap_draft_length_sum', MODEL)} / {rate('flashmap_draft_length_count', MODEL)}",
                    "mean draft length",
                    "",
                ),
                target(
                    f"{rate('flashmap_speculation_off_rounds_total', MODEL)} / "
                    f"{rate('flashmap_round_latency_seconds_count', SPEC)}",
                    "rounds with speculation off",
                    "",
                ),
                target(
                    f"{rate('flashmap_plain_tokens_sum', MODEL)} / {rate('flashmap_plain_tokens_count', MODEL)}",
                    "tokens per call without drafts",
                    "",
                ),
                target(
                    f"{rate('flashmap_rounds_ahead_total', MODEL)} / "
                    f"{rate('flashmap_round_latency_seconds_count', SPEC)}",
                    "rounds sent ahead",
                    "",
                ),
                target(
                    f"{rate('flashmap_shadow_probes_total', MODEL)} / "
                    f"{rate('flashmap_round_latency_seconds_count', SPEC)}",
                    "shadow probes",
                    "",
                ),
                target(
                    rate("flashmap_controller_accepted_tokens_total", MODEL + ', kind="accepted"')
                    + " / "
                    + rate(
                        "flashmap_controller_accepted_tokens_total", MODEL + ', kind="expected"'
                    ),
                    "accepted / expected",
                    "",
                ),
            ],
            min_=0,
        ),
        w=24,
        h=8,
    )

    # ---- Throughput and latency ----------------------------------------------------------
    L.row("Throughput and latency")
    L.add(
        timeseries(
            "Tokens/s",
            "Generated tokens streamed to clients and prompt tokens prefilled.",
            [
                target(rate("flashmap_generated_tokens_total", MODEL), "generated", ""),
                target(rate("flashmap_prompt_tokens_total", MODEL), "prompt", ""),
                target(
                    rate("flashmap_generated_tokens_total", MODEL, "instance"),
                    "generated {{instance}}",
                    "",
                ),
            ],
            unit="short",
            min_=0,
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Time to first token",
            "From request arrival to the first streamed token.",
            "flashmap_time_to_first_token_seconds",
            MODEL,
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Inter-token latency",
            "Time between streamed tokens, per token (a round of gamma "
            "tokens counts gamma samples).",
            "flashmap_inter_token_latency_seconds",
            MODEL,
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Draft latency",
            "Orchestrator-side drafter call, per round.",
            "flashmap_draft_latency_seconds",
            SPEC,
            by="steps",
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Verify latency",
            "Target verify call (Triton), per round.",
            "flashmap_verify_latency_seconds",
            MODEL,
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Round latency",
            "Whole round: draft + verify + rejection sampling + commit.",
            "flashmap_round_latency_seconds",
            SPEC,
            by="steps",
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Drafter forward latency",
            "One batched draft inside the drafter (all flow steps).",
            "flashmap_drafter_forward_latency_seconds",
            f'{DRAFTER}, steps=~"$steps"',
            by="steps",
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Batch sizes",
            "Mean sequences per target verify forward and per drafter forward.",
            [
                target(
                    f"{rate('flashmap_verify_batch_size_sum', MODEL)}"
                    f" / {rate('flashmap_verify_batch_size_count', MODEL)}",
                    "verify",
                    "",
                ),
                target(
                    f"{rate('flashmap_drafter_batch_size_sum', DRAFTER)}"
                    f" / {rate('flashmap_drafter_batch_size_count', DRAFTER)}",
                    "drafter",
                    "",
                ),
            ],
            min_=0,
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Requests/s by status",
            "Finished requests per second, by final status.",
            [
                target(rate("flashmap_requests_total", MODEL, "status"), "{{status}}", ""),
            ],
            unit="reqps",
            min_=0,
            stack=True,
        ),
        w=8,
    )
    L.add(
        quantile_panel(
            "Burst admission wait",
            "Waking from idle into requests sent together, the scheduler "
            "waits for the rest of them (--burst-window-ms) so they prefill in one round.",
            "flashmap_burst_wait_seconds",
            MODEL,
        ),
        w=8,
    )

    # ---- Load and drafter ----------------------------------------------------------------
    L.row("Load and drafter")
    L.add(
        timeseries(
            "Active requests",
            "Requests holding a KV slot, requests waiting for one, sequences the "
            "drafter holds context for, sequences the target holds KV cache for, and its KV slots.",
            [
                target(f"sum(flashmap_active_requests{{{MODEL}}})", "active", ""),
                target(f"sum(flashmap_queued_requests{{{MODEL}}})", "queued", ""),
                target(
                    f"sum(flashmap_drafter_active_sequences{{{DRAFTER}}})", "drafter sequences", ""
                ),
                target("sum(flashmap_target_active_sequences)", "target sequences", ""),
                target("sum(flashmap_target_slots)", "target KV slots", ""),
            ],
            min_=0,
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Drafter step count",
            "Flow-map jumps per draft: the drafter's default and the value "
            "the orchestrator uses. Switch at run time with the drafter's SetSteps RPC.",
            [
                target(
                    f"max by (drafter) (flashmap_drafter_step_count{{{DRAFTER}}})",
                    "drafter default {{drafter}}",
                    "",
                ),
                target(
                    f"max by (drafter) (flashmap_drafter_steps{{{DRAFTER}}})",
                    "orchestrator {{drafter}}",
                    "",
                ),
            ],
            min_=0,
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Fallback rate",
            "Fraction of rounds decoded autoregressively because the drafter was "
            "down or late (output stays exact, only slower).",
            [
                target(FALLBACK_FRACTION, "fallback fraction", ""),
                target(
                    rate("flashmap_fallback_rounds_total", MODEL, "reason"),
                    "{{reason}} rounds/s",
                    "",
                ),
            ],
            unit="percentunit",
            min_=0,
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Drafter blocks/s and releases",
            "Draft blocks produced per step count; sequences "
            "dropped by reason (release, idle timeout).",
            [
                target(
                    rate("flashmap_drafter_blocks_total", DRAFTER, "steps"),
                    "blocks steps={{steps}}",
                    "",
                ),
                target(
                    rate("flashmap_drafter_released_sequences_total", DRAFTER, "reason"),
                    "released {{reason}}",
                    "",
                ),
            ],
            min_=0,
        ),
        w=12,
    )
    L.add(
        timeseries(
            "Drafter cached context",
            "Context positions whose projected K/V the drafter holds.",
            [
                target(
                    f"sum by (drafter) (flashmap_drafter_context_tokens{{{DRAFTER}}})",
                    "{{drafter}}",
                    "",
                ),
            ],
            min_=0,
        ),
        w=12,
    )

    # ---- Triton --------------------------------------------------------------------------
    L.row("Triton (target model)")
    L.add(
        timeseries(
            "Triton requests/s",
            "nv_inference_request_success / _failure for the target model.",
            [
                target(
                    f"sum by (model) (rate(nv_inference_request_success{{{TRITON}}}[{RI}]))",
                    "success {{model}}",
                    "",
                ),
                target(
                    f"sum by (model) (rate(nv_inference_request_failure{{{TRITON}}}[{RI}]))",
                    "failure {{model}}",
                    "",
                ),
            ],
            unit="reqps",
            min_=0,
        ),
        w=8,
    )
    # Triton's durations are cumulative microsecond counters: per-request mean = d(us) / d(requests) / 1e6.
    L.add(
        timeseries(
            "Triton mean latency",
            "Cumulative microseconds / successful requests: end to end, "
            "queued, and model execute; per batch the model ran, its wait, its run and, of the run, "
            "the answers handed to Triton and the time its worker was on a CPU (the rest it waited: "
            "for Python's lock, for Triton, for its CPU).",
            [
                target(
                    f"sum(rate(nv_inference_{kind}_duration_us{{{TRITON}}}[{RI}])) "
                    f"/ sum(rate(nv_inference_request_success{{{TRITON}}}[{RI}])) / 1e6",
                    label,
                    "",
                )
                for kind, label in (
                    ("request", "request"),
                    ("queue", "queue"),
                    ("compute_infer", "compute"),
                )
            ]
            + [  # the model is decoupled: Triton's compute is the hand-over, the model's own counters time the work
                target(
                    f"sum(rate(flashmap_target_batch_{kind}_seconds_total[{RI}])) "
                    f"/ sum(rate(flashmap_target_batches_total[{RI}]))",
                    label,
                    "",
                )
                for kind, label in (
                    ("wait", "model wait"),
                    ("run", "model run"),
                    ("answer", "model answers (of run)"),
                    ("cpu", "model on CPU (of run)"),
                )
            ],
            unit="s",
            min_=0,
        ),
        w=8,
    )
    L.add(
        timeseries(
            "Triton executions",
            "Model executions per second, inferences per execution (how "
            "well Triton batches verify requests) and sequences per verify forward in the model.",
            [
                target(f"sum(rate(nv_inference_exec_count{{{TRITON}}}[{RI}]))", "executions/s", ""),
                target(
                    f"sum(rate(nv_inference_count{{{TRITON}}}[{RI}]))"
                    f" / sum(rate(nv_inference_exec_count{{{TRITON}}}[{RI}]))",
                    "inferences per execution",
                    "",
                ),
                # The model's own count: sequences per verify forward inside model.py.
                target(
                    f"sum(rate(flashmap_target_verify_rows_total[{RI}]))"
                    f" / sum(rate(flashmap_target_verify_batches_total[{RI}]))",
                    "sequences per verify forward",
                    "",
                ),
            ],
            min_=0,
        ),
        w=8,
    )

    def var(name: str, label: str, query: str, all_=True, default=".*") -> dict:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "definition": query,
            "refresh": 2,
            "sort": 1,
            "multi": True,
            "includeAll": all_,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}
            if all_
            else {"selected": True, "text": default, "value": default},
            "options": [],
            "hide": 0,
        }

    templating = [
        {
            "name": "datasource",
            "label": "Datasource",
            "type": "datasource",
            "query": "prometheus",
            "current": {"selected": True, "text": "Prometheus", "value": DATASOURCE_UID},
            "hide": 0,
            "options": [],
            "refresh": 1,
            "regex": "",
        },
        var("model", "Model", "label_values(flashmap_num_drafts_total, model)"),
        var("drafter", "Drafter", "label_values(flashmap_num_drafts_total, drafter)"),
        var("steps", "Steps", "label_values(flashmap_num_drafts_total, steps)"),
        var("triton_model", "Triton model", "label_values(nv_inference_request_success, model)"),
    ]

    return {
        "__inputs": [],
        "uid": "flashmap-serve",
        "title": "FlashMap Serve",
        "description": "Speculative decoding with a flow-map drafter: acceptance, latency, load, Triton.",
        "tags": ["flashmap", "speculative-decoding", "triton"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": templating},
        "panels": L.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
