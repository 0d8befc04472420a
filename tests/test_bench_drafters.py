"""bench.drafters on the committed demo checkpoints and on oracle drafters (one or two prompts,
a few tokens): a section per run, paired speedups with their intervals, appended runs; and
bench.param_count and bench.verify_cost writing their reports."""

from pathlib import Path

import pytest

from bench import drafters

REPO = Path(__file__).resolve().parent.parent
DEMO = (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file()


def test_method_specs():
    assert drafters.parse_method("fm:checkpoints/x") == ("fm", "checkpoints/x", 1, 0.0)
    assert drafters.parse_method("fm2:init:2:0.2") == ("fm2", "init", 2, 0.2)
    assert drafters.parse_method("o:oracle@0.15") == ("o", "oracle@0.15", 1, 0.0)


@pytest.mark.skipif(not DEMO, reason="demo checkpoints not present")
def test_paired_benchmark_writes_a_section_per_run(tmp_path):
    out = tmp_path / "bench.md"
    argv = [
        *("--target", str(REPO / "checkpoints" / "demo-target")),
        *("--methods", f"fm:{REPO / 'checkpoints' / 'demo-flashmap'}"),
        *("--prompts", "1", "--max-new-tokens", "6", "--repeats", "2", "--threads", "1"),
        *("--out", str(out)),
    ]
    assert drafters.main(argv) == 0
    text = out.read_text()
    assert text.startswith(drafters.TITLE + "\n\n## code, T = 0 (")
    table = text.split("\n\n")[2]  # the section's table comes first
    assert table.startswith("| method | gamma | tokens/s | speedup [95% CI] |")
    assert "| target alone | - |" in table and "| fm | " in table
    assert "Command: `python -m bench.drafters --target " in text
    oracle = [
        *("--domain", "random", "--methods", "perfect:oracle@0", "noisy:oracle@0.5"),
        *("--prompts", "2", "--max-new-tokens", "12", "--repeats", "1", "--threads", "1"),
        *("--out", str(out), "--append"),
    ]
    assert drafters.main(oracle) == 0
    text = out.read_text()
    assert text.count("\n## ") == 2 and "## random, T = 0 (" in text
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in text.split("## random")[1].splitlines()
        if line.startswith("| ") and not line.startswith("| method")
    }
    # The oracle with no errors accepts whole blocks; with errors in half the slots, fewer.
    assert float(rows["perfect"][0]) > float(rows["noisy"][0]) > 1.0
    assert rows["perfect"][2].strip().endswith("]x")  # a speedup with its interval


def test_param_count_report_has_its_table_first(tmp_path):
    from bench import param_count

    out = tmp_path / "params.md"
    assert param_count.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert text.split("\n\n")[1].startswith("| component | FlashMap | DFlash-style |")
    assert "| **trainable total** |" in text and "## Why these numbers" in text
    assert "Command: `python -m bench.param_count --out " in text


def test_verify_cost_report_has_a_row_per_mix(tmp_path):
    from bench import verify_cost

    out = tmp_path / "verify.md"
    argv = ["--rows", "6", "--context", "20", "--prompt", "24", "--repeats", "1", "--threads", "1"]
    assert verify_cost.main([*argv, "--out", str(out)]) == 0
    table = out.read_text().split("\n\n")[1].splitlines()
    assert table[0] == "| rows | tokens | packed ms | padded ms | padded / packed |"
    assert len(table) == 2 + 9 and "| prompt 24 + 5 x 1 | 29 |" in table[7]
    assert all(float(x) > 0 for row in table[2:] for x in row.strip(" |").split("|")[2:])
