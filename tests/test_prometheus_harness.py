"""tests/prometheus_harness.py against a real Prometheus scraping real prometheus_client servers.

The servers expose the orchestrator's and the drafter's actual metric registries, filled with a
known sequence of speculative rounds; Prometheus scrapes them, and the dashboard's own expressions
(taken from the committed JSON) must give back the acceptance numbers computed from those rounds.
The live stack test will do the same with the real services and the SDK's per-request stats.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client import start_http_server  # noqa: E402

from tests.prometheus_harness import (  # noqa: E402
    PrometheusError,
    PrometheusServer,
    find_prometheus,
    free_port,
    grafana_to_promql,
    scrape,
)

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "flashmap.json"
BLOCK = 16


def dashboard_expr(title: str, ref: str = "A") -> str:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panel = next(p for p in panels if p["title"] == title)
    return next(t["expr"] for t in panel["targets"] if t["refId"] == ref)


@pytest.fixture(scope="module")
def prometheus_bin():
    binary = find_prometheus()
    if not binary:
        msg = "prometheus not installed (apt-get install -y prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + ": .ci/run must install it")
        pytest.skip(msg)
    return binary


def test_grafana_to_promql():
    expr = 'sum(rate(x_total{model=~"$model", steps=~"${steps}"}[$__rate_interval]))'
    assert grafana_to_promql(expr) == 'sum(rate(x_total{model=~".*", steps=~".*"}[1m]))'
    assert (
        grafana_to_promql(expr, {"steps": "2"}, interval="10m")
        == 'sum(rate(x_total{model=~".*", steps=~"2"}[10m]))'
    )


@pytest.mark.stack
def test_dashboard_acceptance_queries_match_the_recorded_rounds(prometheus_bin):
    from drafter_service.metrics import DrafterMetrics
    from orchestrator.metrics import OrchestratorMetrics

    orch, drafter = OrchestratorMetrics(block_size=BLOCK), DrafterMetrics()
    base = {"model": "qwen3-test", "drafter": "flashmap-test"}
    # Accepted draft tokens per round, for two step counts (a deterministic, uneven mix).
    rounds = {"1": [0, 3, 16, 5, 5, 1, 0, 7, 2, 9, 4, 4], "2": [6, 8, 16, 2, 11, 0, 7]}

    # Every child exists at 0 before the first scrape. Then all series of one target share their
    # sample times and start at 0, so rate()'s extrapolation scales them all alike and the ratios
    # in the dashboard are exact (see the harness' docstring for the general case).
    orch.start_at_zero(base["model"], [dict(base, steps=steps) for steps in rounds])
    drafter.step_count.labels(drafter="flashmap-test").set(1)

    orch_port, drafter_port = free_port(), free_port()
    servers = [
        start_http_server(orch_port, addr="127.0.0.1", registry=orch.registry),
        start_http_server(drafter_port, addr="127.0.0.1", registry=drafter.registry),
    ]
    dead_port = free_port()  # nothing listens here
    try:
        with PrometheusServer(
            {
                "flashmap-orchestrator": [f"127.0.0.1:{orch_port}"],
                "flashmap-drafter": [f"127.0.0.1:{drafter_port}"],
                "dead": [f"127.0.0.1:{dead_port}"],
            },
            scrape_interval=0.5,
        ) as prom:
            live = ["flashmap-orchestrator", "flashmap-drafter"]
            prom.wait_for_targets_up(jobs=live)
            # The dead target's first scrape may still be to come (scrapes are staggered).
            prom.wait_until(lambda: prom.scalar('up{job="dead"}') == 0, what='up{job="dead"} == 0')
            assert prom.scalar("sum(flashmap_num_drafts_total)") == 0
            zero = {"1": 0.0, "2": 0.0}  # both step counts, before their first round
            assert prom.by_label("sum by (steps) (flashmap_num_drafts_total)", "steps") == zero

            for steps, accepted in rounds.items():
                for a in accepted:
                    orch.record_round(dict(base, steps=steps), num_draft=BLOCK, num_accepted=a)
            t_end = time.time()
            prom.wait_for_scrape_after(t_end, jobs=live)

            # A labelled series only shows up once it was touched: scrape after the traffic. What
            # the scrape returns is the live test's source of truth for metric names.
            scraped = scrape(f"http://127.0.0.1:{orch_port}/metrics")
            assert {
                "flashmap_num_accepted_tokens_per_pos_total",
                "flashmap_acceptance_length_bucket",
            } <= set(scraped)
            assert "position" in scraped["flashmap_num_accepted_tokens_per_pos_total"]

            every = [a for acc in rounds.values() for a in acc]
            mean_gamma = 1 + sum(every) / len(every)
            per_slot = {
                str(k): sum(a >= k for a in every) / len(every) for k in range(1, BLOCK + 1)
            }

            # Exact: raw counters after the final scrape.
            drafts = prom.scalar("sum(flashmap_num_drafts_total)")
            accepted = prom.scalar("sum(flashmap_num_accepted_tokens_total)")
            assert drafts == len(every)
            assert 1 + accepted / drafts == pytest.approx(mean_gamma, abs=1e-12)

            # The dashboard's own expressions, over a window that holds every sample.
            window = "10m"
            got = prom.scalar(
                grafana_to_promql(dashboard_expr("Mean acceptance length"), interval=window)
            )
            assert got == pytest.approx(mean_gamma, rel=1e-9)
            by_steps = prom.by_label(
                grafana_to_promql(
                    dashboard_expr("Mean acceptance length over time", "B"), interval=window
                ),
                "steps",
            )
            assert by_steps == pytest.approx(
                {s: 1 + sum(a) / len(a) for s, a in rounds.items()}, rel=1e-9
            )
            slots = prom.by_label(
                grafana_to_promql(dashboard_expr("Acceptance per slot"), interval=window),
                "position",
            )
            assert slots == pytest.approx(per_slot, rel=1e-9, abs=1e-12)
            # Slot acceptances add up to mean acceptance length - 1.
            assert sum(slots.values()) == pytest.approx(mean_gamma - 1, rel=1e-9)

            # The histogram of gamma saw every round, with gamma = accepted + 1 <= BLOCK + 1.
            assert prom.scalar("sum(flashmap_acceptance_length_count)") == len(every)
            assert prom.scalar(
                f'sum(flashmap_acceptance_length_bucket{{le="{BLOCK + 1}.0"}})'
            ) == len(every)
            assert prom.scalar('sum(flashmap_acceptance_length_bucket{le="1.0"})') == every.count(0)

            # A drafter gauge through the dashboard's step-count panel.
            steps_now = prom.by_label(
                grafana_to_promql(dashboard_expr("Drafter step count")), "drafter"
            )
            assert steps_now == {"flashmap-test": 1.0}

            with pytest.raises(PrometheusError, match="bad_data|parse"):
                prom.query("sum(rate(flashmap_num_drafts_total[5m])")
            proc = prom.proc
        assert proc.poll() is not None, "stop() must end the prometheus process"
    finally:
        for httpd, _thread in servers:
            httpd.shutdown()
            httpd.server_close()
