"""bench.bench_drafters on the committed demo checkpoints: one prompt, a few tokens."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file(),
                    reason="demo checkpoints not present")
def test_paired_benchmark_writes_a_table(tmp_path):
    from bench import bench_drafters

    out = tmp_path / "bench.md"
    argv = ["--target", str(REPO / "checkpoints" / "demo-target"), "--methods",
            f"fm:{REPO / 'checkpoints' / 'demo-flashmap'}", f"df:{REPO / 'checkpoints' / 'demo-dflash'}:1",
            "--prompts", "1", "--max-new-tokens", "6", "--repeats", "2", "--threads", "1", "--out", str(out)]
    assert bench_drafters.main(argv) == 0
    text = out.read_text()
    assert "| target alone | - |" in text and "| fm |" in text and "| df |" in text
    assert bench_drafters.main([*argv, "--append", "--domain", "math"]) == 0
    assert out.read_text().count("## ") == 2
