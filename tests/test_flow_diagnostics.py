"""Flow diagnostics: the denoiser curve and its gate (training/denoiser_curve.py), shuffles,
acceptance and bootstrap intervals (training/shuffle_test.py), and offline acceptance against a
real (tiny, random) target (training/offline_acceptance.py, training/flow_diagnostics.py).

Tiny random target (V = 512, H = 64) and drafters (dim 64, 1 block): seconds on two CPU cores.
"""

import numpy as np
import pytest
import torch

from drafter_service.checkpoint import init_drafter
from drafter_service.flashmap_proposer import FlashMapProposer
from flashmap.drafts import Draft
from flashmap.types import SamplingParams, VerifyRow
from tests.drafter_helpers import distilled_world, randomize
from training import denoiser_curve as dc
from training import flow, heldout, trainer
from training import offline_acceptance as oa
from training import shuffle_test as st

TINY = dict(dim=64, n_blocks=1, n_heads=4, block_size=16, time_freq_dim=32, time_map_samples=2048)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow_diag")
    target, data, engine, prompts = distilled_world(root, n_prompts=4, max_new_tokens=30)
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text(
        "".join(f'{{"domain": "d{i % 2}", "prompt_ids": {p}}}\n' for i, p in enumerate(prompts))
    )
    return target, data, engine, prompt_file


def test_acceptance_and_proposal_probability():
    assert st.acceptance(np.ones(16)) == 17.0  # every slot and the bonus token
    assert st.acceptance(np.r_[0.0, np.ones(15)]) == 1.0  # the target's own token only
    assert st.acceptance(np.r_[1, 1, 0.5, 1]) == pytest.approx(1 + 1 + 1 + 0.5 + 0.5)
    d = Draft(
        np.array([3, 4]), np.array([[3, 9], [7, 4]]), np.array([[0.6, 0.4], [0.3, 0.7]], np.float32)
    )
    np.testing.assert_allclose(st.proposal_prob(d), [0.6, 0.7], rtol=1e-6)


def test_permutation_shuffle_takes_slot_k_from_block_k():
    K = 4
    blocks = [
        Draft(
            np.full(K, 10 * b),
            np.full((K, 1 + b % 2), 10 * b),
            np.full((K, 1 + b % 2), 1 / (1 + b % 2), np.float32),
        )
        for b in range(K)
    ]
    s = st.permutation_shuffle(blocks)
    np.testing.assert_array_equal(s.tokens, [0, 10, 20, 30])
    assert (
        s.support_ids[1, 1] == 10 and s.support_ids[0, 1] == -1
    )  # padded where block k had less support
    with pytest.raises(ValueError):
        st.permutation_shuffle(blocks[:3])


def test_paired_bootstrap_clusters():
    g = np.random.default_rng(0)
    a = g.normal(1.0, 1.0, 400)
    r = st.paired_bootstrap(a, np.zeros(400))
    assert r["lo"] < r["mean"] < r["hi"] and r["lo"] > 0.7 and r["hi"] < 1.3
    # Correlated anchors: 20 clusters whose members share their value. The cluster bootstrap
    # sees 20 observations, not 400, and its interval is wider.
    cl = np.repeat(np.arange(20), 20)
    b = np.repeat(g.normal(0.0, 1.0, 20), 20)
    wide, narrow = st.paired_bootstrap(b, clusters=cl), st.paired_bootstrap(b)
    assert (wide["hi"] - wide["lo"]) > 3 * (narrow["hi"] - narrow["lo"])


def test_embedded_reader_is_the_gaussian_log_likelihood():
    g = torch.Generator().manual_seed(0)
    E = torch.randn(40, 8, generator=g, dtype=torch.float64)
    reader = dc.EmbeddedReader(E)
    t = 0.7
    y = (1 - t) * torch.randn(3, 2, 40, generator=g, dtype=torch.float64) @ E + t * E[
        torch.tensor([[1, 2], [3, 4], [5, 6]])
    ]
    ll = reader.log_likelihood(y.float(), t).double()  # [3, 2, V]
    cov = (1 - t) ** 2 * E.T @ E
    mvn = torch.distributions.MultivariateNormal(t * E, covariance_matrix=cov)
    exact = mvn.log_prob(y[..., None, :])  # [3, 2, V]
    diff = ll - exact
    torch.testing.assert_close(
        diff - diff[..., :1], torch.zeros_like(diff), atol=2e-3, rtol=0
    )  # up to a constant


