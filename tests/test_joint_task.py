"""The controlled joint-structure task (research/joint_task.py), CI-sized.

Trains the real pipeline on synthetic contexts whose continuations differ jointly in a few
slots (teacher flow stage, flow-map distillation, DFlash-style baseline from the same
initialisation) and checks what makes FlashMap worth having: the teacher reads its state,
one noise draw drafts coherent blocks far more often than sampling per-slot marginals,
and the permutation-shuffle Delta is positive for the flow and exactly 0 for DFlash.
"""

import numpy as np
import pytest
import torch

from research import joint_task as jt
from research import joint_world as jw
from tests.drafter_helpers import one_thread  # noqa: F401 - autouse fixture
from training.denoiser_curve import accuracy_at, denoiser_curve, reads_state
from training.shuffle_test import acceptance


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    cfg = jw.JointTaskConfig.small()
    task = jw.make_task(cfg)
    models = jt.train_all(task, tmp_path_factory.mktemp("joint"), log=lambda *_: None)
    return task, models


def test_task_is_hard_for_per_slot_marginals():
    task = jw.make_task(jw.JointTaskConfig.small())
    C, M, K = task.modes.shape
    diverge = (task.modes != task.modes[:, :1]).any(1).sum(1)  # [C] slots in which the modes differ
    assert (diverge == task.cfg.diverge).all()
    torch.testing.assert_close(task.probs.sum(1), torch.ones(C))
    # exact acceptance against the true conditional: a mode is accepted whole with its
    # probability at the first divergent slot
    c = 0
    mode0 = task.modes[c, 0].numpy()
    first = int(np.argmax(task.modes[c, 0] != task.modes[c, 1]))
    from flashmap.drafts import Draft

    g = acceptance(jw.true_alpha(task, c, Draft.greedy(mode0)))
    p0 = float(task.probs[c, 0])
    assert g == pytest.approx(1 + first + p0 * (K - first))


@pytest.mark.slow
def test_flow_stage_makes_the_denoiser_read_its_state(trained):
    task, models = trained
    curve = denoiser_curve(models["teacher"], jt.check_batches(task))
    assert reads_state(curve)
    assert accuracy_at(curve, 0.9) > accuracy_at(curve, 0.0) + 0.05


@pytest.mark.slow
def test_flow_drafts_coherent_blocks_and_dflash_marginals_do_not(trained):
    task, models = trained
    teacher = jt.evaluate_drafter(task, models["teacher"], 16)
    two = jt.evaluate_drafter(task, models["map"], 2)
    greedy = jt.evaluate_drafter(task, models["dflash"], 1)
    sampled = jt.evaluate_drafter(task, models["dflash"], 1, temperature=1.0)
    n = task.cfg.n_contexts * task.cfg.draws
    # Sampling each slot from DFlash's marginals lands in the support as often as the product
    # of the marginals says (exact), which is rarely; the flow's blocks are far more often whole.
    prod = jt.marginal_product_support(task, models["dflash"])
    assert abs(sampled["in_support"] - prod) < 4 * np.sqrt(max(prod, 1 / n) / n) + 0.01
    assert teacher["in_support"] > max(5 * sampled["in_support"], 0.08)
    # Joint structure: shuffling slots across independent shared-noise runs costs acceptance for
    # the flow, and nothing for a drafter that ignores the noise.
    assert teacher["delta_perm"]["lo"] > 0
    assert two["delta_perm"]["mean"] > 0
    assert greedy["delta_perm"]["mean"] == 0.0 and greedy["noise_changes"] == 0.0
    assert teacher["noise_changes"] > 0.02 and two["noise_changes"] > 0.02


@pytest.mark.slow
def test_scores_with_the_real_q_and_the_bootstrap_check(trained):
    task, models = trained
    # A drafter that ignores its noise has the product of its marginals as its law: scoring its
    # sampled blocks with the law estimated over the noise gives what its own q gives.
    sampled = jt.evaluate_drafter(task, models["dflash"], 1, temperature=1.0, law_draws=4)
    assert sampled["gamma_law"]["mean"] == pytest.approx(sampled["gamma"]["mean"], rel=1e-4)
    # The flow's sampled blocks carry their q; the law scoring never accepts less than q = 1.
    one = jt.evaluate_drafter(task, models["map"], 1, temperature=1.0, law_draws=8)
    assert 1.0 <= one["gamma"]["lo"] <= one["gamma"]["mean"] <= one["gamma"]["hi"] <= 17.0
    assert len(one["gamma_law_ctx"]) == task.cfg.n_contexts
    # The exact references: the most likely block is accepted at least as long as a sample.
    truth = jt.truth_rows(task)
    sample, mode = truth.values()
    assert (mode >= sample - 1e-12).all() and (sample >= 1).all()
    cov = jt.bootstrap_coverage(task, models["dflash"], repeats=2, contexts=range(4))
    assert cov["contexts"] == 4 and 0 <= cov["contain_zero"] <= 2 and len(cov["intervals"]) == 2
