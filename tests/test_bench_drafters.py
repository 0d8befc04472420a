"""bench.bench_drafters on the committed demo checkpoints: one prompt, a few tokens."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    not (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file(),
    reason="demo checkpoints not present",
)
def test_paired_benchmark_writes_a_table(tmp_path):
    from bench import bench_drafters

    out = tmp_path / "bench.md"
    argv = [
        "--target",
        str(REPO / "checkpoints" / "demo-target"),
        "--methods",
        f"fm:{REPO / 'checkpoints' / 'demo-flashmap'}",
        f"df:{REPO / 'checkpoints' / 'demo-dflash'}:1",
        "--prompts",
        "1",
        "--max-new-tokens",
        "6",
        "--repeats",
        "2",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert bench_drafters.main(argv) == 0
    text = out.read_text()
    assert "| target alone | - |" in text and "| fm |" in text and "| df |" in text
    assert bench_drafters.main([*argv, "--append", "--domain", "math"]) == 0
    assert out.read_text().count("## ") == 2


def test_phase_plot_reads_the_committed_tables(tmp_path):
    from bench import plot_phase

    md = (REPO / "docs" / "results" / "bench_drafters.md").read_text()
    tables = plot_phase.phase_tables(md)
    assert len(tables) == 2 and all(len(t) >= 4 for t in tables)
    assert all(3 < ms < 8 and (cut is None or 1 < cut < 3) for t in tables for ms, _, cut in t)
    copy = tmp_path / "bench_drafters.md"
    copy.write_text(md)
    assert plot_phase.main(["--md", str(copy)]) == 0
    assert (tmp_path / "bench_phase.png").stat().st_size > 10_000
