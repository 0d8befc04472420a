"""Test helpers around a real Prometheus server and the dashboards / rules that query it.

1. ``PrometheusServer``: starts the real ``prometheus`` binary (Debian package) on 127.0.0.1 with a
   generated scrape config pointing at the given targets, waits until it is ready, queries its HTTP
   API, and stops it. Nothing is downloaded; the binary must be installed (``.ci/run`` installs it).

2. The expressions of the Grafana dashboard and the alert rules, parsed, and ``exported_metrics()``:
   the metric catalogue (flashmap.metrics) they may use; ``service_registry_metrics()`` reads the
   real registries of the orchestrator and the drafter, so a test can hold the catalogue to them.

Comparing Prometheus' numbers with the SDK's per-request stats: ``rate()``/``increase()`` extrapolate
to the window edges, so a dashboard expression is only approximately equal to the exact ratio.
For an exact check query raw counters (``sum(flashmap_num_accepted_tokens_total)``) after
``wait_for_scrape_after(t_end)`` has seen a scrape that started after the traffic ended.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC
from pathlib import Path

import pytest
import yaml

from flashmap import metrics
from flashmap.grpc_serving import free_port  # noqa: F401 - re-exported for the tests
from flashmap.metrics import PROMETHEUS_SYNTHETIC, series_labels

# --------------------------------------------------------------------------------------------
# Locating the binaries
# --------------------------------------------------------------------------------------------


def need(found, what: str, install: str):
    """found, or skip (locally) / fail (CI=true) with the line that installs the tool."""
    if found:
        return found
    msg = f"{what} not installed ({install})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{msg}: .ci/run must install it")
    pytest.skip(msg)


def find_prometheus() -> str | None:
    """The prometheus server binary: $PROMETHEUS_BIN, else the one on PATH."""
    return os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")


def find_promtool() -> str | None:
    return os.environ.get("PROMTOOL_BIN") or shutil.which("promtool")


class PrometheusError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class PrometheusServer:
    """A throw-away Prometheus scraping ``targets`` ({job name: ["host:port", ...]}).

    Use as a context manager::

        with PrometheusServer({"orchestrator": ["127.0.0.1:9400"]}) as prom:
            prom.wait_for_targets_up()
            prom.scalar("sum(flashmap_num_drafts_total)")
    """

    def __init__(
        self,
        targets: Mapping[str, Sequence[str]],
        *,
        scrape_interval: float = 1.0,
        rule_files: Iterable[str | Path] = (),
        evaluation_interval: float = 1.0,
        binary: str | None = None,
        workdir: str | Path | None = None,
    ):
        self.targets = {job: list(addrs) for job, addrs in targets.items()}
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.rule_files = [str(Path(p).resolve()) for p in rule_files]
        self.binary = binary or find_prometheus()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise PrometheusError("server not started")
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        """The scrape configuration this server runs with."""

        # Sub-second intervals are legal Prometheus durations; write them in milliseconds.
        def dur(seconds: float) -> str:
            return f"{int(round(seconds * 1000))}ms"

        return {
            "global": {
                "scrape_interval": dur(self.scrape_interval),
                # The timeout may not exceed the interval.
                "scrape_timeout": dur(self.scrape_interval),
                "evaluation_interval": dur(self.evaluation_interval),
            },
            "rule_files": self.rule_files,
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addrs}]}
                for job, addrs in self.targets.items()
            ],
        }

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        if not self.binary:
            raise PrometheusError(
                "prometheus binary not found (apt-get install prometheus, or set PROMETHEUS_BIN)"
            )
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="flashmap-prom-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.port = free_port()
        self._log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={cfg_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            # Own process group, so stop() ends exactly this server and nothing else.
            start_new_session=True,
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self.proc.returncode}:\n{self.log_text()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise PrometheusError(f"prometheus not ready after {timeout}s:\n{self.log_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        if self.workdir is None or not (self.workdir / "prometheus.log").exists():
            return ""
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-4000:]

    # -- HTTP API ----------------------------------------------------------------------------

    def api(self, path: str, **params) -> object:
        """GET /api/v1/<path>; returns the "data" field, raises PrometheusError on an API error."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422 carry a JSON error body
            body = json.load(e)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict, float]]:
        """Instant query; a list of (labels, value). A scalar result is one entry with no labels."""
        data = self.api("query", query=expr, time=at)
        kind, result = data["resultType"], data["result"]
        if kind == "vector":
            return [(s["metric"], float(s["value"][1])) for s in result]
        if kind == "scalar":
            return [({}, float(result[1]))]
        raise PrometheusError(f"unexpected result type {kind} for {expr!r}")

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The single value of an instant query; None when the result is empty."""
        rows = self.query(expr, at)
        if not rows:
            return None
        if len(rows) > 1:
            raise PrometheusError(f"{expr!r} returned {len(rows)} series, expected one: {rows}")
        return rows[0][1]

    def by_label(self, expr: str, label: str, at: float | None = None) -> dict[str, float]:
        """Instant query whose series differ in one label; {label value: value}."""
        return {labels.get(label, ""): value for labels, value in self.query(expr, at)}

    def active_targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    # -- waiting -----------------------------------------------------------------------------

    def wait_until(
        self, predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition"
    ) -> object:
        """Poll predicate until it returns something truthy (returned) or the timeout passes."""
        deadline = time.monotonic() + timeout
        last_exc: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except PrometheusError as e:
                last_exc = e
            time.sleep(0.2)
        raise PrometheusError(
            f"timed out after {timeout}s waiting for {what} (last error: {last_exc})\n{self.log_text()}"
        )

    def _targets_of(self, jobs: Iterable[str] | None) -> tuple[list[dict], int]:
        """Active targets of the given jobs (all when None) and how many there should be."""
        jobs = set(self.targets if jobs is None else jobs)
        expected = sum(len(self.targets[j]) for j in jobs)
        return [t for t in self.active_targets() if t["labels"].get("job") in jobs], expected

    def wait_for_targets_up(self, timeout: float = 30.0, jobs: Iterable[str] | None = None) -> None:
        """Every target (of the given jobs) has been scraped successfully at least once."""

        def all_up():
            ts, expected = self._targets_of(jobs)
            return len(ts) == expected and all(t["health"] == "up" for t in ts)

        self.wait_until(all_up, timeout, "all targets up")

    def wait_for_scrape_after(
        self, t: float, timeout: float = 30.0, jobs: Iterable[str] | None = None
    ) -> None:
        """Every target (of the given jobs) has a successful scrape that *started* after time t.

        Call with the wall-clock time your traffic ended; afterwards instant queries see its final
        counters.
        """

        def fresh():
            ts, expected = self._targets_of(jobs)
            return len(ts) == expected and all(
                t_["health"] == "up" and _rfc3339(t_["lastScrape"]) > t for t_ in ts
            )

        self.wait_until(fresh, timeout, f"a scrape after {t}")


def _rfc3339(stamp: str) -> float:
    """Prometheus' lastScrape ("2026-11-29T23:30:01.123456789Z") as a Unix time."""
    from datetime import datetime

    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", stamp)
    if not m:
        raise PrometheusError(f"unparseable timestamp {stamp!r}")
    base = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")
    frac = float(m.group(2) or 0.0)
    tz = m.group(3)
    offset = (
        0 if tz == "Z" else (1 if tz[0] == "+" else -1) * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    )
    return base.replace(tzinfo=UTC).timestamp() + frac - offset