def test_denoiser_curve_and_gate(world):
    """A denoiser that ignores its state is flat in tau and fails the gate; the columns of
    what the state alone tells rise with tau."""
    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    with torch.no_grad():
        model.state_in.weight.zero_()
    batches = [
        flow.make_batch(
            trainer.SequenceStream(data).take(0, 4), 16, 4, 256, np.random.default_rng(0)
        )
    ]
    curve = dc.denoiser_curve(model, batches, taus=(0.0, 0.5, 0.9))
    assert [r["tau"] for r in curve] == [0.0, 0.5, 0.9]
    assert curve[0]["t"] == 0.0 and 0 < curve[1]["t"] < curve[2]["t"] < 1
    assert abs(curve[0]["denoiser"] - curve[2]["denoiser"]) < 1e-6  # the state is not read
    # the zero state only at t = 0; a denoiser that does not read its state drafts the same there
    assert "denoiser_zero_state" not in curve[1]
    assert curve[0]["denoiser_zero_state"] == pytest.approx(curve[0]["denoiser"])
    with torch.no_grad():
        model.state_in.weight.normal_(0, 1.0)  # now pure noise moves its drafts
    read = dc.denoiser_curve(model, batches, taus=(0.0,))[0]
    assert read["denoiser_zero_state"] != pytest.approx(read["denoiser"])
    assert "denoiser_zero_state" in dc.format_curve(curve)
    assert not dc.reads_state(curve)
    assert (
        curve[2]["state_bayes"] > curve[0]["state_bayes"] + 0.5
    )  # tau is what the embedded state tells
    assert dc.reads_state([dict(tau=0.0, denoiser=0.5), dict(tau=0.9, denoiser=0.7)])


def test_offline_acceptance_matches_a_fresh_target_pass(world):
    """T = 0: gamma = 1 + the drafted prefix the target's greedy decoding repeats, recomputed
    here without the cache reuse offline_acceptance does."""
    target, data, engine, prompts = world
    seqs = heldout.heldout_sequences(data, prompts, exclude=())
    assert [s.domain for s in seqs] == ["d0", "d1", "d0", "d1"] and [
        s.domain_index for s in seqs
    ] == [0, 0, 1, 1]
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    prop = FlashMapProposer(model, n_slots=4, max_context=96)
    res = oa.offline_acceptance(engine, prop, seqs[:2], temperature=0.0, steps=1, max_anchors=3)
    assert len(res.seq) == len(res.gamma["shared"]) == len(res.tokens) and len(res.seq) > 2
    assert set(res.gamma) == {"shared", "perm", "slot_noise"}
    anchors = {s.index: [a for a in s.anchors(16)] for s in seqs[:2]}
    picked = {
        i: [a[int(j)] for j in np.linspace(0, len(a) - 1, 3).round()] if len(a) > 3 else a
        for i, a in anchors.items()
    }
    order = [(i, a) for r in range(3) for i in picked if r < len(picked[i]) for a in [picked[i][r]]]
    seq_of = {s.index: s for s in seqs}
    slot = engine.allocate()
    try:
        for (i, a), toks, g in zip(order, res.tokens, res.gamma["shared"]):
            s = seq_of[i]
            out = engine.verify(
                [
                    VerifyRow(
                        slot,
                        0,
                        np.concatenate([s.tokens[: a + 1], toks]),
                        SamplingParams(),
                        support_ids=toks[:, None],
                    )
                ]
            )[0]
            match = np.cumprod(toks == out.argmax[:16])
            assert g == 1 + match.sum()
    finally:
        engine.release(slot)
    # T = 1: acceptance probabilities, so gamma is anywhere in [1, K + 1]
    res1 = oa.offline_acceptance(
        engine, prop, seqs[:1], temperature=1.0, steps=1, max_anchors=2, shuffles=False
    )
    assert all(1.0 <= g <= 17.0 for g in res1.gamma["shared"])
    # averaged: the mean over all K runs and their K cyclic shuffles, one value per anchor
    avg = oa.offline_acceptance(
        engine, prop, seqs[:1], temperature=0.0, steps=1, max_anchors=2, averaged=True
    )
    assert set(avg.gamma) == {"shared", "perm", "slot_noise", "shared_avg", "perm_avg"}
    assert all(len(v) == len(avg.seq) for v in avg.gamma.values())
    assert all(1.0 <= g <= 17.0 for v in ("shared_avg", "perm_avg") for g in avg.gamma[v])


