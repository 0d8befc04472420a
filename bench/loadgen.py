"""AIPerf, NVIDIA's load generator for OpenAI-compatible servers (the successor of genai-perf),
against a running stack's OpenAI API, and its numbers as a report beside bench.stack's.

Starts nothing: `flashmap up` (or any deployment) must be serving. For each endpoint (chat,
completions) and each concurrency, one `aiperf profile` run, streamed: synthetic prompts of
`--input-tokens` tokens made by AIPerf with the target's tokenizer, `--max-new-tokens` new
tokens each (ignore_eos), greedy unless `--temperature`, token counts as the server reports
them (usage), a warmup of `concurrency` requests first. The report has AIPerf's numbers for each
run (throughput, TTFT, inter-token latency, request latency) and, read from the orchestrator's
/metrics before and after it when `--metrics-url` answers, the rounds that drafted and their
mean acceptance length. Each run's AIPerf command is in the report, to be run without this tool.

AIPerf lives in a venv of its own, .venv/aiperf (scripts/setup.sh): its pins are not the
stack's. It reads the tokenizer from a local directory (`--tokenizer`), which it loads without
the Hugging Face Hub; HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are removed from its
environment because AIPerf 0.13 in offline mode looks every tokenizer name up in the Hub's cache,
local directories too, and fails.

    python -m bench.loadgen                          # flashmap up's defaults: 127.0.0.1:8080
    python -m bench.loadgen --concurrency 1 --requests 8 --out /tmp/loadgen.md
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from bench.common import REPO, RESULTS, parser, write_report
from flashmap_cli.stack import DEMO_TARGET

MODULE = "bench.loadgen"
AIPERF = REPO / ".venv" / "aiperf" / "bin" / "aiperf"
ENDPOINTS = ("chat", "completions")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def find_aiperf(given: str | None) -> str:
    """The aiperf executable: `given`, else .venv/aiperf's, else the one on PATH."""
    for cand in (given, str(AIPERF) if AIPERF.exists() else None, shutil.which("aiperf")):
        if cand:
            return cand
    raise SystemExit("aiperf not found: `bash scripts/setup.sh` installs it into .venv/aiperf")


def served_model(url: str, api_key: str | None) -> str:
    """The one model the server lists at /v1/models."""
    req = urllib.request.Request(f"{url}/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def aiperf_command(
    aiperf: str,
    *,
    url: str,
    model: str,
    tokenizer: str,
    endpoint: str,
    concurrency: int,
    requests: int,
    input_tokens: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    artifacts: Path,
    api_key: str | None = None,
) -> list[str]:
    """One `aiperf profile` run: streamed, fixed prompt and output lengths, server token counts."""
    cmd = [
        aiperf, "profile",
        "--url", url,
        "--model", model,
        "--tokenizer", str(Path(tokenizer).resolve()),
        "--endpoint-type", endpoint,
        "--streaming",
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        "--warmup-request-count", str(concurrency),
        "--isl", str(input_tokens), "--isl-stddev", "0",
        "--osl", str(max_new_tokens),
        "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", f"temperature:{temperature:g}",
        "--use-server-token-count",
        "--random-seed", str(seed),
        "--artifact-dir", str(artifacts),
        "--ui-type", "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
    ]  # fmt: skip
    return cmd + (["--api-key", api_key] if api_key else [])


def spec_counters(metrics_url: str | None) -> tuple[float, float] | None:
    """(drafts, accepted tokens) summed over the orchestrator's series, or None without one."""
    if not metrics_url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    sums = {"flashmap_num_drafts_total": 0.0, "flashmap_num_accepted_tokens_total": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in sums:
                sums[s.name] += s.value
    return sums["flashmap_num_drafts_total"], sums["flashmap_num_accepted_tokens_total"]


def cell_numbers(export: dict) -> dict:
    """The numbers of one run from AIPerf's profile_export_aiperf.json."""
    get = lambda name, stat="avg": (export.get(name) or {}).get(stat)
    return {
        "requests": get("request_count"),
        "errors": sum(e.get("count", 0) for e in export.get("error_summary") or []),
        "input_tokens": get("input_sequence_length"),
        "output_tokens": get("output_sequence_length"),
        "output_tokens_per_s": get("output_token_throughput"),
        "requests_per_s": get("request_throughput"),
        "ttft_ms_p50": get("time_to_first_token", "p50"),
        "ttft_ms_p99": get("time_to_first_token", "p99"),
        "itl_ms_p50": get("inter_token_latency", "p50"),
        "latency_ms_p50": get("request_latency", "p50"),
        "latency_ms_p99": get("request_latency", "p99"),
        "duration_s": get("benchmark_duration"),
    }


def run_cell(cmd: list[str], artifacts: Path, timeout_s: float) -> dict:
    """Run AIPerf (its console output to aiperf.out beside its artifacts); its numbers."""
    env = {k: v for k, v in os.environ.items() if k not in _OFFLINE_VARS}
    artifacts.mkdir(parents=True, exist_ok=True)
    log = artifacts / "aiperf.out"
    with log.open("w") as out:
        rc = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
        ).returncode
    export = artifacts / "profile_export_aiperf.json"
    if rc != 0 or not export.exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"aiperf exited {rc}: {shlex.join(cmd)}\n{tail}")
    return cell_numbers(json.loads(export.read_text()))


