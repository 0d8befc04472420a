"""training.tree_report: the tree and the single draft are chosen on dev cells, judged on test."""

import pytest

from training.tree_report import dev_best, tree_row, write

pytestmark = pytest.mark.unit


def cell(accepted: list[int], drafts: list[int]) -> dict:
    a, d = sum(accepted), sum(drafts)
    g = 1 + a / d
    return dict(
        accepted=a, drafts=d, draft_tokens=16 * d, gamma=g, gamma_ci=[g, g], speedup=1.0,
        speedup_ci=[1.0, 1.0],
        prompt_accepted=accepted, prompt_drafts=drafts,
    )  # fmt: skip


def test_the_choice_reads_dev_and_the_report_judges_it_on_test(tmp_path):
    # On dev the 4-block tree and DFlash-style lead; on test the 8-block tree would: the report
    # must still set the dev choice against its single draft.
    dev = {
        "flashmap-tree4|code|T=1": cell([9, 9], [10, 10]),
        "flashmap-tree8|code|T=1": cell([5, 5], [10, 10]),
        "flashmap-1|code|T=1": cell([2, 2], [10, 10]),
        "dflash|code|T=1": cell([4, 4], [10, 10]),
    }
    test = {
        "flashmap-tree4|code|T=1": cell([6, 6, 6], [10, 10, 10]),
        "flashmap-tree8|code|T=1": cell([9, 9, 9], [10, 10, 10]),
        "flashmap-1|code|T=1": cell([3, 3, 3], [10, 10, 10]),
        "dflash|code|T=1": cell([2, 2, 2], [10, 10, 10]),
    }
    assert dev_best(dev, 1.0) == ("flashmap-tree4", "dflash")
    text = write(test, tmp_path / "trees.md", "cmd", dev).read_text()
    assert "the tree `flashmap-tree4` and the single draft `dflash`" in text
    assert "| code | 1.60 | 1.20 | +0.40 [+0.40, +0.40] |" in text
    assert "![gamma difference by domain](trees_choice.png)" in text
    assert (tmp_path / "trees_choice.png").stat().st_size > 1000


def test_eval_pairs_pools_the_domains_and_pairs_the_prompts(tmp_path):
    from training.eval_pairs import paired, table

    a = {
        "x|code|T=0": cell([4, 4], [2, 2]),  # gamma 3
        "x|math|T=0": cell([2, 2], [2, 2]),  # gamma 2
        "y|code|T=0": cell([2, 2], [2, 2]),
        "y|math|T=0": cell([2, 2], [2, 2]),
    }
    r = paired([a["x|code|T=0"], a["x|math|T=0"]], [a["y|code|T=0"], a["y|math|T=0"]])
    assert (r["a"], r["b"], r["diff"]) == (2.5, 2.0, 0.5)
    lines = table(a, ["x:y"], [0.0])
    assert lines[-1].startswith("| x | y | 0 | +1.00 [+1.00, +1.00] | +0.00")
    with pytest.raises(ValueError, match="different prompts"):
        paired([a["x|code|T=0"]], [cell([1], [1])])


def test_rows_with_siblings_and_another_support_meet_their_own_single_draft(tmp_path):
    assert tree_row("flashmap-1") is None and tree_row("eagle3-chain16-m16") is None
    assert tree_row("dflash-tree4-rejection") == ("DFlash-style", "dflash", 4, "rejection")
    assert tree_row("eagle3-tree16") == ("EAGLE-3", "eagle3-chain16", 16, "pick")
    assert tree_row("eagle3-siblings-m16") == (
        "EAGLE-3",
        "eagle3-chain16-m16",
        1,
        "rejection + siblings (top 16)",
    )
    # a single draft with a wider support is a single draft the choice may pick
    dev = {
        "eagle3-siblings-m16|code|T=1": cell([9, 9], [10, 10]),
        "eagle3-chain16-m16|code|T=1": cell([5, 5], [10, 10]),
        "eagle3-chain16|code|T=1": cell([4, 4], [10, 10]),
    }
    assert dev_best(dev, 1.0) == ("eagle3-siblings-m16", "eagle3-chain16-m16")
    text = write(dev, tmp_path / "trees.md", "cmd", dev).read_text()
    assert (
        "| code | EAGLE-3 | 1 | rejection + siblings (top 16) | 1.90 [1.90, 1.90] | +0.40" in text
    )