def test_cyclic_shuffles_take_every_slot_from_another_run():
    K = 4
    blocks = [
        Draft(np.full(K, j, np.int64), np.full((K, 1), j, np.int64), np.ones((K, 1), np.float32))
        for j in range(K)
    ]
    shuffles = st.cyclic_shuffles(blocks)
    assert len(shuffles) == K
    for j, s in enumerate(shuffles):
        assert s.tokens.tolist() == [(k + j) % K for k in range(K)]  # slot k from run (k + j) mod K
    # over the K shuffles every slot sees every run once: no run's slot is over-counted
    assert sorted(int(s.tokens[0]) for s in shuffles) == list(range(K))


@pytest.mark.slow
def test_eval_writes_the_flow_diagnostics(world, tmp_path):
    """`flashmap eval --flow-data`: the timed eval, then the flow diagnostics of its FlashMap
    checkpoints beside eval.md (linked from it); a drafter whose noise is per slot already
    gets no per-slot shuffle pair, and the report says why."""
    import json

    from drafter_service.checkpoint import save_drafter
    from training import evaluate as ev

    target, data, _, prompts = world
    save_drafter(randomize(init_drafter(target, seed=0, **TINY)), tmp_path / "fm")
    save_drafter(randomize(init_drafter(target, seed=1, kind="dflash", **TINY)), tmp_path / "df")
    out = tmp_path / "results"
    argv = [
        "--target",
        str(target),
        "--flashmap",
        str(tmp_path / "fm"),
        "--dflash",
        str(tmp_path / "df"),
        "--prompts",
        str(prompts),
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--teacher-steps",
        "3",
        "--temperatures",
        "0",
        "--out-dir",
        str(out),
        "--no-progress",
        "--threads",
        "1",
        "--flow-data",
        str(data),
        "--flow-anchors",
        "2",
    ]
    assert ev.main(argv) == 0
    report = (out / "eval.md").read_text()
    assert "`flow_diagnostics.md`" in report
    cells = json.loads((out / "eval_cells.json").read_text())["cells"]
    # The paper's inference draws one noise per block: its shuffle row is a draw per slot.
    assert "flashmap-1-indep|d0|T=0" in cells and "dflash-indep|d0|T=0" in cells
    diag = json.loads((out / "flow_diagnostics.json").read_text())
    text = (out / "flow_diagnostics.md").read_text()
    assert "teacher" in text and "map" in text and diag


def test_drafter_spec_leaves_t0_drafting_to_the_checkpoint_unless_told():
    """--drafter NAME=DIR[:STEPS[:ESTIMATE[:NOISE_SCALE]]]: without ESTIMATE / NOISE_SCALE the
    proposer drafts T = 0 rows as the checkpoint says (None), as it is served."""
    from training.flow_diagnostics import _spec

    d = _spec("m=runs/x:1,2")
    assert (d.steps, d.greedy_estimate, d.greedy_noise_scale) == ((1, 2), None, None)
    d = _spec("m=runs/x:2:argmax:0")
    assert (d.steps, d.greedy_estimate, d.greedy_noise_scale) == ((2,), "argmax", 0.0)
