"""FlashMap drafter: DiT, proposer (cache + batched drafting), checkpoints, oracle.

Tiny configs only (dim 64, 2 blocks, 4 heads, V = 512, H = 64): the whole file runs in
seconds on two CPU cores.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from drafter_service.checkpoint import init_drafter, load_drafter, save_drafter
from drafter_service.config import DrafterConfig
from drafter_service.flashmap_proposer import (
    ContextTooLong,
    FlashMapProposer,
    SlotsExhausted,
    draw_noise,
    request_generator,
)
from drafter_service.flow_map import greedy_summary, jump, noise_factor
from drafter_service.oracle import OracleProposer
from flashmap.checkpoint import CheckpointError
from flashmap.drafts import ProposeRequest
from tests.drafter_helpers import randomize

SMALL = dict(dim=64, n_blocks=2, n_heads=4, block_size=16, time_freq_dim=32)


def make_target(path: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {
        "main": make_target(root / "main"),
        "other_seed": make_target(root / "other_seed", seed=1),
        "other_vocab": make_target(root / "other_vocab", vocab_size=256),
    }


@pytest.fixture(scope="module", params=["flashmap", "dflash"])
def model(request, targets):
    return randomize(init_drafter(targets["main"], seed=0, kind=request.param, **SMALL))


@pytest.fixture(scope="module")
def flashmap(targets):
    return randomize(init_drafter(targets["main"], seed=0, **SMALL))


def features(n: int, F: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, F)).astype(np.float32)


def fill(prop: FlashMapProposer, lengths: dict[str, int]) -> dict[str, np.ndarray]:
    feats = {}
    for i, (sid, n) in enumerate(lengths.items()):
        feats[sid] = features(n, prop.cfg.feature_dim, seed=100 + i)
        prop.extend(sid, np.arange(n), feats[sid])
    return feats


def same(a, b) -> bool:
    return (
        np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.support_ids, b.support_ids)
        and np.allclose(a.support_probs, b.support_probs, atol=1e-5)
    )


# ----------------------------------------------------------------------------- config / model


def test_config_json_round_trip(flashmap):
    cfg = flashmap.cfg
    assert DrafterConfig.from_json(cfg.to_json()) == cfg
    assert cfg.feature_layers == [1] and cfg.feature_dim == 64 and cfg.vocab_size == 512
    d = DrafterConfig()
    # The paper's architecture; noise per slot, not the paper's shared draw (see DrafterConfig.shared_noise).
    assert (
        d.dim,
        d.n_blocks,
        d.n_heads,
        d.block_size,
        d.draft_steps,
        d.shared_noise,
        d.slot_loss_decay,
    ) == (2048, 6, 16, 16, 1, False, 7.0)
    with pytest.raises(ValueError, match="unknown"):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="kind"):
        DrafterConfig.from_dict({**cfg.to_dict(), "kind": "eagle"}).validate()


def test_output_shapes_and_frozen_buffers(model):
    B, K, V = 3, 16, 512
    ctx = model.context(torch.randn(B, 5, 64), torch.tensor([5, 2, 0]))
    x = torch.randn(B, K, V)
    logits = model(x, torch.zeros(B), torch.ones(B), torch.tensor([1, 2, 3]), ctx)
    assert logits.shape == (B, K, V) and torch.isfinite(logits).all()
    x_1, logits2 = model.flow_map(x, 0.0, 1.0, torch.tensor([1, 2, 3]), ctx)  # X_{0,1} = pi
    assert torch.equal(logits, logits2) and torch.allclose(x_1, logits.softmax(-1), atol=1e-6)
    if model.cfg.kind == "flashmap":  # the jump (s, t) is conditioned on: another t, other logits
        assert not torch.allclose(model(x, 0.0, 0.5, torch.tensor([1, 2, 3]), ctx), logits)
    names = set(model.state_dict())
    assert "embed" not in names and "lm_head" not in names
    assert all(not n.startswith(("embed", "lm_head")) for n, _ in model.named_parameters())
    assert ("mask_embed" in names) == (model.cfg.kind == "dflash")
    assert ("state_in.weight" in names) == (model.cfg.kind == "flashmap")


def test_adaln_zero_blocks_start_as_identity(targets):
    m = init_drafter(targets["main"], seed=0, **SMALL)
    h, c = torch.randn(2, 17, 64), torch.randn(2, 64)
    ctx = m.context(torch.randn(2, 4, 64), torch.tensor([4, 3]))
    for blk, (k, v) in zip(m.blocks, ctx.kv):
        assert (
            torch.count_nonzero(blk.adaln.weight) == 0 and torch.count_nonzero(blk.adaln.bias) == 0
        )
        mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
        out = blk(
            h, blk.modulation(c), k, v, mask, torch.arange(17).expand(2, 17), torch.ones(2, 1, 1)
        )
        assert torch.equal(out, h)


def test_modulation_cache_follows_the_weights(targets):
    m = randomize(init_drafter(targets["main"], seed=0, **SMALL)).eval()
    ctx = m.context(torch.randn(3, 4, 64), torch.tensor([4, 3, 0]))
    x, anchor = torch.randn(3, 16, m.cfg.vocab_size), torch.tensor([1, 2, 3])
    with torch.no_grad():
        fresh = m(
            x, torch.full((3,), 0.0), torch.full((3,), 1.0), anchor, ctx
        )  # tensor times: never cached
        first = m(x, 0.0, 1.0, anchor, ctx)  # fills the cache
        again = m(x, 0.0, 1.0, anchor, ctx)  # served from it
        torch.testing.assert_close(first, fresh, rtol=1e-5, atol=1e-5)
        assert torch.equal(again, first) and len(m._mod_cache) == 1
        randomize(m, seed=7)  # weights change in place: the cached vectors must not be used
        changed = m(x, 0.0, 1.0, anchor, ctx)
        want = m(x, torch.full((3,), 0.0), torch.full((3,), 1.0), anchor, ctx)
    torch.testing.assert_close(changed, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, first)
    out = m(x, 0.0, 1.0, anchor, ctx)  # with grad enabled (training): never cached
    assert out.requires_grad


def test_jump_endpoints():
    x, pi = torch.randn(2, 3, 5), torch.softmax(torch.randn(2, 3, 5), -1)
    assert torch.allclose(jump(x, pi, 0.3, 1.0), pi)
    assert torch.equal(jump(x, pi, 0.4, 0.4), x)
    # the diagonal is the Euler step of the teacher ODE with velocity (pi - x)/(1 - t)
    assert torch.allclose(jump(x, pi, 0.2, 0.3), x + 0.1 * (pi - x) / 0.8)


# ----------------------------------------------------------------------------- proposer cache


def test_greedy_summary_is_argmax_and_its_probability():
    logits = torch.randn(3, 5, 50) * 4
    logits[0, 0, 7] = logits[0, 0, 3] = (
        logits[0, 0].max() + 1
    )  # a tie: the first index wins, like argmax
    ids, prob = greedy_summary(logits)
    assert torch.equal(ids, logits.argmax(-1)) and ids[0, 0] == 3
    torch.testing.assert_close(prob, logits.softmax(-1).amax(-1))


def test_cache_path_equals_training_path(model):
    prop = FlashMapProposer(model, n_slots=4, max_context=32)
    lengths = {"a": 7, "b": 3, "c": 0}
    feats = fill(prop, lengths)
    T = max(lengths.values())
    padded = torch.zeros(3, T, 64)
    for i, f in enumerate(feats.values()):
        padded[i, : len(f)] = torch.from_numpy(f)
    train_ctx = model.context(padded, torch.tensor(list(lengths.values())))
    cache_ctx = prop.cross_context(list(lengths))
    x, anchor = torch.randn(3, 16, 512), torch.tensor([5, 6, 7])
    with torch.no_grad():
        want = model(x, 0.2, 0.7, anchor, train_ctx)
        got = model(x, 0.2, 0.7, anchor, cache_ctx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # select(): rows of one encoded context, cut to shorter lengths (training: many anchors per sequence)
    with torch.no_grad():
        cut = model(
            x[:2],
            0.2,
            0.7,
            anchor[:2],
            train_ctx.select(torch.tensor([0, 0]), torch.tensor([7, 3])),
        )
        ref = model(x[1:2], 0.2, 0.7, anchor[1:2], model.context(padded[:1, :3], torch.tensor([3])))
    torch.testing.assert_close(cut[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        cut[1], ref[0], atol=1e-5, rtol=1e-5
    )  # row a's context cut to 3 positions
    # the context matters (guards against a vacuous comparison)
    with torch.no_grad():
        other = model(
            x,
            0.2,
            0.7,
            anchor,
            model.context(padded + torch.randn_like(padded), torch.tensor(list(lengths.values()))),
        )
    assert not torch.allclose(other[:2], want[:2], atol=1e-3)


def test_incremental_extend_equals_one_extend(flashmap):
    F = flashmap.cfg.feature_dim
    f = features(10, F, seed=1)
    one = FlashMapProposer(flashmap, n_slots=2, max_context=16)
    one.extend("s", np.arange(10), f)
    parts = FlashMapProposer(flashmap, n_slots=2, max_context=16)
    parts.extend("s", np.arange(0), f[:0])
    for a, b in [(0, 3), (3, 4), (4, 10)]:
        parts.extend("s", np.arange(a, b), f[a:b])
    assert one.context_length("s") == parts.context_length("s") == 10
    torch.testing.assert_close(parts.k_cache, one.k_cache, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(parts.v_cache, one.v_cache, atol=1e-6, rtol=1e-5)
    req = [ProposeRequest("s", anchor=3, temperature=1.0, seed=4)]
    assert same(one.propose(req)[0], parts.propose(req)[0])
    parts.truncate("s", 6)  # roll back and resend: same state as before
    parts.extend("s", np.arange(6, 10), f[6:])
    assert same(one.propose(req)[0], parts.propose(req)[0])


def test_slots_release_and_limits(flashmap):
    prop = FlashMapProposer(flashmap, n_slots=2, max_context=8)
    F = prop.cfg.feature_dim
    prop.extend("a", np.arange(3), features(3, F, 0))
    prop.extend("b", np.arange(1), features(1, F, 1))
    with pytest.raises(SlotsExhausted, match="2 drafter slots"):
        prop.extend("c", np.arange(1), features(1, F, 2))
    with pytest.raises(ContextTooLong, match="max_context 8"):
        prop.extend("a", np.arange(6), features(6, F, 3))
    with pytest.raises(ValueError, match="features must be"):
        prop.extend("a", np.arange(2), features(3, F, 3))
    prop.truncate("a", 1)
    assert prop.context_length("a") == 1
    with pytest.raises(ValueError, match="truncate"):
        prop.truncate("a", 2)
    assert prop.bytes_per_context_token == 2 * 2 * 64 * 4  # K and V, 2 blocks, dim 64, fp32
    prop.release("a")
    prop.release("never-seen")
    assert prop.context_length("a") == 0
    prop.extend("c", np.arange(2), features(2, F, 2))
    assert prop.context_length("c") == 2 and prop.context_length("b") == 1


# ----------------------------------------------------------------------------- drafting


def requests_mix():
    return [
        ProposeRequest("a", anchor=11, seed=1),
        ProposeRequest("b", anchor=12, temperature=1.0, top_m=4, seed=2),
        ProposeRequest("c", anchor=13, temperature=0.7, top_m=3, seed=3, draft_steps=3),
        ProposeRequest("new", anchor=14, temperature=1.0, seed=4, draft_steps=2),
    ]


def test_batched_propose_equals_one_at_a_time(model):
    prop = FlashMapProposer(model, n_slots=4, max_context=32)
    fill(prop, {"a": 9, "b": 4, "c": 1})
    reqs = requests_mix()
    batched = prop.propose(reqs)
    single = [prop.propose([r])[0] for r in reqs]
    assert all(same(x, y) for x, y in zip(batched, single))
    for d, r in zip(batched, reqs):
        assert d.tokens.shape == (16,)
        if r.temperature == 0:
            assert d.support_ids.shape == (16, 1) and np.all(d.support_probs == 1)
        else:
            assert d.support_ids.shape == (16, r.top_m)
            np.testing.assert_allclose(d.support_probs.sum(1), 1, atol=1e-5)
            assert all(t in s for t, s in zip(d.tokens, d.support_ids))
            assert np.all(np.diff(d.support_probs, axis=1) <= 0)


def test_min_confidence_cuts_greedy_drafts_only(model):
    full = FlashMapProposer(model, n_slots=4, max_context=32)
    cut = FlashMapProposer(model, n_slots=4, max_context=32, min_confidence=0.5)
    for p in (full, cut):
        fill(p, {"a": 9, "b": 4, "c": 1})
    reqs = requests_mix()
    want, got = full.propose(reqs), cut.propose(reqs)
    ctx = full.cross_context(["a"])
    with torch.no_grad():  # the drafted block's own probabilities decide where it stops
        F = model.noise_factor()
        y = (draw_noise(torch.Generator().manual_seed(1), 16, F.shape[0]) @ F)[None]  # [1, K, H]
        logits = model.evaluate(
            y, model.modulations(0.0, 1.0, 1), torch.tensor([11]), ctx.kv, ctx.lengths
        )
        conf = logits.softmax(-1).amax(-1)[0].numpy()
    low = np.nonzero(conf < 0.5)[0]
    n = 16 if len(low) == 0 else max(int(low[0]), 1)
    assert len(got[0].tokens) == n and np.array_equal(got[0].tokens, want[0].tokens[:n])
    for d, w, r in zip(got[1:], want[1:], reqs[1:]):
        if r.temperature > 0:  # sampled drafts keep the full block
            assert same(d, w)
    with pytest.raises(ValueError, match="min_confidence"):
        FlashMapProposer(model, n_slots=1, max_context=8, min_confidence=1.0)


def test_mode_seeking_greedy_drafting_leaves_sampled_rows_exact(flashmap):
    """greedy_estimate = "argmax" / greedy_noise_scale change T = 0 rows only: a sampled row's
    proposal (tokens, support, q) is the flow's, whatever else is in the batch."""
    base = FlashMapProposer(flashmap, n_slots=4, max_context=32)
    mode = FlashMapProposer(
        flashmap, n_slots=4, max_context=32, greedy_estimate="argmax", greedy_noise_scale=0.5
    )
    for p in (base, mode):
        fill(p, {"a": 9, "b": 4, "c": 1})
    reqs = requests_mix()
    for steps in (1, 2, 4):
        want, got = base.propose(reqs, steps), mode.propose(reqs, steps)
        for d, w, r in zip(got, want, reqs):
            if r.temperature > 0:
                assert same(d, w)
            else:
                assert d.tokens.shape == (16,) and np.all(d.support_probs == 1)
        # a greedy row drafted alone equals the same row in the mixed batch
        assert same(mode.propose(reqs[:1], steps)[0], got[0])
    # with the noise scaled to 0 every draw gives the same greedy block
    zero = FlashMapProposer(
        flashmap, n_slots=2, max_context=32, greedy_estimate="argmax", greedy_noise_scale=0.0
    )
    fill(zero, {"a": 9})
    blocks = zero.propose([ProposeRequest("a", 11, seed=s) for s in range(3)], 4)
    assert all(np.array_equal(b.tokens, blocks[0].tokens) for b in blocks)
    with pytest.raises(ValueError, match="greedy_estimate"):
        FlashMapProposer(flashmap, n_slots=1, max_context=8, greedy_estimate="mode")
    with pytest.raises(ValueError, match="greedy_noise_scale"):
        FlashMapProposer(flashmap, n_slots=1, max_context=8, greedy_noise_scale=2.0)


