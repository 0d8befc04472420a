"""Generates deploy/grafana/dashboards/flashmap.json, the FlashMap Serve dashboard, with
Grafana's typed SDK for dashboards as code (grafana-foundation-sdk, pinned in the dev extra to
the build for the Grafana of the compose file, 11.3).

The dashboard is code so that its PromQL is reviewable in one place and the tests can check it;
edit here, then run

    .venv/bin/python deploy/grafana/make_dashboard.py

tests/test_deploy_static.py fails when the committed JSON differs from this script's output.
Every expression may only use metric names the services export (see tests/prometheus_harness.py);
tests/test_observability_live.py evaluates each one on a live Prometheus scraping the stack.

Every panel, query, variable and annotation is an SDK builder. Transformations are the SDK's
DataTransformerConfig, whose options the SDK leaves untyped (they depend on the transformer), so
the bar chart's are plain dicts. The SDK places panels left to right in rows of 24 columns.

One idea: the dashboard's panels, one after the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import barchart, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

OUT = Path(__file__).resolve().parent / "dashboards" / "flashmap.json"

# The provisioned datasource (deploy/grafana/provisioning/datasources/prometheus.yml).
DATASOURCE_UID = "flashmap-prometheus"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

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


def query(
    expr: str, legend: str, fmt: pm.PromQueryFormat | None = None, instant: bool = False
) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DS)
    q = q.instant() if instant else q.range()
    return q.format(fmt) if fmt else q


def with_queries(panel, queries: list[prometheus.Dataquery]):
    """The panel with its queries, refIds A, B, ... in order."""
    for i, q in enumerate(queries):
        panel.with_target(q.ref_id(chr(ord("A") + i)))
    return panel


def timeseries_panel(
    title: str,
    desc: str,
    queries: list[prometheus.Dataquery],
    unit: str = "short",
    min_=None,
    max_=None,
    stack=False,
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .line_width(1)
        .fill_opacity(10 if stack else 0)
        .stacking(
            cb.StackingConfig()
            .mode(common.StackingMode.NORMAL if stack else common.StackingMode.NONE)
            .group("A")
        )
        .legend(
            cb.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE)
        )
    )
    if min_ is not None:
        p.min(min_)
    if max_ is not None:
        p.max(max_)
    return with_queries(p, queries)


def quantile_panel(title: str, desc: str, hist: str, sel: str, by: str = "") -> timeseries.Panel:
    suffix = f" {{{{{by}}}}}" if by else ""
    return timeseries_panel(
        title,
        desc,
        [query(quantile(q, hist, sel, by), f"p{int(q * 100)}{suffix}") for q in (0.5, 0.9, 0.99)],
        unit="s",
        min_=0,
    )


def stat_panel(
    title: str, desc: str, expr: str, unit: str = "short", decimals: int = 2, thresholds=None
) -> stat.Panel:
    steps = thresholds or [dm.Threshold(color="green")]
    p = (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .decimals(decimals)
        .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps))
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.AREA)
        .text_mode(common.BigValueTextMode.AUTO)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .orientation(common.VizOrientation.AUTO)
    )
    return with_queries(p, [query(expr, title)])


def acceptance_heatmap() -> heatmap.Panel:
    p = (
        heatmap.Panel()
        .title("Acceptance length distribution")
        .description(
            "Histogram of tokens committed per round (buckets 1..17), as rounds per interval."
        )
        .datasource(DS)
        .scale_distribution(cb.ScaleDistributionConfig().type(common.ScaleDistribution.LINEAR))
        .calculate(False)
        .cell_gap(1)
        .y_axis(heatmap.YAxisConfig().axis_placement(common.AxisPlacement.LEFT).unit("short"))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(hm.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .scale(hm.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
        )
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .mode(common.TooltipDisplayMode.SINGLE)
        .show_y_histogram()
        .show_legend()
        .exemplars_color("rgba(255,0,255,0.7)")
    )
    expr = f"sum by (le) (increase(flashmap_acceptance_length_bucket{{{SPEC}}}[{RI}]))"
    return with_queries(p, [query(expr, "{{le}}", fmt=pm.PromQueryFormat.HEATMAP)])


def acceptance_per_slot() -> barchart.Panel:
    # An instant table of acceptance by position, sorted as numbers and drawn as categories.
    as_type = lambda t: dm.DataTransformerConfig(
        id_val="convertFieldType",
        options={"conversions": [{"targetField": "position", "destinationType": t}]},
    )
    p = (
        barchart.Panel()
        .title("Acceptance per slot")
        .description(
            "Fraction of drafts whose slot k was accepted (slot k is only reachable when slots "
            "1..k-1 were). Sums to mean acceptance length - 1."
        )
        .datasource(DS)
        .unit("percentunit")
        .min(0)
        .max(1)
        .orientation(common.VizOrientation.VERTICAL)
        .x_field("position")
        .show_value(common.VisibilityMode.AUTO)
        .legend(
            cb.VizLegendOptions()
            .show_legend(False)
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
        )
        .tooltip(
            cb.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.SINGLE)
            .sort(common.SortOrder.NONE)
        )
        .transformations(
            [
                dm.DataTransformerConfig(
                    id_val="organize",
                    options={
                        "excludeByName": {"Time": True},
                        "renameByName": {"Value": "acceptance"},
                    },
                ),
                as_type("number"),
                dm.DataTransformerConfig(
                    id_val="sortBy", options={"sort": [{"field": "position"}]}
                ),
                as_type("string"),
            ]
        )
    )
    expr = (
        f"{rate('flashmap_num_accepted_tokens_per_pos_total', SPEC, 'position')} "
        f"/ ignoring(position) group_left {rate('flashmap_num_drafts_total', SPEC)}"
    )
    return with_queries(
        p, [query(expr, "{{position}}", fmt=pm.PromQueryFormat.TABLE, instant=True)]
    )


def speculative_decoding() -> list:
    return [
        (
            stat_panel(
                "Mean acceptance length",
                "Tokens committed per speculative round (gamma) over the selected drafts: "
                "1 + accepted / drafts. Block size 16 allows up to 17.",
                mean_gamma(),
                thresholds=[
                    dm.Threshold(color="red"),
                    dm.Threshold(value=2, color="orange"),
                    dm.Threshold(value=3, color="green"),
                ],
            ),
            4,
            8,
        ),
        (
            stat_panel(
                "Draft tokens accepted",
                "Accepted draft tokens / draft tokens sent to verification.",
                f"{rate('flashmap_num_accepted_tokens_total', SPEC)} / {rate('flashmap_num_draft_tokens_total', SPEC)}",
                unit="percentunit",
                decimals=1,
            ),
            4,
            8,
        ),
        (
            timeseries_panel(
                "Mean acceptance length over time",
                "1 + rate(accepted tokens) / rate(drafts), per drafter step count. A drop at "
                "constant traffic means the drafter and target disagree (wrong checkpoint, "
                "changed sampling).",
                [query(mean_gamma(), "all"), query(mean_gamma("steps"), "steps={{steps}}")],
                min_=1,
            ),
            16,
            8,
        ),
        (acceptance_heatmap(), 12, 9),
        (acceptance_per_slot(), 12, 9),
        (
            timeseries_panel(
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
                    query(
                        f"{rate('flashmap_draft_length_sum', MODEL)} / {rate('flashmap_draft_length_count', MODEL)}",
                        "mean draft length",
                    ),
                    query(
                        f"{rate('flashmap_speculation_off_rounds_total', MODEL)} / "
                        f"{rate('flashmap_round_latency_seconds_count', SPEC)}",
                        "rounds with speculation off",
                    ),
                    query(
                        f"{rate('flashmap_plain_tokens_sum', MODEL)} / {rate('flashmap_plain_tokens_count', MODEL)}",
                        "tokens per call without drafts",
                    ),
                    query(
                        f"{rate('flashmap_rounds_ahead_total', MODEL)} / "
                        f"{rate('flashmap_round_latency_seconds_count', SPEC)}",
                        "rounds sent ahead",
                    ),
                    query(
                        f"{rate('flashmap_shadow_probes_total', MODEL)} / "
                        f"{rate('flashmap_round_latency_seconds_count', SPEC)}",
                        "shadow probes",
                    ),
                    query(
                        rate(
                            "flashmap_controller_accepted_tokens_total", MODEL + ', kind="accepted"'
                        )
                        + " / "
                        + rate(
                            "flashmap_controller_accepted_tokens_total", MODEL + ', kind="expected"'
                        ),
                        "accepted / expected",
                    ),
                ],
                min_=0,
            ),
            24,
            8,
        ),
    ]


def throughput_and_latency() -> list:
    return [
        (
            timeseries_panel(
                "Tokens/s",
                "Generated tokens streamed to clients and prompt tokens prefilled.",
                [
                    query(rate("flashmap_generated_tokens_total", MODEL), "generated"),
                    query(rate("flashmap_prompt_tokens_total", MODEL), "prompt"),
                    query(
                        rate("flashmap_generated_tokens_total", MODEL, "instance"),
                        "generated {{instance}}",
                    ),
                ],
                min_=0,
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Time to first token",
                "From request arrival to the first streamed token.",
                "flashmap_time_to_first_token_seconds",
                MODEL,
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Inter-token latency",
                "Time between streamed tokens, per token (a round of gamma "
                "tokens counts gamma samples).",
                "flashmap_inter_token_latency_seconds",
                MODEL,
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Draft latency",
                "Orchestrator-side drafter call, per round.",
                "flashmap_draft_latency_seconds",
                SPEC,
                by="steps",
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Verify latency",
                "Target verify call (Triton), per round.",
                "flashmap_verify_latency_seconds",
                MODEL,
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Round latency",
                "Whole round: draft + verify + rejection sampling + commit.",
                "flashmap_round_latency_seconds",
                SPEC,
                by="steps",
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Drafter forward latency",
                "One batched draft inside the drafter (all flow steps).",
                "flashmap_drafter_forward_latency_seconds",
                f'{DRAFTER}, steps=~"$steps"',
                by="steps",
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Batch sizes",
                "Mean sequences per target verify forward and per drafter forward.",
                [
                    query(
                        f"{rate('flashmap_verify_batch_size_sum', MODEL)}"
                        f" / {rate('flashmap_verify_batch_size_count', MODEL)}",
                        "verify",
                    ),
                    query(
                        f"{rate('flashmap_drafter_batch_size_sum', DRAFTER)}"
                        f" / {rate('flashmap_drafter_batch_size_count', DRAFTER)}",
                        "drafter",
                    ),
                ],
                min_=0,
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Requests/s by status",
                "Finished requests per second, by final status.",
                [query(rate("flashmap_requests_total", MODEL, "status"), "{{status}}")],
                unit="reqps",
                min_=0,
                stack=True,
            ),
            8,
            8,
        ),
        (
            quantile_panel(
                "Burst admission wait",
                "Waking from idle into requests sent together, the scheduler "
                "waits for the rest of them (--burst-window-ms) so they prefill in one round.",
                "flashmap_burst_wait_seconds",
                MODEL,
            ),
            8,
            8,
        ),
    ]


def load_and_drafter() -> list:
    return [
        (
            timeseries_panel(
                "Active requests",
                "Requests holding a KV slot, requests waiting for one, sequences the drafter "
                "holds context for, sequences the target holds KV cache for, and its KV slots.",
                [
                    query(f"sum(flashmap_active_requests{{{MODEL}}})", "active"),
                    query(f"sum(flashmap_queued_requests{{{MODEL}}})", "queued"),
                    query(
                        f"sum(flashmap_drafter_active_sequences{{{DRAFTER}}})", "drafter sequences"
                    ),
                    query("sum(flashmap_target_active_sequences)", "target sequences"),
                    query("sum(flashmap_target_slots)", "target KV slots"),
                ],
                min_=0,
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Drafter step count",
                "Flow-map jumps per draft: the drafter's default and the value "
                "the orchestrator uses. Switch at run time with the drafter's SetSteps RPC.",
                [
                    query(
                        f"max by (drafter) (flashmap_drafter_step_count{{{DRAFTER}}})",
                        "drafter default {{drafter}}",
                    ),
                    query(
                        f"max by (drafter) (flashmap_drafter_steps{{{DRAFTER}}})",
                        "orchestrator {{drafter}}",
                    ),
                ],
                min_=0,
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Fallback rate",
                "Fraction of rounds decoded autoregressively because the drafter was "
                "down or late (output stays exact, only slower).",
                [
                    query(FALLBACK_FRACTION, "fallback fraction"),
                    query(
                        rate("flashmap_fallback_rounds_total", MODEL, "reason"),
                        "{{reason}} rounds/s",
                    ),
                ],
                unit="percentunit",
                min_=0,
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Drafter blocks/s and releases",
                "Draft blocks produced per step count; sequences "
                "dropped by reason (release, idle timeout).",
                [
                    query(
                        rate("flashmap_drafter_blocks_total", DRAFTER, "steps"),
                        "blocks steps={{steps}}",
                    ),
                    query(
                        rate("flashmap_drafter_released_sequences_total", DRAFTER, "reason"),
                        "released {{reason}}",
                    ),
                ],
                min_=0,
            ),
            12,
            8,
        ),
        (
            timeseries_panel(
                "Drafter cached context",
                "Context positions whose projected K/V the drafter holds.",
                [
                    query(
                        f"sum by (drafter) (flashmap_drafter_context_tokens{{{DRAFTER}}})",
                        "{{drafter}}",
                    )
                ],
                min_=0,
            ),
            12,
            8,
        ),
    ]


def triton() -> list:
    ok = f"sum(rate(nv_inference_request_success{{{TRITON}}}[{RI}]))"
    # Triton's durations are cumulative microsecond counters: per-request mean = d(us) / d(requests) / 1e6.
    triton_means = [
        query(f"sum(rate(nv_inference_{kind}_duration_us{{{TRITON}}}[{RI}])) / {ok} / 1e6", label)
        for kind, label in (
            ("request", "request"),
            ("queue", "queue"),
            ("compute_infer", "compute"),
        )
    ]
    # The model is decoupled: Triton's compute is the hand-over, the model's own counters time the work.
    model_means = [
        query(
            f"sum(rate(flashmap_target_batch_{kind}_seconds_total[{RI}])) "
            f"/ sum(rate(flashmap_target_batches_total[{RI}]))",
            label,
        )
        for kind, label in (
            ("wait", "model wait"),
            ("run", "model run"),
            ("answer", "model answers (of run)"),
            ("cpu", "model on CPU (of run)"),
        )
    ]
    return [
        (
            timeseries_panel(
                "Triton requests/s",
                "nv_inference_request_success / _failure for the target model.",
                [
                    query(
                        f"sum by (model) (rate(nv_inference_request_success{{{TRITON}}}[{RI}]))",
                        "success {{model}}",
                    ),
                    query(
                        f"sum by (model) (rate(nv_inference_request_failure{{{TRITON}}}[{RI}]))",
                        "failure {{model}}",
                    ),
                ],
                unit="reqps",
                min_=0,
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Triton mean latency",
                "Cumulative microseconds / successful requests: end to end, "
                "queued, and model execute; per batch the model ran, its wait, its run and, of the "
                "run, the answers handed to Triton and the time its worker was on a CPU (the rest "
                "it waited: for Python's lock, for Triton, for its CPU).",
                triton_means + model_means,
                unit="s",
                min_=0,
            ),
            8,
            8,
        ),
        (
            timeseries_panel(
                "Triton executions",
                "Model executions per second, inferences per execution (how "
                "well Triton batches verify requests) and sequences per verify forward in the model.",
                [
                    query(f"sum(rate(nv_inference_exec_count{{{TRITON}}}[{RI}]))", "executions/s"),
                    query(
                        f"sum(rate(nv_inference_count{{{TRITON}}}[{RI}]))"
                        f" / sum(rate(nv_inference_exec_count{{{TRITON}}}[{RI}]))",
                        "inferences per execution",
                    ),
                    # The model's own count: sequences per verify forward inside model.py.
                    query(
                        f"sum(rate(flashmap_target_verify_rows_total[{RI}]))"
                        f" / sum(rate(flashmap_target_verify_batches_total[{RI}]))",
                        "sequences per verify forward",
                    ),
                ],
                min_=0,
            ),
            8,
            8,
        ),
    ]


def variable(name: str, label: str, expr: str) -> db.QueryVariable:
    """A multi-value label_values variable, All by default."""
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query({"query": expr, "refId": f"{name}-var"})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .options([])
        .hide(dm.VariableHide.DONT_HIDE)
    )


ROWS = [
    ("Speculative decoding", speculative_decoding),
    ("Throughput and latency", throughput_and_latency),
    ("Load and drafter", load_and_drafter),
    ("Triton (target model)", triton),
]


def build() -> db.Dashboard:
    d = (
        db.Dashboard("FlashMap Serve")
        .uid("flashmap-serve")
        .description(
            "Speculative decoding with a flow-map drafter: acceptance, latency, load, Triton."
        )
        .tags(["flashmap", "speculative-decoding", "triton"])
        .timezone("browser")
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("10s")
        .version(1)
        .time("now-1h", "now")
        .annotation(
            db.AnnotationQuery()
            .name("Annotations & Alerts")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .type("dashboard")
            .built_in(1)
        )
        .with_variable(
            db.DatasourceVariable("datasource")
            .label("Datasource")
            .type("prometheus")
            .current(dm.VariableOption(selected=True, text="Prometheus", value=DATASOURCE_UID))
            .hide(dm.VariableHide.DONT_HIDE)
        )
        .with_variable(variable("model", "Model", "label_values(flashmap_num_drafts_total, model)"))
        .with_variable(
            variable("drafter", "Drafter", "label_values(flashmap_num_drafts_total, drafter)")
        )
        .with_variable(variable("steps", "Steps", "label_values(flashmap_num_drafts_total, steps)"))
        .with_variable(
            variable(
                "triton_model", "Triton model", "label_values(nv_inference_request_success, model)"
            )
        )
    )
    next_id = 1
    for title, panels in ROWS:
        d.with_row(db.Row(title).id(next_id))
        next_id += 1
        for panel, w, h in panels():
            d.with_panel(panel.id(next_id).span(w).height(h))
            next_id += 1
    return d


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
