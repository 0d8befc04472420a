"""bench.common's statistics, and bench.stack: its chunks, and a tiny run on the committed demo
checkpoints (a real stack) that writes its report, its cells and its plot, then resumes from
the cells and keeps a reader's notes."""

import os
from pathlib import Path

import numpy as np
import pytest

from bench import common, stack
from bench.stack_paths import chunks_of, prompt_sets
from flashmap.prompts import TEST_PROMPTS, read_domain_prompts

REPO = Path(__file__).resolve().parent.parent
DEMO = (REPO / "checkpoints" / "demo-flashmap" / "model.safetensors").is_file()


def test_ratio_interval_is_a_t_interval_on_the_logs():
    g, lo, hi = common.ratio_ci([1.0, 1.0, 1.0])
    assert (g, lo, hi) == pytest.approx((1.0, 1.0, 1.0))
    g, lo, hi = common.ratio_ci([0.5, 2.0])
    assert g == pytest.approx(1.0) and lo * hi == pytest.approx(1.0)  # mirrored in log space
    half = 12.706 * np.std(np.log([0.5, 2.0]), ddof=1) / np.sqrt(2)  # t(0.975, 1 d.o.f.)
    assert hi == pytest.approx(np.exp(half), rel=1e-3)
    g, lo, hi = common.ratio_ci([0.9, 0.95, 1.0, 0.92])
    assert lo < g < hi and g == pytest.approx(np.exp(np.mean(np.log([0.9, 0.95, 1.0, 0.92]))))
    assert np.isnan(common.ratio_ci([1.1])[1])
    assert common.fmt_ci((0.97, 0.9, 1.05)) == "0.97 [0.90, 1.05]"
    assert common.fmt_ci((0.97, float("nan"), float("nan"))) == "0.97"


def test_bootstrap_ratio_of_sums_resamples_pairs():
    base = np.array([1.0, 2.0, 3.0, 4.0])
    r, lo, hi = common.bootstrap_ratio(base * 1.5, base)  # the same ratio in every pair
    assert (r, lo, hi) == pytest.approx((1.5, 1.5, 1.5))
    rng = np.random.default_rng(1)
    num = rng.uniform(1, 2, 40)
    den = num / rng.uniform(1.2, 1.8, 40)
    r, lo, hi = common.bootstrap_ratio(num, den)
    assert r == pytest.approx(num.sum() / den.sum()) and 1.2 < lo < r < hi < 1.8
    assert np.isnan(common.bootstrap_ratio([2.0], [1.0])[1])


def test_shared_options_and_the_report_layout(tmp_path):
    import argparse

    ap = argparse.ArgumentParser()
    common.add_options(ap, target=None, max_new_tokens=5, out=tmp_path / "r.md")
    a = ap.parse_args(["--max-new-tokens", "7"])
    assert (a.target, a.max_new_tokens, a.out) == (None, 7, tmp_path / "r.md")
    with pytest.raises(SystemExit):
        ap.parse_args(["--repeats", "2"])  # not picked by this tool
    out = tmp_path / "r.md"
    common.write_report(out, "T", ["| a |", "|---|", "| 1 |"], "About.", "bench.x", ["--y", "a b"])
    text = out.read_text()
    assert text.startswith("# T\n\n| a |")  # the table first
    assert "Command: `python -m bench.x --y 'a b'`. Date: " in text and "Machine: " in text
    out.write_text(text + f"\n{common.NOTES_MARKER}\n\nA reading.\n")
    common.write_report(out, "T", ["| a |", "|---|", "| 2 |"], "About.", "bench.x", [])
    again = out.read_text()
    assert "| 2 |" in again and again.endswith("A reading.\n")
    assert again.count(common.NOTES_MARKER) == 1


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
        parts = chunks_of(prompts, c, n)
        assert [len(p) for p in parts] == sizes, (c, n)
        assert [x for p in parts for x in p] == prompts
        assert all(len(p) % c == 0 for p in parts[:-1])


@pytest.mark.skipif(not DEMO, reason="demo checkpoints not present")
def test_held_out_text_takes_the_domains_in_turn():
    """The held-out file lists one domain after another: the first n prompts alone would be code."""
    target = REPO / "checkpoints" / "demo-target"
    domain = {tuple(p["ids"]): p["domain"] for p in read_domain_prompts(TEST_PROMPTS, target)}
    text = prompt_sets(str(target), 100, 9)["test-prompt text"]
    assert [domain[tuple(ids)] for ids in text] == ["code", "math", "chat"] * 3


def test_modes_must_include_the_baseline(tmp_path):
    for modes in ("off,auto", "target,warp"):
        with pytest.raises(SystemExit):
            stack.main(["--modes", modes, "--out", str(tmp_path / "x.md")])


@pytest.mark.skipif(not DEMO, reason="demo checkpoints not present")
@pytest.mark.stack
def test_a_tiny_run_reports_and_resumes(tmp_path, capsys):
    out = tmp_path / "bench.md"
    argv = [
        *("--concurrency", "1,2", "--max-new-tokens", "4", "--repeats", "2"),
        *("--prompts", "2", "--threads", "1", "--out", str(out)),
    ]
    assert stack.main(argv) == 0
    assert not _children_running("orchestrator.server")  # both orchestrators stopped
    text = out.read_text()
    head = text.split("\n\n")[1]  # the first table, right under the title
    assert head.startswith("| prompts | concurrency | target alone (in process) |")
    for name in ("random ids", "test-prompt text"):
        assert f"| {name} | 1 |" in head and f"| {name} | 2 |" in head
    ratios = text.split("Paired ratios")[1].split("\n\n")[1]
    assert "| auto / target | " in ratios.splitlines()[0] and "auto / max(off, full)" in ratios
    row = next(x for x in text.splitlines() if x.startswith("| random ids | 2 | ") and "/" in x)
    idle = [float(v) for v in row.strip(" |").split("|")[-1].split("/")]  # Triton, off, auto
    assert len(idle) == 3 and all(v >= 0 for v in idle)
    assert "| test-prompt text | full | " in text  # the per-round split
    assert out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".json").is_file()
    assert "Command: `python -m bench.stack --concurrency 1,2 " in text
    capsys.readouterr()
    notes = f"{common.NOTES_MARKER}\n\nReading. What a person wrote about the run.\n"
    out.write_text(text + "\n" + notes)
    assert stack.main(argv) == 0  # every cell saved: no stack starts, the same tables come back
    assert "4 cells from" in capsys.readouterr().out
    again = out.read_text()
    assert again.split("Command:")[0] == text.split("Command:")[0]
    assert again.endswith(notes) and again.count(common.NOTES_MARKER) == 1


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
