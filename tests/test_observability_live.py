"""Observability against the REAL local stack (Triton target, drafter, orchestrator on 127.0.0.1).

One stack per module: a tiny random Qwen3 target, an untrained ("init") FlashMap drafter, 4 KV
slots. Traffic goes through the SDK (flashmap.client); every Completion is kept, so the services'
counters can be compared with the sum of the SDK's per-request stats.

1. A real Prometheus (Debian package) scrapes the three /metrics endpoints under the job names of
   deploy/prometheus/prometheus.yml and loads deploy/prometheus/alerts.yml. After a scrape that
   started once the traffic had ended, the HTTP API must give back exactly the SDK's numbers:
   mean acceptance length (1 + accepted / drafts), accepted tokens per slot, the acceptance-length
   histogram's count and sum, drafts per step count, requests, prompt and generated tokens,
   fallback rounds. Every dashboard and alert expression then evaluates without error on the live
   data, and FlashMapAcceptanceCollapse goes pending (the untrained drafter accepts ~1% of slot 1).
2. Every metric name the dashboard and the alert rules use is in a live scrape of the three
   endpoints (labelled series only exist once touched, so this runs after traffic, including a
   request decoded while the drafter is down, which counts a fallback), and every label those
   expressions match on exists on the live series.

Acceptance with an untrained drafter: at temperature 0 it accepts nothing. At a very high
temperature the random target's distribution is nearly uniform over its 512 tokens while the
drafter proposes from its top 4 (orchestrator top_m), so slot 1 is accepted with probability
about 4/512: a few accepted tokens over the run, at slot 1 only. The comparisons are exact
whatever the numbers turn out to be; the test prints which case happened.

Locally, a missing prometheus or tritonserver skips with the install line; under CI=true it fails.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from flashmap.metrics import TARGET_LABELS
from tests.prometheus_harness import (
    ALERT_RULES,
    PrometheusServer,
    alert_expressions,
    dashboard_expressions,
    dashboard_variable_metrics,
    find_prometheus,
    need,
    referenced_metrics,
    scrape,
    selectors,
)

pytestmark = pytest.mark.timeout(300)

N_SLOTS = 4
MAX_SEQ_LEN = 256
JOBS = ("flashmap-orchestrator", "flashmap-drafter", "triton")  # deploy/prometheus/prometheus.yml


def tritonserver_available() -> bool:
    from target_service import launcher

    try:
        launcher.find_tritonserver()
    except launcher.TritonStartError:
        return False
    return True


@dataclass
class Traffic:
    completions: list = field(default_factory=list)  # every request this stack ever served
    t_end: float = 0.0  # wall clock when the last one had finished


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    need(tritonserver_available(), "tritonserver", "pip install -e '.[triton]' (nvidia-pytriton)")
    from flashmap_cli.stack import Stack, StackConfig
    from target_service.random_checkpoint import make_random_qwen3

    ckpt = make_random_qwen3(
        tmp_path_factory.mktemp("target") / "qwen3", max_position_embeddings=MAX_SEQ_LEN
    )
    # speculation="full": the dashboards' acceptance panels need drafted rounds (the untrained
    # drafter would make the speculation controller turn drafting off).
    cfg = StackConfig.on_free_ports(
        target_dir=str(ckpt),
        n_slots=N_SLOTS,
        max_seq_len=MAX_SEQ_LEN,
        speculation="full",
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )
    st = Stack(cfg).start()  # start() stops whatever it started when it fails
    try:
        yield st
    finally:
        st.stop()


def metrics_urls(stack) -> dict[str, str]:
    c = stack.cfg
    return {
        "flashmap-orchestrator": f"http://{c.host}:{c.metrics_port}/metrics",
        "flashmap-drafter": f"http://{c.host}:{c.drafter_metrics_port}/metrics",
        "triton": f"http://{c.host}:{c.triton_metrics_port}/metrics",
    }


@pytest.fixture(scope="module")
def prometheus(request):
    """Prometheus scraping the stack, started before the traffic so it sees the counters grow."""
    binary = need(
        find_prometheus(), "prometheus", "apt-get install -y prometheus"
    )  # before the stack starts
    c = request.getfixturevalue("stack").cfg
    ports = {
        "flashmap-orchestrator": c.metrics_port,
        "flashmap-drafter": c.drafter_metrics_port,
        "triton": c.triton_metrics_port,
    }
    with PrometheusServer(
        {job: [f"{c.host}:{ports[job]}"] for job in JOBS},
        scrape_interval=1.0,
        rule_files=[ALERT_RULES],
        binary=binary,
    ) as prom:
        prom.wait_for_targets_up(jobs=JOBS)
        yield prom


def _generate(client, **kw):
    return client.generate(ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def traffic(stack) -> Traffic:
    """Greedy and sampled requests, 4 at a time (all slots busy), step counts 1 and 2.

    Tests that want Prometheus to watch the traffic list the prometheus fixture before this one.
    """
    from flashmap.client import Client

    jobs = [
        dict(prompt_ids=[3 + i, 17, 33, 9, 100 + i], max_new_tokens=16, temperature=0.0)
        for i in range(4)
    ]
    jobs += [
        dict(
            prompt_ids=[50 + i, 7, 7, 200 + i],
            max_new_tokens=48,
            temperature=50.0,
            seed=i,
            **({"draft_steps": 2} if i % 2 else {}),
        )
        for i in range(8)
    ]
    t = Traffic()
    with Client(stack.cfg.url, timeout=120) as client, ThreadPoolExecutor(N_SLOTS) as pool:
        t.completions.extend(pool.map(lambda kw: _generate(client, **kw), jobs))
    t.t_end = time.time()
    assert all(o.finish_reason == "length" for o in t.completions), [
        o.finish_reason for o in t.completions
    ]
    return t


def sdk_totals(completions) -> dict:
    stats = [o.stats for o in completions]
    width = max(len(s.accepted_per_slot) for s in stats)
    per_slot = [
        sum(s.accepted_per_slot[k] if k < len(s.accepted_per_slot) else 0 for s in stats)
        for k in range(width)
    ]
    drafts_by_steps = Counter()
    for s in stats:
        if s.drafts:
            drafts_by_steps[str(s.draft_steps)] += s.drafts
    return {
        "requests": len(completions),
        "drafts": sum(s.drafts for s in stats),
        "draft_tokens": sum(s.draft_tokens for s in stats),
        "accepted": sum(s.accepted for s in stats),
        "per_slot": per_slot,
        "drafts_by_steps": dict(drafts_by_steps),
        "fallback_rounds": sum(s.fallback_rounds for s in stats),
        "prompt_tokens": sum(o.prompt_tokens for o in completions),
        "generated_tokens": sum(len(o.token_ids) for o in completions),
    }


# =============================================================================================
# 1. Prometheus' numbers = the SDK's per-request stats
# =============================================================================================


def test_prometheus_acceptance_matches_sdk_stats(prometheus, stack, traffic):
    from flashmap.client import Client

    prom = prometheus
    prom.wait_for_scrape_after(traffic.t_end, jobs=JOBS)
    sdk = sdk_totals(traffic.completions)
    assert sdk["drafts"] > 0, "no speculative round verified a draft"

    def value(expr: str) -> float:
        v = prom.scalar(expr)
        assert v is not None, f"{expr}: no data"
        return v

    assert value("sum(flashmap_num_drafts_total)") == sdk["drafts"]
    assert value("sum(flashmap_num_draft_tokens_total)") == sdk["draft_tokens"]
    assert value("sum(flashmap_num_accepted_tokens_total)") == sdk["accepted"]

    # Mean acceptance length, ARCHITECTURE.md's definition, through the HTTP API.
    mean_gamma = value(
        "1 + sum(flashmap_num_accepted_tokens_total) / sum(flashmap_num_drafts_total)"
    )
    assert mean_gamma == pytest.approx(1 + sdk["accepted"] / sdk["drafts"], rel=1e-12)

    # Per-slot acceptance: position p (1-based) is SDK slot p - 1; every slot of the block is
    # exported, zero or not.
    by_pos = prom.by_label(
        "sum by (position) (flashmap_num_accepted_tokens_per_pos_total)", "position"
    )
    assert by_pos == {str(k + 1): float(n) for k, n in enumerate(sdk["per_slot"])}
    assert sum(by_pos.values()) == sdk["accepted"]

    # The histogram of gamma (= accepted + 1) saw every drafted round once.
    assert value("sum(flashmap_acceptance_length_count)") == sdk["drafts"]
    assert value("sum(flashmap_acceptance_length_sum)") == sdk["drafts"] + sdk["accepted"]

    # Labels: drafts split by step count as the requests asked, under the model and drafter
    # names ModelInfo reports.
    assert prom.by_label("sum by (steps) (flashmap_num_drafts_total)", "steps") == {
        s: float(n) for s, n in sdk["drafts_by_steps"].items()
    }
    with Client(stack.cfg.url, timeout=30) as client:
        info = client.model_info()
    series = prom.query("sum by (model, drafter) (flashmap_num_drafts_total)")
    assert [(row["model"], row["drafter"]) for row, _ in series] == [(info.model, info.drafter)]

    # Requests, tokens, fallbacks.
    assert value("sum(flashmap_requests_total)") == sdk["requests"]
    assert value('sum(flashmap_requests_total{status="length"})') == sdk["requests"]
    assert value("sum(flashmap_prompt_tokens_total)") == sdk["prompt_tokens"]
    assert value("sum(flashmap_generated_tokens_total)") == sdk["generated_tokens"]
    assert (prom.scalar("sum(flashmap_fallback_rounds_total)") or 0.0) == sdk["fallback_rounds"]

    # Every target answered; Triton counted the verify requests.
    assert prom.by_label("up", "job") == {job: 1.0 for job in JOBS}
    assert value('sum(nv_inference_request_success{model="flashmap_target"})') > 0

    accepted_slots = [p for p, n in sorted(by_pos.items(), key=lambda kv: int(kv[0])) if n]
    if sdk["accepted"]:
        note = f"{int(sdk['accepted'])} draft tokens accepted, at positions {accepted_slots}"
    else:
        note = "no draft token was accepted: the per-slot check compared all zeros"
    print(
        f"\nnote: {sdk['requests']} requests, {sdk['drafts']} drafts, mean acceptance length "
        f"{mean_gamma:.4f}; {note}"
    )


def test_dashboard_and_alert_expressions_evaluate_on_live_data(prometheus, traffic):
    prom = prometheus
    prom.wait_for_scrape_after(traffic.t_end, jobs=JOBS)
    empty = []
    for where, expr in dashboard_expressions(interval="5m") + alert_expressions():
        if not prom.query(expr):  # raises PrometheusError on a bad expression
            empty.append(where)
    # Panels about the traffic that just ran must show data.
    for title in (
        "Mean acceptance length",
        "Acceptance per slot",
        "Acceptance length distribution",
        "Tokens/s",
        "Time to first token",
        "Triton requests/s",
    ):
        assert not [w for w in empty if f"panel {title!r}" in w], (
            f"{title!r} has no data; empty: {empty}"
        )
    for where, metric, label in dashboard_variable_metrics():
        assert prom.api("label/" + label + "/values", **{"match[]": metric}), (
            f"{where}: no {label} values"
        )

    # The untrained drafter's mean acceptance length is far below the rule's 1.5 floor, with
    # traffic: FlashMapAcceptanceCollapse must go pending (it fires only after 10 minutes).
    sdk = sdk_totals(traffic.completions)
    if sdk["drafts"] and 1 + sdk["accepted"] / sdk["drafts"] < 1.5:

        def pending():
            return [
                a
                for a in prom.api("alerts")["alerts"]
                if a["labels"]["alertname"] == "FlashMapAcceptanceCollapse"
                and a["state"] in ("pending", "firing")
            ]

        alerts = prom.wait_until(pending, timeout=20, what="FlashMapAcceptanceCollapse pending")
        drafters = {
            row["drafter"] for row, _ in prom.query("sum by (drafter) (flashmap_num_drafts_total)")
        }
        assert {a["labels"]["drafter"] for a in alerts} == drafters
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == len(alert_expressions())
    assert all(r["health"] in ("ok", "unknown") for r in rules), [
        (r["name"], r.get("lastError")) for r in rules
    ]


# =============================================================================================
# 2. Every metric name (and label) the dashboard and the rules use is really exported
# =============================================================================================


def test_referenced_metrics_are_in_a_live_scrape(stack, traffic):
    from flashmap.client import Client

    urls = metrics_urls(stack)
    live = {"flashmap-drafter": scrape(urls["flashmap-drafter"])}

    # One request decoded while the drafter is down: the orchestrator falls back to plain
    # decoding, so flashmap_fallback_rounds_total has a real (non-zero) child to export.
    stack.stop_drafter()
    try:
        with Client(stack.cfg.url, timeout=120) as client:
            out = _generate(client, prompt_ids=[11, 12, 13], max_new_tokens=6, temperature=0.0)
        traffic.completions.append(out)
        traffic.t_end = time.time()
        assert out.stats.fallback_rounds > 0 and out.stats.drafts == 0, out.stats
    finally:
        stack.start_drafter(wait=True)
    live["flashmap-orchestrator"] = scrape(urls["flashmap-orchestrator"])
    live["triton"] = scrape(urls["triton"])

    exported: dict[str, set[str]] = {}
    for names in live.values():
        for name, labels in names.items():
            exported.setdefault(name, set()).update(labels)
    missing = referenced_metrics() - set(exported)
    assert not missing, (
        f"used by the dashboard or alert rules but not in any /metrics: {sorted(missing)}"
    )

    # Each label an expression matches on exists on the live series.
    for where, expr in dashboard_expressions() + alert_expressions():
        for sel in selectors(expr):
            if sel.name in exported:
                used = {m.name for m in sel.matchers.matchers} - TARGET_LABELS - {"__name__"}
                assert used <= exported[sel.name], (
                    f"{where}: {sel.name} has labels {sorted(exported[sel.name])}"
                )
    for where, metric, label in dashboard_variable_metrics():
        assert label in exported[metric], f"{where}: {metric} has no label {label}"

    # Each service exports its own names (the scrape configs' jobs are not mixed up).
    assert "flashmap_num_drafts_total" in live["flashmap-orchestrator"]
    assert "flashmap_drafter_blocks_total" in live["flashmap-drafter"]
    assert "nv_inference_request_success" in live["triton"]
    assert "flashmap_target_verify_rows_total" in live["triton"]
