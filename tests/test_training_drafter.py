"""Drafter training: self-distillation data, flow / distill / dflash losses, CLI, checkpoints.

A tiny random target (V = 512, H = 64, 4 layers) and tiny drafters (dim 64, 1-2 blocks):
the whole file runs in well under a minute on two CPU cores.
"""

import csv
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from drafter_service.checkpoint import init_drafter, load_drafter
from drafter_service.config import DrafterConfig
from drafter_service.flashmap_proposer import FlashMapProposer, departures_as_trained
from drafter_service.flow_map import jump
from flashmap.drafts import ProposeRequest
from tests.drafter_helpers import distilled_world, randomize
from training import drafter_data as dd
from training import flow, trainer
from training import train_drafter as td

TINY = dict(dim=64, n_blocks=1, n_heads=4, block_size=16, time_freq_dim=32)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(target dir, data dir, engine, prompts) with a few self-distilled sequences in 2 shards."""
    return distilled_world(tmp_path_factory.mktemp("train_drafter"), n_prompts=6, max_new_tokens=20)


def a_batch(data, n_seqs=3, anchors=4, seed=0):
    stream = trainer.SequenceStream(data, seed=seed)
    return flow.make_batch(stream.take(0, n_seqs), 16, anchors, 256, np.random.default_rng(seed))


# ----------------------------------------------------------------------------- data


def test_data_shards_features_and_resume(world):
    target, data, engine, prompts = world
    shards = dd.list_shards(data)
    assert [dd.shard_count(p) for p in shards] == [4, 2]
    seqs = [s for p in shards for s in dd.read_shard(p)]
    assert len(seqs) == 6
    for p, s in zip(prompts, seqs):
        assert s.tokens[: s.prompt_len].tolist() == p
        assert len(s.tokens) > s.prompt_len  # a response
        assert s.features.shape == (len(s.tokens), engine.feature_dim)
    # The response is the target's greedy continuation.
    s = seqs[0]
    feats = dd.target_features(engine, [s.tokens.tolist()])[0]
    assert np.allclose(
        feats, s.features.float().numpy(), rtol=1e-2, atol=1e-2
    )  # stored as bfloat16
    lazy = dd.Shard(shards[0])
    assert len(lazy) == 4 and lazy[1].prompt_len == seqs[1].prompt_len
    assert torch.equal(lazy[1].features, seqs[1].features) and torch.equal(
        lazy[1].tokens, seqs[1].tokens
    )
    # Resuming skips existing shards (no shard is rewritten) ...
    mtimes = [p.stat().st_mtime_ns for p in shards]
    dd.build(
        engine, prompts, data, max_new_tokens=20, chunk_size=4, target_dir=target, progress=False
    )
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    # ... and refuses other settings.
    with pytest.raises(ValueError, match="other settings"):
        dd.build(
            engine,
            prompts,
            data,
            max_new_tokens=21,
            chunk_size=4,
            target_dir=target,
            progress=False,
        )


def test_data_cli_and_prompt_files(world, tmp_path):
    target, _, _, prompts = world
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts[:3]))
    assert dd.read_prompts(f) == prompts[:3]
    out = tmp_path / "data"
    assert (
        dd.main(
            [
                "--target",
                str(target),
                "--prompts",
                str(f),
                "--out",
                str(out),
                "--limit",
                "2",
                "--max-new-tokens",
                "3",
                "--chunk-size",
                "1",
                "--slots",
                "2",
                "--max-seq-len",
                "64",
            ]
        )
        == 0
    )
    assert [dd.shard_count(p) for p in dd.list_shards(out)] == [1, 1]
    assert dd.read_meta(out)["n_prompts"] == 2
    f.write_text('{"text": "no prompt here"}\n')
    assert dd.main(["--target", str(target), "--prompts", str(f), "--out", str(out)]) == 2


def test_batch_anchors_inside_responses(world):
    _, data, _, _ = world
    stream = trainer.SequenceStream(data, seed=0)
    seqs = stream.take(0, 4)
    b = flow.make_batch(seqs, 16, 3, 256, np.random.default_rng(1))
    assert b.anchor.shape == b.lengths.shape == b.seq_index.shape and b.target.shape == (
        len(b.anchor),
        16,
    )
    for i in range(len(b.anchor)):
        seq, a = seqs[int(b.seq_index[i])], int(b.lengths[i])
        assert seq.prompt_len <= a <= len(seq.tokens) - 2
        assert int(b.anchor[i]) == int(seq.tokens[a])
        n = int(b.mask[i].sum())
        assert b.target[i, :n].tolist() == seq.tokens[a + 1 : a + 1 + n].tolist()
        assert n == min(16, len(seq.tokens) - a - 1)
        # context = features strictly before the anchor
        assert torch.equal(b.features[int(b.seq_index[i]), :a], seq.features[:a].float())
    # the stream is a deterministic function of (seed, position) and covers every sequence per epoch
    again = trainer.SequenceStream(data, seed=0)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(seqs, again.take(0, 4)))
    assert len({tuple(s.tokens.tolist()) for s in stream.take(0, stream.total)}) == stream.total
    # sequences without an anchor inside the response (once cut to max_len) are left out
    _, _, _, prompts = world
    short = trainer.SequenceStream(data, seed=0, max_len=9)
    assert short.total == sum(len(p) <= 7 for p in prompts) < stream.total
    assert all(len(q.tokens[:9]) - 2 >= q.prompt_len for q in short.take(0, short.total))


# ----------------------------------------------------------------------------- losses


def _fit(model, loss_fn, batch, steps=6, lr=3e-3):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = loss_fn(
            model, batch, torch.Generator().manual_seed(0)
        )  # same noise / times every step
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "kind,loss_fn", [("flashmap", flow.flow_loss), ("dflash", flow.dflash_loss)]
)
def test_training_step_lowers_loss(world, kind, loss_fn):
    target, data, _, _ = world
    model = init_drafter(target, seed=0, kind=kind, **TINY).train()
    losses = _fit(model, loss_fn, a_batch(data))
    assert math.isfinite(losses[0]) and losses[-1] < losses[0] - 0.05, losses


def test_slot_weights_and_weighted_ce():
    w = flow.slot_weights(16, 7.0)
    assert torch.allclose(w, torch.exp(-torch.arange(16) / 7.0))
    logits = torch.randn(3, 16, 10)
    target = torch.randint(0, 10, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1, 5:] = False
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), reduction="none"
    ).view(3, 16)
    wm = w * mask
    assert torch.allclose(flow.weighted_ce(logits, target, mask, w), (ce * wm).sum() / wm.sum())


def test_noisy_state_shares_one_draw():
    target = torch.randint(0, 50, (2, 16))
    t = torch.tensor([0.0, 0.3])
    x = flow.noisy_state(target, t, 50, torch.Generator().manual_seed(0))
    assert torch.equal(x[0], x[0, :1].expand(16, 50))  # t = 0: the same noise in every slot
    eps = x[1] - 0.3 * torch.nn.functional.one_hot(target[1], 50)
    assert torch.allclose(eps, eps[:1].expand(16, 50), atol=1e-6)


def _jumps(n, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.rand(2, n, generator=g)
    s, t = (
        torch.minimum(a, b) * 0.95,
        torch.maximum(a, b) * 0.95 + 0.05 * (torch.rand(n, generator=g) > 0.5),
    )
    u = s + (t - s) * torch.rand(n, generator=g)
    x = torch.randn(n, 16, vocab, generator=g)
    return x, s, u, t


def test_semigroup_mixture_is_the_composed_jump(world):
    """jump(x, pi*, s, t) lands exactly where the two jumps s -> u -> t land."""
    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    b = a_batch(data)
    fn = flow.bind(model, b)
    n = len(b.anchor)
    x, s, u, t = _jumps(n)
    with torch.no_grad():
        pi_star = flow.semigroup_target(fn, x, s, u, t)
        x_u = jump(x, fn(x, s, u).softmax(-1), s, u)
        x_t = jump(x_u, fn(x_u, u, t).softmax(-1), u, t)
    assert torch.allclose(jump(x, pi_star, s, t), x_t, atol=1e-5)
    assert torch.allclose(pi_star.sum(-1), torch.ones(n, 16), atol=1e-5) and pi_star.min() >= 0


def _semigroup_loss(fn, x, s, u, t):
    """Distillation loss with only semigroup rows, student = EMA side = fn."""
    n = len(s)
    w, mask, zero = (
        flow.slot_weights(16, 7.0),
        torch.ones(n, 16, dtype=torch.bool),
        torch.zeros(n, dtype=torch.bool),
    )
    with torch.no_grad():
        loss, stats = flow.distill_loss_terms(
            fn, None, lambda xx, a, b, rows: fn(xx, a, b), x, s, u, t, zero, mask, w
        )
    return loss.item()


def test_semigroup_loss_vanishes_where_it_must(world):
    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    b = a_batch(data)
    fn = flow.bind(model, b)
    x, s, u, t = _jumps(len(b.anchor))
    # u = s or u = t: both sides are the same single jump.
    at_s, at_t = _semigroup_loss(fn, x, s, s, t), _semigroup_loss(fn, x, s, t, t)
    assert at_s < 1e-6 and at_t < 1e-6
    # A generic midpoint on an untrained model: not consistent (orders of magnitude above rounding).
    assert _semigroup_loss(fn, x, s, u, t) > 1000 * max(at_s, at_t, 1e-9)
    # The exact interpolation map towards a fixed pi satisfies the semigroup for every s < u < t.
    fixed = torch.randn(len(s), 16, 512)
    assert _semigroup_loss(lambda xx, a, bb: fixed, x, s, u, t) < 1e-5


def test_zero_length_jump_loss_vanishes_for_student_equal_teacher(world):
    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    b = a_batch(data)
    with torch.no_grad():
        loss, stats = flow.distill_loss(model, model, model, b, torch.Generator().manual_seed(0))
    assert stats["zero"] < 1e-5
    # A different teacher is not matched.
    other = randomize(init_drafter(target, seed=1, **TINY), seed=1).eval()
    with torch.no_grad():
        _, stats = flow.distill_loss(model, other, model, b, torch.Generator().manual_seed(0))
    assert stats["zero"] > 1e-3


def test_null_jumps_are_dflash_cross_entropy_from_the_zero_state_and_drafted_at_t0(world):
    """null_jump_fraction = 1: every block is the jump 0 -> 1 from the zero state, scored by
    the slot-weighted cross-entropy against the data (DFlash's loss); such a map drafts T = 0
    rows from the zero state by default (the trained prediction), other maps from their noise."""
    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    b = a_batch(data)
    null = replace(model.cfg, null_jump_fraction=1.0)
    model.cfg = null
    with torch.no_grad():
        loss, stats = flow.distill_loss(model, model, model, b, torch.Generator().manual_seed(0))
        zero_state = torch.zeros(len(b.anchor), 16, null.vocab_size)
        logits = model(zero_state, 0.0, 1.0, b.anchor, b.context(model))
        ce, _ = flow.block_ce(logits, b, null)
    assert stats["null"] == pytest.approx(ce.item(), rel=1e-5)
    assert loss.item() == pytest.approx(ce.item(), rel=1e-5)
    assert math.isnan(stats["zero"]) and math.isnan(stats["semigroup"])

    # Drafting T = 0 rows from the zero state is a departure the map was trained for, named.
    assert FlashMapProposer(model, n_slots=1, max_context=8).greedy_noise_scale == 1.0
    assert departures_as_trained(model.cfg)["greedy_noise_scale"] == 0.0
    model.cfg = replace(null, null_jump_fraction=0.0)
    assert departures_as_trained(model.cfg)["greedy_noise_scale"] == 1.0
    with pytest.raises(ValueError, match="null_jump_fraction"):
        replace(null, null_jump_fraction=1.5).validate()


def test_two_jump_zero_state_rows_train_the_path_the_proposer_serves(world):
    """null_two_jump_share = 1: every zero-state block is trained along the two-jump path the
    proposer drafts T = 0 rows with: 0 -> t_1 from the zero state, its soft estimate carried to
    t_1, then t_1 -> 1, each jump scored by cross-entropy against the data."""
    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    b = a_batch(data)
    model.cfg = replace(model.cfg, null_jump_fraction=1.0, null_two_jump_share=1.0)
    t_1 = float(model.time_grid(2)[1])
    assert 0.0 < t_1 < 1.0
    with torch.no_grad():
        loss, stats = flow.distill_loss(model, model, model, b, torch.Generator().manual_seed(0))
        ctx, n, V = b.context(model), len(b.anchor), model.cfg.vocab_size
        first = model(torch.zeros(n, 16, V), 0.0, t_1, b.anchor, ctx)
        second = model(t_1 * first.softmax(-1), t_1, 1.0, b.anchor, ctx)
        ce_1, ce_2 = flow.block_ce(first, b, model.cfg)[0], flow.block_ce(second, b, model.cfg)[0]
        served = FlashMapProposer(model, n_slots=1, max_context=8)._integrate(
            torch.zeros(n, 16, model.embed.shape[1]), b.anchor, ctx, 2
        )
    assert stats["null"] == pytest.approx(ce_1.item(), rel=1e-4)
    assert stats["null2"] == pytest.approx(ce_2.item(), rel=1e-4)
    assert loss.item() == pytest.approx(ce_1.item() + ce_2.item(), rel=1e-4)
    assert torch.allclose(served, second, atol=1e-4)  # trained = served
    # the gradient reaches the first jump through the carried state
    model.train()
    loss, _ = flow.distill_loss(model, model, model, b, torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="null_two_jump_share"):
        replace(model.cfg, null_two_jump_share=-0.1).validate()

    # two_jump_estimate = "argmax": the first jump's one-hot argmax is carried to t_1, as the
    # proposer's greedy_estimate = "argmax" drafts (as the map was trained: departures_as_trained).
    model.eval().cfg = replace(model.cfg, two_jump_estimate="argmax")
    with torch.no_grad():
        _, stats = flow.distill_loss(model, model, model, b, torch.Generator().manual_seed(0))
        hard = F.one_hot(first.argmax(-1), V).float()
        second = model(t_1 * hard, t_1, 1.0, b.anchor, ctx)
        proposer = FlashMapProposer(
            model, n_slots=1, max_context=8, **departures_as_trained(model.cfg)
        )
        served = proposer._integrate(
            torch.zeros(n, 16, model.embed.shape[1]), b.anchor, ctx, 2, hard=torch.ones(n).bool()
        )
    assert proposer.greedy_estimate == "argmax"
    assert stats["null2"] == pytest.approx(flow.block_ce(second, b, model.cfg)[0].item(), rel=1e-4)
    assert torch.allclose(served, second, atol=1e-4)
    with pytest.raises(ValueError, match="two_jump_estimate"):
        replace(model.cfg, two_jump_estimate="mean").validate()


def test_jump_sampling_fractions():
    cfg = DrafterConfig(
        vocab_size=512,
        target_hidden_size=64,
        target_num_layers=4,
        feature_layers=[1],
        time_map="vocab",
    )  # a bare config: no embedding to measure the embedded map on
    s, u, t, zero = flow.sample_jumps(20000, 512, cfg, torch.Generator().manual_seed(0), "cpu")
    full = (s == 0) & (t == 1)
    assert abs(zero.float().mean().item() - 0.5) < 0.02
    assert abs(full.float().mean().item() - 1 / 16) < 0.01
    assert torch.equal(s[zero], t[zero])
    assert bool((s <= u).all() and (u <= t).all() and (s[~zero] < t[~zero]).all())


def test_lr_schedule():
    cfg = td.TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    f = [trainer.lr_factor(i, cfg) for i in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[99] == pytest.approx(0.1, abs=1e-3)
    paper = td.TrainConfig.for_stage("flow"), td.TrainConfig.for_stage("distill")
    assert (paper[0].steps, paper[0].lr, paper[1].steps, paper[1].lr) == (
        39_000,
        6e-4,
        23_000,
        5e-5,
    )


# ----------------------------------------------------------------------------- CLI + checkpoints


def test_warm_start_from_dflash_drafts_what_dflash_drafts(world):
    target, data, _, _ = world
    src = randomize(init_drafter(target, seed=0, kind="dflash", **TINY), seed=1)
    with torch.no_grad():
        src.mask_embed.normal_()  # a trained mask vector is not zero: it must move, not vanish
    model = td.warm_start_from_dflash(src, pure_noise_fraction=0.2)
    assert model.cfg.kind == "flashmap" and model.cfg.pure_noise_fraction == 0.2
    batch = a_batch(data)
    ctx_src, ctx = batch.context(src), batch.context(model)
    x = torch.randn(len(batch.anchor), 16, 512)  # any state: the state projection starts at 0
    with torch.no_grad():
        want = src(None, 0.0, 1.0, batch.anchor, ctx_src)
        got = model(x, 0.0, 1.0, batch.anchor, ctx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # constant_time: the same at every time, the denoiser at tau = 0 included.
    const = td.warm_start_from_dflash(src, constant_time=True)
    with torch.no_grad():
        for s_, t_ in ((0.0, 0.0), (0.3, 0.3), (0.0, 0.5), (0.5, 1.0)):
            got = const(x, s_, t_, batch.anchor, ctx)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # ... and the state can be learnt: the flow loss moves the state projection off zero.
    _fit(model.train(), flow.flow_loss, batch, steps=2)
    assert model.state_in.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="dflash"):
        td.warm_start_from_dflash(model)
    with pytest.raises(ValueError, match="architecture"):
        td.warm_start_from_dflash(src, dim=32)


def test_state_gate_keeps_the_dflash_path_at_tau_0_and_reads_the_noise_after(world):
    """state_gate_tau > 0: at tau = 0 the denoiser ignores the state (a context-only predictor,
    as DFlash's) whatever its state projection, before and after training; a jump 0 -> 1 and the
    denoiser at tau > 0 read it; the drafting path (cached host-float modulations) equals the
    training path (tensor times)."""
    target, data, _, _ = world
    src = randomize(init_drafter(target, seed=0, kind="dflash", **TINY), seed=1)
    model = td.warm_start_from_dflash(src, state_gate_tau=0.1).eval()
    with torch.no_grad():
        model.state_in.weight.normal_()  # a state projection that reads the state
    batch = a_batch(data)
    ctx = batch.context(model)
    n = len(batch.anchor)
    x1, x2 = torch.randn(2, n, 16, 512)
    with torch.no_grad():
        torch.testing.assert_close(
            model(x1, 0.0, 0.0, batch.anchor, ctx), model(x2, 0.0, 0.0, batch.anchor, ctx)
        )
        for s, t in ((0.0, 1.0), (0.5, 0.5)):
            assert not torch.allclose(
                model(x1, s, t, batch.anchor, ctx), model(x2, s, t, batch.anchor, ctx)
            )
        tensor_t = torch.full((n,), 0.5)
        torch.testing.assert_close(
            model(x1, tensor_t, tensor_t, batch.anchor, ctx), model(x1, 0.5, 0.5, batch.anchor, ctx)
        )
    _fit(model.train(), flow.flow_loss, batch, steps=3)
    with torch.no_grad():  # trained, the denoiser at tau = 0 still does not read the state
        torch.testing.assert_close(
            model.eval()(x1, 0.0, 0.0, batch.anchor, ctx), model(x2, 0.0, 0.0, batch.anchor, ctx)
        )
    with pytest.raises(ValueError, match="state_gate_tau"):
        td.warm_start_from_dflash(src, state_gate_tau=-1.0)


def _csv_steps(path):
    with open(path) as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def _drafts(model):
    prop = FlashMapProposer(model, n_slots=2, max_context=64)
    feats = np.random.default_rng(0).standard_normal((5, model.cfg.feature_dim)).astype(np.float32)
    prop.extend("a", np.arange(5), feats)
    return prop.propose([ProposeRequest("a", anchor=3, seed=1)], 1)[0]


@pytest.mark.slow
def test_cli_stages_resume_and_checkpoint(world, tmp_path):
    target, data, _, _ = world
    common = [
        "--target",
        str(target),
        "--data",
        str(data),
        "--small",
        "--no-progress",
        "--n-blocks",
        "1",
        "--batch-size",
        "6",
        "--anchors-per-seq",
        "3",
        "--log-every",
        "1",
    ]
    flow = tmp_path / "flow"
    assert (
        td.main(
            ["--stage", "flow", "--out", str(flow), "--steps", "2", "--save-every", "2", *common]
        )
        == 0
    )
    assert torch.load(flow / trainer.STATE_FILE, weights_only=False)["step"] == 2
    assert (
        td.main(["--stage", "flow", "--out", str(flow), "--steps", "3", "--resume", *common]) == 0
    )
    assert torch.load(flow / trainer.STATE_FILE, weights_only=False)["step"] == 3
    assert _csv_steps(flow / trainer.CSV_FILE) == [1, 2, 3]
    assert (flow / trainer.PNG_FILE).stat().st_size > 0

    model = load_drafter(flow, target)
    st = torch.load(flow / trainer.STATE_FILE, weights_only=False)
    assert all(torch.equal(v, st["model"][k]) for k, v in model.state_dict().items())
    d = _drafts(model)
    assert d.tokens.shape == (16,) and ((0 <= d.tokens) & (d.tokens < 512)).all()

    dist = tmp_path / "distill"
    assert (
        td.main(
            [
                "--stage",
                "distill",
                "--teacher",
                str(flow),
                "--out",
                str(dist),
                "--steps",
                "1",
                "--full-jump-fraction",
                "0.25",
                "--null-jump-fraction",
                "0.5",
                *common,
            ]
        )
        == 0
    )
    with open(dist / trainer.CSV_FILE) as f:
        row = list(csv.DictReader(f))[-1]
    assert {"loss", "zero", "semigroup", "null"} <= set(row)
    distilled = load_drafter(dist, target)
    assert _drafts(distilled).tokens.shape == (16,)
    assert distilled.cfg.full_jump_fraction == 0.25  # the map records its distillation
    assert distilled.cfg.null_jump_fraction == 0.5
    assert load_drafter(flow, target).cfg.full_jump_fraction == 1 / 16

    base = tmp_path / "dflash"
    assert td.main(["--stage", "dflash", "--out", str(base), "--steps", "1", *common]) == 0
    m = load_drafter(base, target)
    assert m.cfg.kind == "dflash" and _drafts(m).tokens.shape == (16,)

    warm = tmp_path / "warm"
    assert (
        td.main(
            [
                "--stage",
                "flow",
                "--init-from",
                str(base),
                "--out",
                str(warm),
                "--steps",
                "1",
                "--lr",
                "0",
                *common,
            ]
        )
        == 0
    )
    w = load_drafter(warm, target)
    assert w.cfg.kind == "flashmap" and w.cfg.n_blocks == m.cfg.n_blocks
    assert np.array_equal(
        _drafts(w).tokens, _drafts(m).tokens
    )  # lr 0: still the baseline's 1-jump draft
    # --train-only state_in with the state gate: the DFlash-style network stays as it was (at
    # tau = 0 the denoiser is the baseline), only the state projection learns.
    gated = ["--stage", "flow", "--init-from", str(base), "--steps", "2", *common]
    gated += ["--state-gate-tau", "0.25", "--warm-constant-time", "--train-only", "state_in"]
    runs = {lr: tmp_path / f"only-{lr}" for lr in ("0", "0.01")}
    for lr, out in runs.items():
        assert td.main([*gated, "--out", str(out), "--lr", lr]) == 0
    still, moved = (load_drafter(out, target).state_dict() for out in runs.values())
    changed = {k for k in still if not torch.equal(still[k], moved[k])}
    assert changed == {"state_in.weight"}, changed
    assert td.main([*gated, "--out", str(tmp_path / "x"), "--train-only", "nothing"]) == 2
    more = tmp_path / "dflash_more"
    assert (
        td.main(
            [
                "--stage",
                "dflash",
                "--init-from",
                str(base),
                "--out",
                str(more),
                "--steps",
                "1",
                "--lr",
                "0",
                *common,
            ]
        )
        == 0
    )
    assert np.array_equal(_drafts(load_drafter(more, target)).tokens, _drafts(m).tokens)
    assert (
        td.main(
            [
                "--stage",
                "dflash",
                "--init-from",
                str(warm),
                "--out",
                str(tmp_path / "y"),
                "--steps",
                "1",
                *common,
            ]
        )
        == 2
    )  # not a dflash drafter
    on = tmp_path / "flow_more"  # a flow-stage drafter trained on, with another pure-noise share
    assert (
        td.main(
            [
                "--stage",
                "flow",
                "--init-from",
                str(warm),
                "--out",
                str(on),
                "--steps",
                "1",
                "--lr",
                "0",
                "--pure-noise-fraction",
                "0.5",
                *common,
            ]
        )
        == 0
    )
    w2 = load_drafter(on, target)
    assert w2.cfg.pure_noise_fraction == 0.5 and np.array_equal(
        _drafts(w2).tokens, _drafts(w).tokens
    )

    # export: bf16 weights, no training state; loads back into fp32 for the same target
    from training import export_drafter

    assert export_drafter.main([str(dist), str(tmp_path / "exported")]) == 0
    assert (
        not (tmp_path / "exported" / trainer.STATE_FILE).exists()
        and (tmp_path / "exported" / trainer.CSV_FILE).is_file()
    )
    a, b = load_drafter(dist, target), load_drafter(tmp_path / "exported", target)
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v, rtol=1e-2, atol=1e-2)
    assert export_drafter.main([str(tmp_path / "nothing"), str(tmp_path / "e2")]) == 2

    # one-line errors
    assert (
        td.main(["--stage", "distill", "--out", str(tmp_path / "x"), "--steps", "1", *common]) == 2
    )


def test_distillation_loss_is_not_zero_for_a_student_that_ignores_its_inputs(world):
    """A student whose output depends on neither the state nor (s, t) is self-consistent, so
    its semigroup term vanishes; the zero-length jumps still tie it to a teacher that reads
    its state, so the loss does not."""
    target, data, _, _ = world
    teacher = randomize(init_drafter(target, seed=0, **TINY)).eval()
    student = randomize(init_drafter(target, seed=0, **TINY)).eval()
    with torch.no_grad():
        student.state_in.weight.zero_()  # ignores x
        for m in student.time_embed:
            if isinstance(m, torch.nn.Linear):
                m.weight.zero_()  # ignores (s, t): the adaLN input is a constant
    b = a_batch(data)
    with torch.no_grad():
        _, stats = flow.distill_loss(student, teacher, student, b, torch.Generator().manual_seed(0))
        _, self_stats = flow.distill_loss(
            student, student, student, b, torch.Generator().manual_seed(0)
        )
    assert self_stats["loss"] < 1e-6  # it is consistent with itself ...
    assert stats["zero"] > 1e-2 and stats["loss"] > 1e-3  # ... but not the teacher


def test_map_fidelity_scores_a_map_by_its_teachers_ode(world):
    """research.map_fidelity: a map that is its teacher's one Euler step agrees with the
    teacher's 1-step ODE everywhere, and its two jumps (soft estimate through the midpoint in
    tau) with the teacher's 2-step ODE; the teacher's coarse ODE agrees with itself when coarse
    = fine; a map that reads nothing of the teacher does not agree."""
    from research import map_fidelity

    target, data, _, _ = world
    teacher = randomize(init_drafter(target, seed=0, **TINY)).eval()
    other = randomize(init_drafter(target, seed=3, **TINY), seed=3).eval()

    class OneEuler(torch.nn.Module):  # X_{s,1}(x) read off the teacher's denoiser at s
        def context(self, features, lengths):
            return teacher.context(features, lengths)

        def forward(self, x, s, t, anchor, ctx):
            return teacher(x, s, s, anchor, ctx)

    b = [a_batch(data)]
    rows = map_fidelity.fidelity(teacher, OneEuler(), b, taus=(0.0, 0.5), fine=1, coarse=1)
    assert [r["tau_s"] for r in rows] == [0.0, 0.5]
    for r in rows:
        assert r["coarse_agrees"] == 1.0 and r["map_agrees"] == 1.0
        assert r["map_acc"] == r["fine_acc"] and r["slots"] == int(b[0].mask.sum())
        lo, hi = r["map_acc_ci"]
        assert lo <= r["map_acc"] <= hi
    for r in map_fidelity.fidelity(teacher, OneEuler(), b, taus=(0.0, 0.5), fine=2, coarse=2):
        assert r["map2_agrees"] == 1.0 and r["map2_acc"] == r["fine_acc"]
    for shared in (True, False):
        (r,) = map_fidelity.fidelity(
            teacher, other, b, taus=(0.0,), fine=2, coarse=1, shared=shared
        )
        assert r["map_agrees"] < 0.5 and r["map2_agrees"] < 0.5
    assert "| t | 0.00 |" in map_fidelity.format_table({"t": rows}, 1, 1)


def test_two_jump_probe_accounts_for_every_changed_slot(world, monkeypatch):
    """research.two_jump_probe: the second jump's accuracy differs from the first's by exactly
    the slots it fixes minus those it breaks; accepted lengths count leading right slots + 1."""
    from research import two_jump_probe

    target, data, _, _ = world
    model = randomize(init_drafter(target, seed=0, **TINY)).eval()
    b = a_batch(data)
    r = two_jump_probe.probe(model, [b])
    assert r["slots"] == int(b.mask.sum()) and r["blocks"] == len(b.anchor)
    assert r["two_acc"] - r["first_acc"] == pytest.approx(r["fixed"] - r["broken"], abs=1e-9)
    assert r["fixed"] + r["broken"] <= r["changed"] + 1e-9 and r["changed"] > 0  # random: moves
    assert 1.0 <= r["gamma_one"] <= 17.0 and 1.0 <= r["gamma_two"] <= 17.0
    assert (
        two_jump_probe.accepted(b.target, b).tolist()
        == (b.mask.long().cumprod(-1).sum(-1) + 1).tolist()
    )
    assert "| m | " in two_jump_probe.format_table({"m": r})

    # The first-error view, counted slot by slot: the bound of one fix, and what the second
    # jump does at the first jump's first wrong slot and before it.
    with torch.no_grad():
        ctx, n, V = b.context(model), len(b.anchor), model.cfg.vocab_size
        first = model(torch.zeros(n, 16, V), 0.0, r["t_1"], b.anchor, ctx)
        two = model(r["t_1"] * first.softmax(-1), r["t_1"], 1.0, b.anchor, ctx).argmax(-1)
        first = first.argmax(-1)
    fix_bound, fixes, breaks, errors = 0, 0, 0, 0
    for i in range(n):
        valid = int(b.mask[i].sum())
        right = [bool(first[i, k] == b.target[i, k]) for k in range(valid)]
        e = right.index(False) if False in right else None
        breaks += any(two[i, k] != b.target[i, k] for k in range(e if e is not None else valid))
        if e is None:
            fix_bound += valid + 1
            continue
        errors += 1
        fixes += bool(two[i, e] == b.target[i, e])
        run = next((k for k in range(e + 1, valid) if not right[k]), valid)
        fix_bound += run + 1
    assert r["blocks_with_error"] == errors > 0
    assert r["gamma_one_fix"] == pytest.approx(fix_bound / n)
    assert r["fixes_first_error"] == pytest.approx(fixes / errors)
    assert r["breaks_before_it"] == pytest.approx(breaks / n)

    # A change kept only where the second jump is sure: threshold 0 keeps every change (the
    # two-jump draft), a threshold above 1 none (the first jump's draft).
    monkeypatch.setattr(two_jump_probe, "KEEP_THRESHOLDS", (0.0, 1.01))
    r = two_jump_probe.probe(model, [b])
    assert r["gamma_kept_0.0"] == pytest.approx(r["gamma_two"])
    assert r["gamma_kept_1.01"] == pytest.approx(
        two_jump_probe.accepted(first, b).float().mean().item()
    )


def test_refine_bound_keeps_the_chain_only_up_to_the_first_drafts_error():
    """research.two_jump_probe.refine_bound: a chain pass over a draft accepts the chain's run,
    but never more than one slot past the draft's own (the slot after the fix reads the draft's
    wrong token); rows measured on other anchors are refused."""
    from research import two_jump_probe

    def row(g):
        return {"per_anchor": {"seq": [0, 0, 1, 2], "gamma": g}}

    cells = {"rows": {"d": row([3, 17, 5, 1]), "c": row([10, 4, 5, 17])}}
    r = two_jump_probe.refine_bound(cells, "d", "c")
    assert r["first"] == 6.5 and r["chain"] == 9.0
    assert r["refined"] == pytest.approx((4 + 4 + 5 + 2) / 4)
    assert r["refined_minus_first"]["mean"] == pytest.approx((1 - 13 + 0 + 1) / 4)
    assert r["by_domain"] == {"all": {"first": 6.5, "refined": r["refined"]}}
    cells["rows"]["c"]["per_anchor"]["seq"] = [0, 1, 1, 2]
    with pytest.raises(ValueError, match="same anchors"):
        two_jump_probe.refine_bound(cells, "d", "c")


def test_second_jump_refiner_starts_at_a_tie_and_trains_only_its_own_network(world):
    """research.second_jump_refiner: before training the second network drafts exactly the
    one-jump block; a step moves it and leaves the map's first jump as it was; the "upto" loss
    scores the slots up to the first wrong one of the one-jump draft."""
    from research import second_jump_refiner as sjr

    target, data, _, _ = world
    first = randomize(init_drafter(target, seed=0, **TINY)).eval()
    for p in first.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in first.state_dict().items()}
    second = sjr.second_network(first)
    b = a_batch(data)
    one, two = sjr.two_jumps(first, second, b)
    assert torch.allclose(one, two, atol=1e-5)
    r = sjr.evaluate(first, second, [b])
    assert r["one"] == r["two"] and r["changed"] == 0 and r["diff"]["mean"] == 0
    assert r["fixes_first_error"] == 0 and r["breaks_before_it"] == 0
    assert r["ce"]["two_all"] == pytest.approx(r["ce"]["one_all"], rel=1e-4)
    assert r["ce"]["one_upto"] != r["ce"]["one_all"]  # the slots scored differ

    m = sjr.loss_mask(one, b, "upto")
    lead = ((one.argmax(-1) == b.target) & b.mask).long().cumprod(-1).sum(-1)
    assert m.sum(-1).tolist() == [min(int(x) + 1, int(v)) for x, v in zip(lead, b.mask.sum(-1))]
    assert sjr.loss_mask(one, b, "all").equal(b.mask)

    opt = torch.optim.AdamW(second.parameters(), lr=1e-2)
    loss = flow.weighted_ce(two, b.target, m, flow.slot_weights(16, first.cfg.slot_loss_decay))
    loss.backward()
    opt.step()
    assert not torch.allclose(sjr.two_jumps(first, second, b)[1], one, atol=1e-4)
    assert all(torch.equal(v, first.state_dict()[k]) for k, v in before.items())


def test_second_jump_refiner_cli_writes_its_curve_and_resumes(world, tmp_path, capsys):
    """The CLI: a curve on held-out and seen blocks from step 0 (the tie), a plot, and a rerun
    with more steps continues from the saved state instead of starting over."""
    from drafter_service.checkpoint import save_drafter
    from research import second_jump_refiner as sjr

    target, data, _, _ = world
    save_drafter(randomize(init_drafter(target, seed=0, **TINY)), tmp_path / "map")
    args = ["--target", str(target), "--map", str(tmp_path / "map"), "--data", str(data)]
    args += ["--heldout", str(data), "--out", str(tmp_path / "r"), "--batches", "1"]
    args += ["--batch-seqs", "2", "--eval-every", "1", "--lr", "1e-2"]
    assert sjr.main([*args, "--steps", "2"]) == 0
    curve = json.loads((tmp_path / "r" / "curve.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [0, 1, 2]
    assert curve[0]["heldout"]["diff"]["mean"] == 0 and curve[0]["seen"]["changed"] == 0
    assert (tmp_path / "r" / "curve.png").stat().st_size > 0
    capsys.readouterr()
    assert sjr.main([*args, "--steps", "3", "--loss", "upto", "--final-batches", "2"]) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    final = json.loads((tmp_path / "r" / "final.json").read_text())
    assert final["step"] == 3 and final["batches"] == 2 and final["diff"]["n"] > 0
    curve = json.loads((tmp_path / "r" / "curve.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [0, 1, 2, 3]


def test_second_jump_network_is_served_as_trained(world, tmp_path):
    """A map exported with its second-jump network (DrafterConfig.second_jump_net): saved and
    loaded it drafts T = 0 rows' second of two jumps with that network, exactly the refiner's
    trained path, and leaves every other row (T > 0, one jump) as the map alone drafts it."""
    from drafter_service.checkpoint import save_drafter
    from research import second_jump_refiner as sjr

    target, data, _, _ = world
    first = randomize(init_drafter(target, seed=0, null_jump_fraction=0.5, **TINY)).eval()
    second = randomize(sjr.second_network(first), seed=1).eval()
    torch.nn.init.normal_(
        second.state_in.weight, std=0.05, generator=torch.Generator().manual_seed(2)
    )
    save_drafter(sjr.pair_checkpoint(first, second), tmp_path / "pair")
    pair = load_drafter(tmp_path / "pair", target).eval()
    assert pair.cfg.second_jump_net and pair.second_jump.embed is pair.embed  # shared, not copied
    moved = sjr.pair_checkpoint(first, second).to(torch.float64)
    assert moved.second_jump.embed is moved.embed and moved.second_jump.embed.dtype == torch.float64

    b = a_batch(data)
    n, H = len(b.anchor), pair.embed.shape[1]
    one, want = sjr.two_jumps(first, second, b)
    prop = FlashMapProposer(pair, n_slots=1, max_context=8, **departures_as_trained(pair.cfg))
    assert prop.second_jump is pair.second_jump
    assert FlashMapProposer(pair, n_slots=1, max_context=8).second_jump is None  # the paper's
    rows = torch.arange(n) % 2 == 0
    with torch.no_grad():
        ctx = b.context(pair)
        served = prop._integrate(torch.zeros(n, 16, H), b.anchor, ctx, 2, second=rows)
        alone = FlashMapProposer(
            first, n_slots=1, max_context=8, **departures_as_trained(first.cfg)
        )._integrate(torch.zeros(n, 16, H), b.anchor, ctx, 2)
        every = prop._integrate(
            torch.zeros(n, 16, H), b.anchor, ctx, 2, second=torch.ones_like(rows), every=True
        )
    assert torch.allclose(served[rows], want[rows], atol=1e-4)  # trained = served
    assert torch.allclose(served[~rows], alone[~rows], atol=1e-5)  # the map's own jump
    assert torch.allclose(every, want, atol=1e-4)
    assert not torch.allclose(want, alone, atol=1e-3)  # the second network drafts otherwise

    # Through propose: sampled rows and one-jump drafts are the map's; only the path the
    # network was trained on takes it (zero state, the map's estimate).
    props = [
        FlashMapProposer(m, n_slots=2, max_context=64, **departures_as_trained(m.cfg))
        for m in (pair, first)
    ]
    seq = trainer.SequenceStream(data, seed=0).take(0, 1)[0]
    for p in props:
        p.extend("s", seq.tokens[:10].numpy(), seq.features[:10].float().numpy())
    reqs = [
        ProposeRequest("s", int(seq.tokens[10]), temperature=1.0, seed=3),
        ProposeRequest("s", int(seq.tokens[10]), seed=4),
    ]
    for steps in (1, 2):
        a, c = (p.propose(reqs, steps) for p in props)
        assert np.array_equal(a[0].tokens, c[0].tokens) and np.allclose(
            a[0].support_probs, c[0].support_probs
        )
        if steps == 1:  # the greedy row's one jump is the map's
            assert np.array_equal(a[1].tokens, c[1].tokens)
    for kw in (dict(greedy_noise_scale=1.0), dict(greedy_estimate="argmax")):
        with pytest.raises(ValueError, match="second_jump_net"):  # only the path it learned
            FlashMapProposer(
                pair, n_slots=1, max_context=8, **{**departures_as_trained(pair.cfg), **kw}
            )
