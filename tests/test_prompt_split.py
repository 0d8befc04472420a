"""The held-out split (flashmap.prompts): dev prompts for everything that chooses, test prompts
for reports, and no path that chooses can read test data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from flashmap.prompts import DEV_PROMPTS, TEST_PROMPTS, for_choosing, prompt_split

REPO = Path(__file__).resolve().parent.parent


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_the_split_is_fixed_disjoint_and_marked():
    """The two files in the repository are what demo.corpus writes (the corpus the demo target
    was trained on), every line says its split, and no prompt is in both."""
    from demo.corpus import build_corpus, write_prompt_splits

    dev, test = _records(DEV_PROMPTS), _records(TEST_PROMPTS)
    assert {r["split"] for r in dev} == {"dev"} and {r["split"] for r in test} == {"test"}
    assert not {r["prompt"] for r in dev} & {r["prompt"] for r in test}
    for domain in ("code", "math", "chat"):
        assert sum(r["domain"] == domain for r in test) >= 40
    assert prompt_split(DEV_PROMPTS) == "dev" and prompt_split(TEST_PROMPTS) == "test"


@pytest.mark.slow
def test_the_corpus_writes_the_committed_split(tmp_path):
    from demo.corpus import build_corpus, write_prompt_splits

    d, t = write_prompt_splits(build_corpus(0), tmp_path / "dev.jsonl", tmp_path / "test.jsonl")
    assert d.read_text() == DEV_PROMPTS.read_text() and t.read_text() == TEST_PROMPTS.read_text()


def test_the_rule_refuses_test_data_to_choices():
    for split in ("test", "mixed:dev+test"):
        with pytest.raises(ValueError, match="test prompts"):
            for_choosing(split, "a check")
    for split in ("dev", "train", ""):
        for_choosing(split, "a check")


@pytest.fixture(scope="module")
def test_data(tmp_path_factory):
    """Drafter data made (training.drafter_data's command) from a prompt file of the test split:
    its meta.json carries the split."""
    from target_service.random_checkpoint import make_random_qwen3
    from training import drafter_data as dd

    root = tmp_path_factory.mktemp("split")
    target = make_random_qwen3(root / "target", with_tokenizer=False, seed=1)
    rng = np.random.default_rng(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt_ids": rng.integers(3, 400, 6).tolist(), "split": "test"}) + "\n"
            for _ in range(4)
        )
    )
    out = root / "data"
    args = ["--target", str(target), "--prompts", str(prompts), "--out", str(out)]
    assert dd.main([*args, "--max-new-tokens", "24", "--chunk-size", "4"]) == 0
    assert dd.read_meta(out)["split"] == "test"
    return target, out


@pytest.mark.slow
def test_paths_that_choose_refuse_test_data(test_data, capsys):
    """The flow stage's check and the acceptance check of training, and the research curves
    that pick settings, stop with the rule's message on data of the test prompts."""
    from research.map_fidelity import flow_check_draw
    from training import train_drafter as td
    from training.acceptance_check import heldout_from

    target, data = test_data
    common = ["--target", str(target), "--data", str(data), "--small", "--no-progress"]
    for extra in (["--check-data", str(data)], ["--accept-data", str(data), "--accept-every", "1"]):
        code = td.main(
            ["--stage", "flow", "--out", str(data.parent / "run"), "--steps", "1", *common, *extra]
        )
        assert code == 2 and "test prompts" in capsys.readouterr().err
    with pytest.raises(ValueError, match="test prompts"):
        heldout_from(data, None, 2, 16)
    with pytest.raises(ValueError, match="test prompts"):
        flow_check_draw(str(data), 1, 16, choosing=True)
    assert flow_check_draw(str(data), 1, 16)  # a report may read them


def test_only_report_tools_name_the_test_prompts():
    """Outside the tests, the modules that name the test prompts are the reports: flashmap eval,
    the benchmarks, the research reports; none of training's choosing paths does."""
    named = set()
    for path in REPO.glob("*/**/*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", ".venv"):
            continue
        if re.search(r"TEST_PROMPTS|test_prompts\.jsonl", path.read_text()):
            named.add(rel.as_posix())
    allowed = {
        "flashmap/prompts.py",
        "demo/corpus.py",
        "demo/__init__.py",
        "demo/drafter_prompts.py",
        "demo/target_data.py",  # writes the split
        "demo/train_target.py",
        "training/evaluate.py",
        "training/flow_diagnostics.py",
        "training/tree_report.py",
        "bench/drafters.py",
        "bench/stack_paths.py",
        "research/bound.py",
        "research/mode_probe.py",
        "research/siblings_check.py",
    }
    assert named <= allowed, sorted(named - allowed)
