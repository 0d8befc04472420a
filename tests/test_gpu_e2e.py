"""bench/gpu_e2e.py, the GPU end-to-end benchmark, at tiny sizes on the CPU (--smoke): the real
tool in a subprocess, real decode loops. Its speed is not asserted (a CPU smoke run makes no
speed claim); what it measures and reports is."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
K = 16
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_e2e")
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu_e2e", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads((out / "gpu_e2e.json").read_text()), out, p.stdout


@pytest.mark.slow
def test_every_row_is_measured(smoke):
    report, _, _ = smoke
    assert report["errors"] == {}
    cfg = report["config"]
    want = {("target", 0), ("oracle", 0), ("dflash", 0), ("eagle3", 0)}
    want |= {("flashmap", s) for s in cfg["jumps"]}
    got = {(r["kind"], r["steps"], r["batch"]) for r in report["rows"]}
    assert got == {(k, s, b) for k, s in want for b in cfg["batches"]} and cfg["jumps"] == [1, 2]
    for r in report["rows"]:
        b, name = r["batch"], (r["kind"], r["steps"], r["batch"])
        assert "skipped" not in r and "error" not in r and "kernels_error" not in r, (name, r)
        assert r["tokens"] == b * cfg["max_new_tokens"], name  # every request ran to the end
        assert r["rounds"] > 0 and r["wall_ms_per_round"] > 0, name
        assert r["kernels_ms_per_round"] > 0 and r["ratio"] > 0, name
        assert r["host_ms_per_round"] == pytest.approx(
            r["wall_ms_per_round"] - r["kernels_ms_per_round"], abs=1e-3
        )
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0, name
        # the host's work over steady-state rounds: ops dispatched, copies, scalar reads
        assert r["counted_rounds"] > 0 and r["ops_per_round"] > 0, name
        for key in ("aten_h2d_per_round", "aten_d2h_per_round", "scalar_reads_per_round"):
            assert r[key] >= 0, (name, key)
        if r["kind"] == "target":
            assert r["rounds"] == cfg["max_new_tokens"] - 1 and set(r["kernels"]) == {"step"}
            assert r["speedup"] == 1.0
        if r["kind"] in ("flashmap", "dflash", "eagle3"):  # drafters with their own graphs
            assert set(r["kernels"]) == {"verify17", "drafter"}
            assert r["drafts"] > 0 and r["draft_call_ms_per_round"] > 0


@pytest.mark.slow
def test_oracle_is_accepted_in_full_and_outputs_equal_the_target_alone(smoke):
    report, _, _ = smoke
    new = report["config"]["max_new_tokens"]
    for r in report["rows"]:
        b = r["batch"]
        if r["kind"] == "target":
            continue
        assert r["outputs_equal_target"] == [b, b], r  # exact: every drafter row
        if r["kind"] == "oracle":
            assert r["outputs_equal_reference"] == [b, b]
            # every drafted token accepted: K + 1 tokens a round, the last round shorter
            assert r["accepted_in_full"] and r["accepted"] == r["draft_tokens"]
            assert r["rounds"] == -(-(new - 1) // (K + 1))
            assert r["accepted"] >= K * (r["drafts"] - b)
            assert r["mean_acceptance_length"] == pytest.approx(1 + r["accepted"] / r["drafts"])
            if (new - 1) % (K + 1) == 0:  # the smoke run's length: every round K + 1 tokens
                assert r["mean_acceptance_length"] == K + 1


@pytest.mark.slow
def test_report_files_and_table(smoke):
    report, out, stdout = smoke
    md = (out / "gpu_e2e.md").read_text()
    assert md.startswith("# Whole decode loop (bench.gpu_e2e), CPU smoke run")
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(report["rows"])  # header + one line per row
    assert "Command: `python -m bench.gpu_e2e --smoke --out" in md and "Machine:" in md
    assert report["machine"] and report["env"]["device"] == "cpu"
    assert report["table"][0] in stdout  # the table is printed last
    assert (out / "gpu_e2e.log").read_text().count("\n") > 5


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without a GPU"
)
def test_without_a_gpu_it_says_so():
    p = subprocess.run(
        [sys.executable, "bench/gpu_e2e.py"],  # the script form
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2 and "no CUDA device" in p.stdout and "--smoke" in p.stdout