def test_seeds(flashmap):
    prop = FlashMapProposer(flashmap, n_slots=2, max_context=16)
    fill(prop, {"s": 5})
    a = prop.propose([ProposeRequest("s", 7, temperature=1.0, seed=1)])[0]
    b = prop.propose([ProposeRequest("s", 7, temperature=1.0, seed=1)])[0]
    c = prop.propose([ProposeRequest("s", 7, temperature=1.0, seed=2)])[0]
    assert same(a, b)
    assert not np.array_equal(a.tokens, c.tokens)


def test_shared_noise():
    x = draw_noise(request_generator(5), 16, 512, shared=True)
    assert x.shape == (16, 512) and torch.equal(x, x[:1].expand(16, 512))
    y = draw_noise(request_generator(5), 16, 512, shared=False)
    assert not torch.equal(y[0], y[1])
    assert torch.equal(x[0], y[0])  # same stream: the first draw is the same


def test_embedded_noise_is_the_projected_vocabulary_noise(flashmap):
    """y_0 = z @ F has the law of x_0 @ E (x_0 ~ N(0, I_V)), and a jump in embedded space is
    the projection of the jump in R^V: serving's y path is the network's x path."""
    E = flashmap.embed.double()
    F = flashmap.noise_factor().double()
    assert E.shape[0] > E.shape[1] and F.shape == (E.shape[1], E.shape[1])  # the Cholesky case
    torch.testing.assert_close(F.T @ F, E.T @ E, rtol=1e-4, atol=1e-4)
    n = 20_000
    g = torch.Generator().manual_seed(0)
    y = torch.randn(n, E.shape[1], generator=g, dtype=torch.float64) @ F
    x = torch.randn(n, E.shape[0], generator=g, dtype=torch.float64) @ E
    scale = (E.T @ E).diagonal().sqrt()
    for a in (y, x):  # both covariances within sampling error of E^T E
        cov = a.T @ a / n
        assert ((cov - E.T @ E).abs() / (scale[:, None] * scale[None])).max() < 8 / n**0.5
    ctx = FlashMapProposer(flashmap, n_slots=1, max_context=4).cross_context(["none"])
    xs = torch.randn(1, 16, E.shape[0], generator=g)
    pi = torch.softmax(torch.randn(1, 16, E.shape[0], generator=g), -1)
    with torch.no_grad():
        want = flashmap(jump(xs, pi, 0.0, 0.5), 0.5, 1.0, torch.tensor([3]), ctx)
        ys = jump(flashmap.embed_state(xs), pi @ flashmap.embed, 0.0, 0.5)
        got = flashmap.evaluate(
            ys, flashmap.modulations(0.5, 1.0, 1), torch.tensor([3]), ctx.kv, ctx.lengths
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("V,H,rank", [(8, 32, 8), (64, 16, 16), (64, 16, 5)])
def test_noise_factor_small_vocabulary_and_low_rank(V, H, rank):
    """V <= H (the tiny-vocabulary tests) and an embedding without full column rank still get
    a factor with F^T F = E^T E."""
    g = torch.Generator().manual_seed(V + rank)
    E = torch.randn(V, rank, generator=g, dtype=torch.float64) @ torch.randn(
        rank, H, generator=g, dtype=torch.float64
    )
    F = noise_factor(E.float()).double()
    assert F.shape == (min(V, H), H)
    torch.testing.assert_close(F.T @ F, E.T @ E, rtol=1e-4, atol=1e-3)


def test_proposer_drafts_the_papers_inference_unless_a_departure_is_named(flashmap):
    """One noise draw per block at every temperature, T = 0 rows from the flow's own noise with
    the soft estimate, whatever the checkpoint was trained with; departures_as_trained names
    what its training departed in (here: a draw per slot)."""
    from drafter_service.flashmap_proposer import departures_as_trained

    for trained in (False, True):
        flashmap.cfg.shared_noise = trained
        p = FlashMapProposer(flashmap, n_slots=1, max_context=8)
        assert p.shared_noise and p.greedy_noise_scale == 1.0 and p.greedy_estimate == "soft"
        assert p.second_jump is None
        assert departures_as_trained(flashmap.cfg)["shared_noise"] == trained
    flashmap.cfg.shared_noise = False


def test_shared_noise_switch_changes_drafts(flashmap):
    shared = FlashMapProposer(flashmap, n_slots=1, max_context=8, shared_noise=True)
    indep = FlashMapProposer(flashmap, n_slots=1, max_context=8, shared_noise=False)
    reqs = [ProposeRequest("x", anchor=3, seed=s) for s in range(4)]
    assert any(not same(a, b) for a, b in zip(shared.propose(reqs), indep.propose(reqs)))


def test_step_schedule(flashmap, targets, monkeypatch):
    """steps 1-2: flow-map jumps (s, t) on the tau grid; steps >= 3: Euler on the diagonal; dflash: one pass."""
    calls = []

    def recorder(model):
        real = (
            model.modulations
        )  # every network evaluation asks for the adaLN vectors of its (s, t)

        def record(s, t, n):
            calls.append((round(float(s), 6), round(float(t), 6)))
            return real(s, t, n)

        monkeypatch.setattr(model, "modulations", record)

    prop = FlashMapProposer(flashmap, n_slots=1, max_context=8, steps=1)
    recorder(flashmap)
    req = [ProposeRequest("x", anchor=3)]
    prop.propose(req)
    assert calls == [(0.0, 1.0)]
    calls.clear()
    prop.set_steps(2)
    prop.propose(req)
    u = round(float(flashmap.time_grid(2)[1]), 6)  # the drafter's own time map
    assert calls == [(0.0, u), (u, 1.0)]
    calls.clear()
    prop.propose(req, draft_steps=4)
    g = [round(float(x), 6) for x in flashmap.time_grid(4)[:-1]]
    assert calls == [(a, a) for a in g]
    calls.clear()
    prop.propose(
        [ProposeRequest("x", 3, draft_steps=1), ProposeRequest("y", 3)]
    )  # override: two groups
    assert calls == [(0.0, 1.0), (0.0, u), (u, 1.0)]
    # A bad step count never gets this far: the edges refuse it (tests/test_limits.py).
    dflash = init_drafter(targets["main"], seed=0, kind="dflash", **SMALL)
    calls.clear()
    recorder(dflash)
    FlashMapProposer(dflash, n_slots=1, max_context=8, steps=3).propose([ProposeRequest("x", 3)])
    assert len(calls) == 1


def test_propose_blocks(flashmap):
    prop = FlashMapProposer(flashmap, n_slots=2, max_context=16)
    fill(prop, {"s": 4})
    reqs = [ProposeRequest("s", 7, temperature=1.0, seed=9), ProposeRequest("t", 2, seed=1)]
    blocks = prop.propose_blocks(reqs, n_blocks=3)
    assert [len(b) for b in blocks] == [3, 3]
    plain = prop.propose(reqs)
    assert same(blocks[0][0], plain[0]) and same(blocks[1][0], plain[1])
    assert not np.array_equal(blocks[0][0].tokens, blocks[0][1].tokens)


# ----------------------------------------------------------------------------- checkpoints


def test_save_load_round_trip(model, targets, tmp_path):
    save_drafter(model, tmp_path / "d")
    stored = json.loads((tmp_path / "d" / "config.json").read_text())
    assert stored["embed_hash"] == model.cfg.embed_hash and stored["kind"] == model.cfg.kind
    loaded = load_drafter(tmp_path / "d", targets["main"])
    assert loaded.cfg == model.cfg
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    p1, p2 = FlashMapProposer(model, 2, 16), FlashMapProposer(loaded, 2, 16)
    for p in (p1, p2):
        fill(p, {"s": 6})
    reqs = [
        ProposeRequest("s", 5, temperature=1.0, seed=3),
        ProposeRequest("s", 5, seed=4, draft_steps=2),
    ]
    assert all(same(a, b) for a, b in zip(p1.propose(reqs), p2.propose(reqs)))


def test_load_against_other_target(flashmap, targets, tmp_path):
    save_drafter(flashmap, tmp_path / "d")
    with pytest.raises(CheckpointError, match="another target.*embedding hash"):
        load_drafter(tmp_path / "d", targets["other_seed"])
    with pytest.raises(CheckpointError, match="another target.*vocab_size 512 vs 256"):
        load_drafter(tmp_path / "d", targets["other_vocab"])


def test_corrupt_or_missing_files(flashmap, targets, tmp_path):
    d = save_drafter(flashmap, tmp_path / "d")
    t = targets["main"]
    with pytest.raises(CheckpointError, match="no such drafter checkpoint directory"):
        load_drafter(tmp_path / "nope", t)
    cfg_text = (d / "config.json").read_text()
    (d / "config.json").write_text(cfg_text[:40])
    with pytest.raises(CheckpointError, match="config.json: unreadable"):
        load_drafter(d, t)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        load_drafter(d, t)
    (d / "config.json").write_text(cfg_text)
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        load_drafter(d, t)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: no such file"):
        load_drafter(d, t)
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_text(json.dumps({**json.loads(cfg_text), "mlp_ratio": 2.0}))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_drafter(d, t)
    (d / "config.json").write_text(json.dumps({**json.loads(cfg_text), "kind": "dflash"}))
    with pytest.raises(CheckpointError, match="missing.*unexpected"):
        load_drafter(d, t)
    for e in (CheckpointError("x"),):
        assert "\n" not in str(e)


# ----------------------------------------------------------------------------- oracle


def test_oracle_proposes_continuation_with_errors():
    V = 50
    refs = [list(range(1, 31)), [7, 7, 7, 8, 9]]
    o = OracleProposer(refs, block_size=4, vocab_size=V, error_slots=(2,))
    o.extend("a", np.array([1, 2]), np.zeros((2, 1)))
    d = o.propose([ProposeRequest("a", anchor=3)])[0]
    assert d.tokens.tolist() == [4, 6, 6, 7]  # slot 2 (token 5) replaced by 5 + 1
    assert d.support_ids.tolist() == [[4], [6], [6], [7]] and np.all(d.support_probs == 1)
    o.extend("b", np.array([7, 7]), np.zeros((2, 1)))
    assert o.propose([ProposeRequest("b", anchor=7)])[0].tokens.tolist() == [
        8,
        10,
        0,
        0,
    ]  # past the end: 0
    assert o.propose([ProposeRequest("zz", anchor=42)])[0].tokens.tolist() == [
        0,
        1,
        0,
        0,
    ]  # no match
    assert o.context_length("a") == 2
    o.release("a")
    assert o.context_length("a") == 0


def test_oracle_error_rate_is_seeded_and_wraps():
    refs = [list(range(40))]
    kw = dict(block_size=16, vocab_size=40, error_rate=0.5, seed=3)
    a = OracleProposer(refs, **kw).propose([ProposeRequest("s", 0, seed=1)])[0].tokens
    b = OracleProposer(refs, **kw).propose([ProposeRequest("s", 0, seed=1)])[0].tokens
    assert np.array_equal(a, b)
    truth = np.arange(1, 17)
    assert 0 < (a != truth).sum() < 16 and np.all((a == truth) | (a == truth + 1))
    o = OracleProposer([[0, 39]], block_size=1, vocab_size=40, error_slots=(1,))
    assert o.propose([ProposeRequest("w", 0)])[0].tokens.tolist() == [0]  # (39 + 1) % 40
    with pytest.raises(ValueError):
        OracleProposer(refs, block_size=4, vocab_size=40, error_slots=(5,))


def test_the_eval_names_each_departure_of_a_checkpoint_alone_and_together():
    """`flashmap eval` of a FlashMap checkpoint trained with departures: rows as the paper draws
    it, as trained (every departure), and each departure that stands alone."""
    from types import SimpleNamespace

    from training.eval_methods import build_methods

    ckpt = str(Path(__file__).resolve().parents[1] / "checkpoints" / "demo-flashmap-eq")
    args = SimpleNamespace(
        flashmap=ckpt, teacher=None, teacher_steps=8, dflash=None, dflash_start=None, eagle=None,
        dflash_published=None, eagle3=None, tree_blocks=[], min_confidence=0.0, no_shuffle=True,
    )  # fmt: skip
    methods, _ = build_methods(args)
    by_name = {m.name: m.departures for m in methods}
    assert by_name["flashmap-1"] == {}
    assert by_name["flashmap-trained-1"] == {"shared_noise": False, "greedy_noise_scale": 0.0}
    assert by_name["flashmap-shared-noise-1"] == {"shared_noise": False}
    assert by_name["flashmap-greedy-noise-scale-1"] == {"greedy_noise_scale": 0.0}


def test_the_eval_repeats_single_drafts_and_siblings_rows_per_support_and_depth():
    from types import SimpleNamespace

    from training.eval_methods import build_methods

    ckpt = str(Path(__file__).resolve().parents[1] / "checkpoints" / "demo-flashmap-eq")
    args = SimpleNamespace(
        flashmap=ckpt, teacher=None, teacher_steps=8, dflash=None, dflash_start=None, eagle=None,
        dflash_published=None, eagle3=None, tree_blocks=[2], min_confidence=0.0, no_shuffle=True,
        top_m=[4, 8, 16], sibling_depth=[1],
    )  # fmt: skip
    by_name = {m.name: m for m in build_methods(args)[0]}
    wide = sorted(n for n in by_name if "-m" in n)
    assert wide == [
        "flashmap-1-m16", "flashmap-1-m8", "flashmap-siblings-d1-m16", "flashmap-siblings-d1-m8",
        "flashmap-siblings-m16", "flashmap-siblings-m8",
    ]  # fmt: skip
    m = by_name["flashmap-siblings-d1-m16"]
    assert (m.top_m, m.sibling_depth, m.tree_sampling) == (16, 1, "siblings")
    assert m.runs_at(1.0) and not m.runs_at(0.0) and not by_name["flashmap-1-m8"].runs_at(0.0)


def test_the_eval_names_the_sampling_trained_dflash_rows_apart():
    """--dflash-sampling beside --dflash: the same kind of drafter, its own rows (dflash-t1...),
    so the two checkpoints' cells never meet under one name."""
    from types import SimpleNamespace

    from training.eval_methods import build_methods

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    args = SimpleNamespace(
        flashmap=None, teacher=None, teacher_steps=8, dflash=str(root / "demo-dflash-eq"),
        dflash_sampling=str(root / "demo-dflash-t1"), dflash_start=None, eagle=None,
        dflash_published=None, eagle3=None, tree_blocks=[2], min_confidence=0.0, no_shuffle=True,
        top_m=[4, 16], sibling_depth=[],
    )  # fmt: skip
    by_name = {m.name: m for m in build_methods(args)[0]}
    t1 = sorted(n for n in by_name if n.startswith("dflash-t1"))
    assert t1 == [
        "dflash-t1", "dflash-t1-m16", "dflash-t1-siblings", "dflash-t1-siblings-m16",
        "dflash-t1-tree2", "dflash-t1-tree2-rejection",
    ]  # fmt: skip
    assert {by_name[n].checkpoint for n in t1} == {args.dflash_sampling}
    assert by_name["dflash-siblings"].checkpoint == args.dflash


def test_the_eval_gives_the_eagle_style_chain_siblings_rows():
    """The EAGLE-style chain samples from its top-m law at T > 0, so its block takes siblings as
    the other drafters' do, and repeats per support size."""
    from types import SimpleNamespace

    from training.eval_methods import build_methods

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    args = SimpleNamespace(
        flashmap=None, teacher=None, teacher_steps=8, dflash=None, dflash_start=None,
        eagle=str(root / "demo-eagle"), dflash_published=None, eagle3=None, tree_blocks=[],
        min_confidence=0.0, no_shuffle=True, top_m=[4, 16], sibling_depth=[1],
    )  # fmt: skip
    by_name = {m.name: m for m in build_methods(args)[0]}
    assert sorted(by_name) == [
        "eagle", "eagle-m16", "eagle-siblings", "eagle-siblings-d1", "eagle-siblings-d1-m16",
        "eagle-siblings-m16",
    ]  # fmt: skip
    assert by_name["eagle-siblings-m16"].tree_sampling == "siblings"