# --------------------------------------------------------------------------------------------
# Grafana expressions -> plain PromQL
# --------------------------------------------------------------------------------------------

# Grafana's interval macros; any valid duration works for parsing and for instant queries.
GRAFANA_INTERVALS = ("__rate_interval", "__interval", "__range")


def grafana_to_promql(
    expr: str, variables: Mapping[str, str] | None = None, interval: str = "1m"
) -> str:
    """Replace Grafana macros and template variables so Prometheus accepts the expression.

    Dashboard variables only ever appear inside regex label matchers (``model=~"$model"``), so
    the default substitution is ``.*`` (= the "All" value). ``variables`` overrides per name.
    """
    variables = dict(variables or {})

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_INTERVALS:
            return interval
        return variables.get(name, ".*")

    # $name, ${name} and ${name:format}
    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)
    return out


# --------------------------------------------------------------------------------------------
# The PromQL the deployment uses (dashboard + alert rules)
# --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
DASHBOARD_JSON = REPO / "deploy" / "grafana" / "dashboards" / "flashmap.json"
ALERT_RULES = REPO / "deploy" / "prometheus" / "alerts.yml"


def dashboard_panels(panels: list[dict]):
    """Every panel, including those nested in collapsed rows."""
    for p in panels:
        yield p
        yield from dashboard_panels(p.get("panels", []))


