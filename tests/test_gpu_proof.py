"""scripts/gpu-proof.sh, the one-command GPU proof, in its CPU smoke run (--smoke): every section
(kernels and exactness, whole decode loops, the served stack with real Triton, torchrun
training) at tiny shapes, into one report with its JSON. Its speed is not asserted (a CPU smoke
run makes no speed claim); that every section ran and reported its numbers is. Also the wheel
plan the script installs from on a machine without a network."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_proof_wheels

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["wheels", "a", "b", "world", "c", "d-data", "d-flow", "d-distill"]


@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    out, tmp = tmp_path_factory.mktemp("proof"), tmp_path_factory.mktemp("tmp")
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHON=sys.executable)
    p = subprocess.run(
        ["bash", "scripts/gpu-proof.sh", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    return json.loads((out / "gpu_proof.json").read_text()), out, tmp, p.stdout


@pytest.mark.timeout(900)
def test_every_section_ran_and_the_work_directory_is_gone(proof):
    report, out, tmp, _ = proof
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_proof.json",
        "gpu_proof.log",
        "gpu_proof.md",
    ]
    assert [s["name"] for s in report["sections"]] == SECTIONS
    for s in report["sections"]:
        assert s["status"] == "passed" and s["rc"] == 0 and s["log_tail"] == [], s
        assert 0 <= s["seconds"] <= s["cap_s"] and s["command"], s
    assert list(tmp.glob("gpu-proof.*")) == []  # the script's own work directory is removed
    assert report["smoke"] and report["device"] == "CPU (smoke run)" and report["commit"]


def test_every_target_has_its_number(proof):
    report, _, _, _ = proof
    names = [t["target"] for t in report["targets"]]
    assert len(names) == 16 and len(set(names)) == 16
    for t in report["targets"]:
        assert isinstance(t["value"], float) and t["value"] > 0, t
        assert t["met"] in (True, False) and t["section"] in "abc"


def test_the_sections_numbers(proof):
    report, _, _, _ = proof
    a, b, c, d = report["a"], report["b"], report["c"], report["d"]
    # a: kernels and exactness
    assert a["target"]["floor_ms"] > 0 and a["target"]["graph"]["verify17 b=16"]["ms"] > 0
    for dt in ("fp32", "bf16"):
        e = a[f"exactness_{dt}"]
        assert e["graph_vs_eager"]["argmax_equal"] == "10/10"
        assert e["invariant_verify17_vs_17_steps"]["features_bitwise_equal"] is True
    # b: every drafter at every batch, its output the target alone's
    assert b["errors"] == {}
    kinds = {(r["kind"], r["steps"]) for r in b["rows"]}
    assert kinds == {
        ("target", 0),
        ("oracle", 0),
        ("flashmap", 1),
        ("flashmap", 2),
        ("dflash", 0),
        ("eagle3", 0),
    }
    for r in b["rows"]:
        assert r["ratio"] > 0 and r["ops_per_round"] > 0, r
        if r["kind"] != "target":
            assert r["outputs_equal_target"] == [r["batch"], r["batch"]], r
    # c: the stack against the in-process loop, at both concurrencies, the same acceptance
    assert "skipped" not in c and "error" not in c and sorted(c["cells"]) == ["1", "2"]
    for cell in c["cells"].values():
        for path, row in cell.items():
            n = row["outputs_equal_target"][1]
            assert row["tok_s"] > 0 and row["outputs_equal_target"] == [n, n], (path, row)
        for drafter in ("flashmap", "oracle"):
            served = cell[f"{drafter}-stack"]
            assert served["over_in_process"] > 0 and served["rounds"] > 0
            assert all(v >= 0 for v in served["split_ms"].values())
            assert served["split_ms"]["round_ms"] > 0 and served["split_ms"]["verify_ms"] > 0
        assert cell["oracle"]["acceptance"] == cell["oracle-stack"]["acceptance"] > 1
    # d: the flow stage and distillation under torchrun
    assert [r["stage"] for r in d] == ["flow", "distill"]
    for r in d:
        assert r["steps_timed"] >= 2 and r["step_s"] > 0 and r["tokens_per_s"] > 0, r
        assert r["peak_gb"] > 0 and r["estimate_step_s"] > 0, r


def test_the_markdown_report(proof):
    report, out, _, stdout = proof
    md = (out / "gpu_proof.md").read_text()
    assert md.startswith("# GPU proof: CPU smoke run")
    for head in ("## Targets", "## Sections", "## a.", "## b.", "## c.", "## d."):
        assert f"\n{head}" in md, head
    assert md.count("n/a (smoke)") == len(report["targets"])
    assert "`.venv/bin/python" in md or f"`{sys.executable}" in md  # each section's command
    assert "DFlash (published layout)" in md and "EAGLE-3 (tree of 16)" in md
    assert "| 1 | flashmap |" in md  # the stack's per-round split
    log = (out / "gpu_proof.log").read_text()
    assert all(f"section {s}" in log for s in SECTIONS) and md.splitlines()[0] in stdout


def _wheel(folder: Path, name: str, version: str, tag: str, requires=()) -> Path:
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-{tag}.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{dist}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}",
        )
    return path


def test_the_wheel_plan(tmp_path):
    """What is missing comes from the folder with what it needs; what is installed stays; a wheel
    for another Python is named, a requirement nothing satisfies too."""
    top = _wheel(
        tmp_path,
        "flashmap-proof-top",
        "1.0",
        "py3-none-any",
        ["flashmap-proof-dep>=2", "numpy>=1", 'x-extra; extra == "more"'],
    )
    dep = _wheel(tmp_path, "flashmap-proof-dep", "2.1", "py3-none-any")
    _wheel(tmp_path, "flashmap-proof-old", "1.0", "cp27-cp27mu-manylinux1_x86_64")
    paths, unmet, foreign = gpu_proof_wheels.plan(
        tmp_path, ["flashmap-proof-top", "flashmap-proof-old", "flashmap-proof-none>=1"]
    )
    assert sorted(paths) == sorted([top, dep])  # numpy is installed: not taken
    assert foreign == ["flashmap_proof_old-1.0-cp27-cp27mu-manylinux1_x86_64.whl"]
    assert len(unmet) == 1 and unmet[0].startswith("flashmap-proof-none>=1 (installed: none")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_proof_wheels",
            "install",
            "--wheels",
            str(tmp_path),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0 and "every requirement is installed already" in p.stdout
