"""bench.bench_stack: the paired-ratio interval, and a tiny run on the committed demo checkpoints
(a real stack) that writes its report, its cells and its plot, then resumes from the cells;
bench.pairing: a tiny run of two designs that resumes too."""

import os
from pathlib import Path

import numpy as np
import pytest

from bench import bench_stack

REPO = Path(__file__).resolve().parent.parent


def test_ratio_interval_is_a_t_interval_on_the_logs():
    g, lo, hi = bench_stack.ratio_ci([1.0, 1.0, 1.0])
    assert (g, lo, hi) == pytest.approx((1.0, 1.0, 1.0))
    g, lo, hi = bench_stack.ratio_ci([0.5, 2.0])
    assert g == pytest.approx(1.0) and lo * hi == pytest.approx(1.0)  # mirrored in log space
    half = 12.706 * np.std(np.log([0.5, 2.0]), ddof=1) / np.sqrt(2)  # t(0.975, 1 d.o.f.)
    assert hi == pytest.approx(np.exp(half), rel=1e-3)
    g, lo, hi = bench_stack.ratio_ci([0.9, 0.95, 1.0, 0.92])
    assert lo < g < hi and g == pytest.approx(np.exp(np.mean(np.log([0.9, 0.95, 1.0, 0.92]))))
    assert np.isnan(bench_stack.ratio_ci([1.1])[1])
    assert bench_stack.fmt_ci((0.97, 0.9, 1.05)) == "0.97 [0.90, 1.05]"


def test_chunks_are_whole_batches_covering_every_prompt_once():
    prompts = list(range(64))
    for c, n, sizes in (
        (1, 4, [16] * 4),
        (16, 4, [16] * 4),
        (32, 4, [32, 32]),
        (4, 3, [24, 24, 16]),
        (5, 4, [20, 20, 20, 4]),
        (64, 4, [64]),
        (1, 1, [64]),
    ):
        parts = bench_stack.chunks_of(prompts, c, n)
        assert [len(p) for p in parts] == sizes, (c, n)
        assert [x for p in parts for x in p] == prompts
        assert all(len(p) % c == 0 for p in parts[:-1])


@pytest.mark.skipif(
    not (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file(),
    reason="demo checkpoints not present",
)
def test_a_tiny_run_reports_and_resumes(tmp_path, capsys):
    out = tmp_path / "bench.md"
    argv = [
        "--concurrency",
        "1,2",
        "--max-new-tokens",
        "4",
        "--repeats",
        "2",
        "--prompts",
        "2",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    bench_stack.main(argv)
    text = out.read_text()
    assert "| random ids | 2 |" in text and "| held-out text | 1 |" in text
    assert out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".json").is_file()
    parts = text.split("The parts of auto / target alone")[1]
    row = next(
        line for line in parts.splitlines() if line.startswith("| random ids | 2 | ")
    )  # each step's ratio
    idle = [
        float(x) for x in row.strip(" |").split("|")[-1].split("/")
    ]  # target idle per batch: Triton, off, auto
    assert len(idle) == 3 and all(x >= 0 for x in idle)
    capsys.readouterr()
    notes = f"{bench_stack.NOTES_MARKER}\n\nReading. What a person wrote about the run.\n"
    out.write_text(text + "\n" + notes)
    bench_stack.main(argv)  # every cell saved: no stack starts, the same table comes back
    assert "4 cells from" in capsys.readouterr().out
    again = out.read_text()
    assert again.split("\n\n")[1] == text.split("\n\n")[1]
    assert again.endswith(notes) and again.count(bench_stack.NOTES_MARKER) == 1


@pytest.mark.skipif(
    not (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file(),
    reason="demo checkpoints not present",
)
def test_pairing_designs_report_and_resume(tmp_path, capsys):
    """bench.pairing: two designs on one real stack (2 requests at a time), every path's ratio
    per pass and over all, then a second call that only reads what was saved."""
    from bench import pairing

    out = tmp_path / "pairing.md"
    argv = [
        "--designs",
        "ip,off/ip,ipk,tr",
        "--passes",
        "1",
        "--concurrency",
        "2",
        "--prompts",
        "4",
        "--chunks",
        "2",
        "--max-new-tokens",
        "4",
        "--slots",
        "2",
        "--out",
        str(out),
    ]
    pairing.main(argv)
    assert not _children_running(
        "orchestrator.server"
    )  # the extra orchestrator stopped with its stack
    text = out.read_text()
    for design, path in (("ip,off", "off"), ("ip,ipk,tr", "ipk"), ("ip,ipk,tr", "tr")):
        assert f"| {design} | {path} | 0 | " in text and f"| {design} | {path} | all | " in text
    capsys.readouterr()
    pairing.main(argv)
    assert "2 design passes saved, 0 to run" in capsys.readouterr().out
    assert out.read_text().split("Date:")[0] == text.split("Date:")[0]
    with pytest.raises(SystemExit):
        pairing.main(["--designs", "tr,ip", "--out", str(out)])


def _children_running(module: str) -> list[int]:
    """Pids of this process's live children whose command line runs `module`."""
    me, found = os.getpid(), []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and module.encode() in cmd:
            found.append(int(d.name))
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_handoff_times_pings_between_two_cpus(capsys):
    """bench.handoff: every ping is timed (one-way, positive, below a second), the report has a
    row per case, and this process runs on its CPUs as before."""
    from bench import handoff

    before = os.sched_getaffinity(0)
    x = handoff.pings(20, 0.0)
    assert x.shape == (20,) and (x > 0).all() and (x < 1e6).all()
    handoff.main(["--pings", "10", "--gaps", "0,1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.count("| 0 | ") == 2 and out.count("| 1 | ") == 2
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.skipif(
    not (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file(),
    reason="demo checkpoints not present",
)
def test_drafter_cpus_moves_the_forward_and_reports_both_places(capsys):
    """bench.drafter_cpus on a real stack: both modes on both CPU sets, outputs checked against
    the target alone (the script asserts it), a row per mode and place and a ratio per mode."""
    from bench import drafter_cpus

    assert drafter_cpus.main(["--prompts", "2", "--chunks", "2", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    for mode in ("full", "auto"):
        assert f"| {mode} | services | " in out and f"| {mode} | every | " in out
        assert f"| {mode} | " in out.split("every CPU / services' CPUs")[1]
    assert not _children_running("orchestrator.server")