def dashboard_expressions(
    path: Path = DASHBOARD_JSON, interval: str = "1m"
) -> list[tuple[str, str]]:
    """(where, PromQL with Grafana variables substituted) for every query of the dashboard."""
    dash = json.loads(Path(path).read_text())
    out = []
    for p in dashboard_panels(dash["panels"]):
        for t in p.get("targets", []):
            out.append(
                (
                    f"dashboard panel {p['title']!r} {t['refId']}",
                    grafana_to_promql(t["expr"], interval=interval),
                )
            )
    return out


def dashboard_variable_metrics(path: Path = DASHBOARD_JSON) -> list[tuple[str, str, str]]:
    """(where, metric, label) of every label_values(metric, label) template variable."""
    dash = json.loads(Path(path).read_text())
    out = []
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            if not m:
                raise ValueError(f"variable {v['name']}: unsupported query {query!r}")
            out.append((f"variable {v['name']}", m.group(1), m.group(2)))
    return out


def alert_expressions(path: Path = ALERT_RULES) -> list[tuple[str, str]]:
    rules = yaml.safe_load(Path(path).read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def selectors(expr: str) -> list:
    """The vector selectors of a PromQL expression (promql-parser AST nodes: .name, .matchers)."""
    import promql_parser

    found = []
    promql_parser.walk(
        promql_parser.parse(expr),
        lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None,
    )
    return found


def referenced_metrics() -> set[str]:
    """Every metric name the dashboard and the alert rules use (the live test checks a scrape)."""
    names = {
        sel.name for _, e in dashboard_expressions() + alert_expressions() for sel in selectors(e)
    }
    names |= {metric for _, metric, _ in dashboard_variable_metrics()}
    return names - set(PROMETHEUS_SYNTHETIC)


# --------------------------------------------------------------------------------------------
# What the services export
# --------------------------------------------------------------------------------------------


def scrape(url: str, timeout: float = 5.0) -> dict[str, set[str]]:
    """GET a /metrics endpoint; {series name: label names}."""
    return series_labels(metrics.scrape(url, timeout))


def parse_exposition(text: str) -> dict[str, set[str]]:
    """Prometheus text format -> {series name: label names seen on it}."""
    return series_labels(metrics.parse_exposition(text))


def _touch_all_children(metrics_obj) -> None:
    """Create one child of every labelled metric so that every series name appears in the output.

    prometheus_client only exports a labelled metric once some child exists; the label names are
    only reachable through the private ``_labelnames`` (stable for many releases).
    """
    from prometheus_client.metrics import MetricWrapperBase

    for value in vars(metrics_obj).values():
        if isinstance(value, MetricWrapperBase):
            names = getattr(value, "_labelnames", ())
            if names:
                value.labels(**{n: "1" for n in names})


def service_registry_metrics() -> dict[str, set[str]]:
    """Series names and label names that the orchestrator and drafter registries export."""
    from prometheus_client import generate_latest

    from drafter_service.metrics import DrafterMetrics
    from orchestrator.metrics import OrchestratorMetrics

    out: dict[str, set[str]] = {}
    for registry in (OrchestratorMetrics(), DrafterMetrics()):
        _touch_all_children(registry)
        for name, labels in parse_exposition(generate_latest(registry.registry).decode()).items():
            out.setdefault(name, set()).update(labels)
    return out


def exported_metrics() -> dict[str, set[str] | None]:
    """Everything a dashboard or rule may reference: the catalogue (flashmap.metrics)."""
    return metrics.exported_series()