def shown_command(cmd: list[str], artifacts: Path) -> list[str]:
    """`cmd` as the report shows it: paths in the repository relative to it, the artifacts
    folder as aiperf-artifacts/, the API key as $FLASHMAP_API_KEY."""
    shown = ["aiperf"]
    for prev, arg in zip(cmd, cmd[1:]):
        if prev == "--api-key":
            arg = "$FLASHMAP_API_KEY"
        elif arg.startswith(str(artifacts)):
            arg = "aiperf-artifacts" + arg[len(str(artifacts)) :]
        elif Path(arg).is_absolute() and Path(arg).is_relative_to(REPO):
            arg = str(Path(arg).relative_to(REPO))
        shown.append(arg)
    return shown


def _fmt(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(cells: list[dict]) -> list[str]:
    rows = [
        "| endpoint | concurrency | requests (errors) | prompt / new tokens | output tokens/s "
        "| requests/s | TTFT p50 / p99 (ms) | inter-token p50 (ms) | latency p50 / p99 (ms) "
        "| drafts | mean acceptance length |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        rows.append(
            f"| {c['endpoint']} | {c['concurrency']} | {_fmt(c['requests'])} ({c['errors']}) "
            f"| {_fmt(c['input_tokens'])} / {_fmt(c['output_tokens'])} "
            f"| {_fmt(c['output_tokens_per_s'], 1)} | {_fmt(c['requests_per_s'], 2)} "
            f"| {_fmt(c['ttft_ms_p50'])} / {_fmt(c['ttft_ms_p99'])} | {_fmt(c['itl_ms_p50'], 1)} "
            f"| {_fmt(c['latency_ms_p50'])} / {_fmt(c['latency_ms_p99'])} "
            f"| {_fmt(c.get('drafts'))} | {_fmt(c.get('mean_acceptance_length'), 2)} |"
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = parser(MODULE, __doc__, max_new_tokens=64, out=RESULTS / "loadgen.md")
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the OpenAI API's base URL")
    ap.add_argument("--model", help="model name (default: the one /v1/models lists)")
    ap.add_argument("--tokenizer", default=str(DEMO_TARGET), help="the target's directory")
    ap.add_argument("--endpoints", default=",".join(ENDPOINTS), help="chat and/or completions")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated")
    ap.add_argument("--requests", type=int, default=0, help="per run (0: 8 x concurrency)")
    ap.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--metrics-url",
        default="http://127.0.0.1:9400/metrics",
        help="the orchestrator's /metrics, for the drafts ('': none)",
    )
    ap.add_argument("--aiperf", help="the aiperf executable (default: .venv/aiperf's)")
    ap.add_argument("--artifacts", type=Path, help="AIPerf's output folders (default: a tmp dir)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    args = ap.parse_args(argv)
    api_key = os.environ.get("FLASHMAP_API_KEY") or None
    aiperf = find_aiperf(args.aiperf)
    model = args.model or served_model(args.url, api_key)
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="flashmap-aiperf-"))
    load = os.getloadavg()[0]  # a shared machine: what else was running shows here
    cells, commands = [], []
    for endpoint in args.endpoints.split(","):
        for conc in (int(c) for c in args.concurrency.split(",")):
            cell_dir = artifacts / f"{endpoint}-c{conc}"
            cmd = aiperf_command(
                aiperf, url=args.url, model=model, tokenizer=args.tokenizer, endpoint=endpoint,
                concurrency=conc, requests=args.requests or 8 * conc,
                input_tokens=args.input_tokens, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, seed=args.seed, artifacts=cell_dir, api_key=api_key,
            )  # fmt: skip
            before = spec_counters(args.metrics_url)
            cell = {
                "endpoint": endpoint,
                "concurrency": conc,
                **run_cell(cmd, cell_dir, args.timeout_s),
            }
            after = spec_counters(args.metrics_url)
            if before and after:
                drafts, accepted = after[0] - before[0], after[1] - before[1]
                cell["drafts"] = drafts
                cell["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
            cells.append(cell)
            print(table([cell])[-1], flush=True)
            shown = shlex.join(shown_command(cmd, artifacts))
            commands.append(f"- {endpoint}, concurrency {conc}: `{shown}`")
    about = (
        f"AIPerf's numbers against `{args.url}` (model `{model}`): each run streamed, "
        f"{args.input_tokens}-token synthetic prompts from AIPerf's generator and the target's "
        f"tokenizer (a chat prompt also carries the chat template's tokens), "
        f"{args.max_new_tokens} new tokens each (ignore_eos), temperature "
        f"{args.temperature:g}, token counts from the server's usage, a warmup of `concurrency` "
        "requests first. Inter-token latency is AIPerf's: (latency - TTFT) / (new tokens - 1); "
        "the stack streams several tokens per chunk. Drafts and mean acceptance length: the "
        "orchestrator's counters over the run, warmup included (`flashmap_num_drafts_total`, "
        "`1 + accepted / drafts`; '-': no draft). The machine's 1-minute load average when the "
        f"run started: {load:.1f}."
    )
    more = [
        "AIPerf commands (one per run; the tokenizer is the target's directory; what the flags "
        "do: [benchmarking.md](../benchmarking.md)):",
        "",
        *commands,
    ]
    args.out.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(cells, indent=1) + "\n")
    title = "AIPerf against the stack's OpenAI API"
    write_report(args.out, title, table(cells), about, MODULE, argv, more)
    return cells


if __name__ == "__main__":
    main()