def test_the_h200_projection_prices_a_wide_verify_off_the_measured_line():
    from training.tree_report import H200_DRAFT_MS, H200_STEP_MS, gpu_projection

    step, draft = H200_STEP_MS, H200_DRAFT_MS
    assert gpu_projection(2.0, 17) == pytest.approx(2 * step / (1.03 * step + draft))
    assert gpu_projection(2.0, 272) == pytest.approx(2 * step / (1.81 * step + draft))
    assert gpu_projection(2.0, 8) == gpu_projection(2.0, 17)  # no cheaper than a verify of 17


def test_the_siblings_check_table(tmp_path):
    v = [0.25, 0.2, 0.3]
    check = {
        "command": "python -m research.siblings_check --top-m 16",
        "eagle3": {
            "code": dict(
                prompts=2,
                rounds=50,
                observed=v,
                p_support=v,
                single=[0.15, 0.1, 0.2],
                observed_minus_p_support=[0.0, -0.02, 0.02],
                gain=[0.1, 0.08, 0.12],
            )  # fmt: skip
        },
    }
    dev = {"eagle3-chain16|code|T=1": cell([4, 4], [10, 10])}
    text = write(dev, tmp_path / "trees.md", "cmd", None, 1.0, check).read_text()
    assert (
        "| eagle3 | code | 50 | 0.250 [0.200, 0.300] | 0.250 [0.200, 0.300] | +0.000 [-0.020, "
        "+0.020] | 0.150 [0.100, 0.200] | +0.100 [+0.080, +0.120] |" in text
    )
    assert "`python -m research.siblings_check --top-m 16`" in text


def test_the_gpu_choice_weighs_tokens_a_round_against_the_verify_they_cost():
    from training.tree_report import dev_best_gpu

    wide = cell([9, 9], [10, 10])
    wide["draft_tokens"] = 250 * 20  # a verify of 251 tokens: about 1.8 steps
    dev = {
        "eagle3-siblings-m16|code|T=1": wide,  # 1.90 tokens a round
        "eagle3-siblings-d1-m8|code|T=1": cell([6, 6], [10, 10]),  # 1.60, a verify of 17
        "eagle3-chain16|code|T=1": cell([4, 4], [10, 10]),
    }
    assert dev_best(dev, 1.0)[0] == "eagle3-siblings-m16"
    assert dev_best_gpu(dev, 1.0) == ("eagle3-siblings-d1-m8", "eagle3-chain16")


def run_of(seed: int, cells: dict) -> dict:
    return {"settings": {"seed": seed, "prompt_ids": ["a", "b"]}, "cells": cells}


def pooled_cell(accepted: list[int], drafts: list[int]) -> dict:
    c = cell(accepted, drafts)
    return c | dict(rounds=c["drafts"], tokens=64, wall_s=2.0, base_tokens=64, base_wall_s=1.0,
                    draft_s=1.0, verify_s=1.0)  # fmt: skip


def test_seeds_pool_prompt_by_prompt_and_a_seed_twice_is_refused():
    from training.tree_report import pool_seeds

    key = "eagle3-siblings-m16|math|T=1"
    a = run_of(0, {key: pooled_cell([30, 2], [5, 30]), "only-here|math|T=1": pooled_cell([1], [1])})
    b = run_of(1, {key: pooled_cell([2, 40], [30, 5])})
    (pooled,) = pool_seeds([a, b]).values()  # rows not in every run are left out
    assert pooled["prompt_accepted"] == [32, 42] and pooled["prompt_drafts"] == [35, 35]
    assert pooled["gamma"] == pytest.approx(1 + 74 / 70) and pooled["samples"] == 2
    lo, hi = pooled["gamma_ci"]
    assert lo < pooled["gamma"] < hi  # the two prompts differ: resampling them moves gamma
    assert pooled["speedup"] == pytest.approx(0.5) and "speedup_ci" not in pooled
    with pytest.raises(ValueError, match="same seed"):
        pool_seeds([a, run_of(0, b["cells"])])
    other = run_of(2, b["cells"])
    other["settings"]["prompt_ids"] = ["a", "c"]
    with pytest.raises(ValueError, match="prompt_ids"):
        pool_seeds([a, other])


