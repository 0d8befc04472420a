"""AIPerf, a standard load generator, against the real stack's OpenAI API through
bench.loadgen: Triton (a tiny random Qwen3 with a tokenizer and a chat template), the drafter
service and the orchestrator as processes; chat and completions, streamed, 2 at a time, 4
requests each after a warmup of 2. AIPerf reads the target's tokenizer from its directory,
with no Hub. Its numbers must be those of requests that ran (every one completed, the new
tokens the server counted, latencies that hold together), the orchestrator must have counted
the same requests, and the report must carry them."""

from __future__ import annotations

import json

import pytest

from bench import loadgen
from flashmap_cli.stack import Stack, StackConfig
from tests.stack_helpers import (  # noqa: F401 - target_dir, one_thread_per_process: fixtures
    _samples,
    _total,
    one_thread_per_process,
    target_dir,
)

NEW_TOKENS = 8
REQUESTS = 4
CONCURRENCY = 2


@pytest.fixture(scope="module")
def stack(target_dir, tmp_path_factory):
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        n_slots=2,
        max_seq_len=1024,
        log_dir=str(tmp_path_factory.mktemp("logs-loadgen")),
    )
    with Stack(cfg) as st:
        yield st


@pytest.mark.timeout(300)
def test_aiperf_through_the_openai_api(stack, target_dir, tmp_path):
    cfg = stack.cfg
    finished = lambda: _total(_samples(cfg.metrics_port), "flashmap_requests_total")
    before = finished()
    out = tmp_path / "loadgen.md"
    cells = loadgen.main(
        [
            "--url", f"http://{cfg.host}:{cfg.http_port}",
            "--tokenizer", str(target_dir),
            "--concurrency", str(CONCURRENCY),
            "--requests", str(REQUESTS),
            "--input-tokens", "16",
            "--max-new-tokens", str(NEW_TOKENS),
            "--metrics-url", f"http://{cfg.host}:{cfg.metrics_port}/metrics",
            "--artifacts", str(tmp_path / "artifacts"),
            "--out", str(out),
        ]
    )  # fmt: skip
    assert [(c["endpoint"], c["concurrency"]) for c in cells] == [
        ("chat", CONCURRENCY),
        ("completions", CONCURRENCY),
    ]
    for c in cells:
        assert c["requests"] == REQUESTS and c["errors"] == 0, c
        assert c["output_tokens"] == NEW_TOKENS, c  # ignore_eos: every request ran to the end
        assert c["input_tokens"] > 0 and c["output_tokens_per_s"] > 0 and c["requests_per_s"] > 0
        # A response may come in one chunk (the stack streams what a round commits): ITL >= 0.
        assert 0 < c["ttft_ms_p50"] <= c["latency_ms_p50"] and c["itl_ms_p50"] >= 0, c
        assert c["drafts"] >= 0
    # Each run's warmup and its requests reached the orchestrator and finished there.
    assert finished() - before == 2 * (CONCURRENCY + REQUESTS)

    report = out.read_text()
    assert f"| chat | {CONCURRENCY} | {REQUESTS} (0) |" in report
    assert f"| completions | {CONCURRENCY} | {REQUESTS} (0) |" in report
    assert "aiperf profile --url" in report and "Command: `python -m bench.loadgen" in report
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(json.dumps(cells))