def test_a_report_of_pooled_seeds_says_so(tmp_path):
    from training.tree_report import pool_seeds

    runs = [
        run_of(s, {"flashmap-tree4|code|T=1": pooled_cell([6, 6], [10, 10]),
                   "flashmap-1|code|T=1": pooled_cell([3, 3], [10, 10])})
        for s in (0, 1, 2)
    ]  # fmt: skip
    text = write(pool_seeds(runs), tmp_path / "trees.md", "cmd", None).read_text()
    assert "3 samples a prompt" in text
    assert (
        "| code | FlashMap (1 jump) | 4 | pick | 1.60 [1.60, 1.60] | +0.30 [+0.30, +0.30] | 0.50x |"
        in text
    )


def test_pooled_seeds_show_each_seed_alone_beside_the_pooled_choice(tmp_path):
    from training.tree_report import pool_seeds

    dev = {"flashmap-tree4|code|T=1": cell([9], [10]), "flashmap-1|code|T=1": cell([2], [10])}
    runs = [
        run_of(s, {"flashmap-tree4|code|T=1": pooled_cell([6 + s, 6], [10, 10]),
                   "flashmap-1|code|T=1": pooled_cell([3, 3], [10, 10])})
        for s in (0, 1)
    ]  # fmt: skip
    by_seed = {r["settings"]["seed"]: r["cells"] for r in runs}
    text = write(pool_seeds(runs), tmp_path / "t.md", "cmd", dev, runs=by_seed).read_text()
    assert "| code | 1.62 | 1.30 | +0.33 [+0.30, +0.35] |" in text  # pooled: 25 / 40 - 12 / 40
    assert "| 0 | +0.30 [+0.30, +0.30] |" in text and "| 1 | +0.35 [+0.30, +0.40] |" in text


def test_runs_with_one_seed_and_other_rows_join_before_the_seeds_pool():
    from training.tree_report import cells_by_seed, pool_seeds

    tree, chain = "eagle3-siblings-m16|math|T=1", "eagle|math|T=1"
    runs = [
        run_of(0, {tree: pooled_cell([6, 6], [10, 10])}),
        run_of(0, {chain: pooled_cell([3, 3], [10, 10])}),  # another drafter, same draws
        run_of(1, {tree: pooled_cell([8, 8], [10, 10]), chain: pooled_cell([1, 1], [10, 10])}),
    ]
    assert {s: sorted(c) for s, c in cells_by_seed(runs).items()} == {
        0: [tree, chain],
        1: [tree, chain],
    }
    pooled = pool_seeds(runs)
    assert pooled[tree]["gamma"] == pytest.approx(1.7) and pooled[chain]["gamma"] == pytest.approx(
        1.2
    )
    runs[0]["settings"]["checkpoints"] = {"eagle3-siblings-m16": "a"}
    runs[2]["settings"]["checkpoints"] = {"eagle3-siblings-m16": "b"}
    with pytest.raises(ValueError, match="two checkpoints"):
        pool_seeds(runs)


def test_the_sampling_trained_dflash_is_a_family_of_its_own():
    fam = "DFlash-style, trained on sampled answers"
    assert tree_row("dflash-t1-siblings-m16") == (
        fam,
        "dflash-t1-m16",
        1,
        "rejection + siblings (top 16)",
    )
    assert tree_row("dflash-t1-tree4-rejection") == (fam, "dflash-t1", 4, "rejection")
    assert tree_row("dflash-siblings")[0] == "DFlash-style" and tree_row("dflash-t1") is None
