"""EAGLE-style baseline drafter and the evaluation script (training/evaluate.py).

A tiny random target (V = 512, H = 64, 4 layers) and tiny untrained drafters; every
decode is short. The whole file runs in well under a minute on two CPU cores.
"""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from drafter_service.checkpoint import checkpoint_kind, init_drafter, save_drafter
from drafter_service.eagle import EagleProposer, init_eagle, load_eagle, rollout_mask, save_eagle
from drafter_service.flashmap_proposer import FlashMapProposer
from flashmap.checkpoint import CheckpointError
from flashmap.drafts import ProposeRequest
from flashmap.inprocess import decode
from flashmap.types import GenerationRequest, SamplingParams
from tests.drafter_helpers import one_thread  # noqa: F401 - autouse fixture

TINY = dict(n_heads=4, n_layers=1, block_size=16, train_depth=3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from target_service.engine import TargetEngine
    from target_service.random_checkpoint import make_random_qwen3

    root = tmp_path_factory.mktemp("eagle")
    target = make_random_qwen3(root / "target", with_tokenizer=False)
    engine = TargetEngine(target, n_slots=2, max_seq_len=96)
    return root, target, engine


def randomize(model, seed=0):
    """Larger random weights, so drafts depend on the context, the features and the own hidden state."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def test_rollout_mask_is_the_drafted_chain():
    m = rollout_mask(5, 2)
    assert m.shape == (5, 15)
    # query p = 4, step 2: real keys 0..2, the step-1 key of position 3, its own step-2 key
    assert m[4].nonzero()[:, 0].tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert rollout_mask(4, 0).equal(torch.ones(4, 4).tril().bool())
    assert bool(m.any(1).all())  # no query without a key (no NaN rows)


def test_proposer_chain_matches_training_rollout(world):
    """The proposer's cached, batched chain drafts what the training rollout predicts."""
    _, target, _ = world
    model = randomize(init_eagle(target, seed=0, **TINY)).eval()
    F = model.cfg.feature_dim
    rng = np.random.default_rng(0)
    prop = EagleProposer(model, n_slots=3, max_context=64)
    L, anchor = 9, 7
    ctx, feats = rng.integers(0, 512, L), rng.standard_normal((L, F)).astype(np.float32)
    prop.extend("a", ctx[:4], feats[:4])  # two extends: the finalized-position bookkeeping
    prop.extend("a", ctx[4:], feats[4:])
    prop.extend("b", ctx[:3], feats[:3])
    d_b, d_a, d_new = prop.propose(
        [ProposeRequest("b", 3), ProposeRequest("a", anchor), ProposeRequest("new", 2)]
    )
    seq = np.concatenate([ctx, [anchor], d_a.tokens])
    junk = rng.standard_normal((len(seq) - L, F)).astype(
        np.float32
    )  # features past the context are not used
    with torch.no_grad():
        outs = model.rollout(
            torch.from_numpy(np.concatenate([feats, junk]))[None], torch.from_numpy(seq)[None], 16
        )
        pred = [int(model.logits(outs[s][0, L - 1 + s]).argmax()) for s in range(16)]
    assert pred == d_a.tokens.tolist()
    # alone (no batching) it is the same chain; truncate rolls the context back
    assert prop.propose([ProposeRequest("a", anchor)])[0].tokens.tolist() == d_a.tokens.tolist()
    prop.extend("a", np.array([anchor, 1, 2]), rng.standard_normal((3, F)).astype(np.float32))
    prop.truncate("a", L)
    assert prop.context_length("a") == L
    assert prop.propose([ProposeRequest("a", anchor)])[0].tokens.tolist() == d_a.tokens.tolist()
    # T > 0: top-m support with q summing to 1, the drafted token inside it; reproducible by seed
    r = ProposeRequest("a", anchor, temperature=1.0, top_m=4, seed=5)
    s1, s2 = prop.propose([r])[0], prop.propose([r])[0]
    assert s1.support_ids.shape == (16, 4) and np.allclose(s1.support_probs.sum(1), 1, atol=1e-5)
    assert all(t in ids for t, ids in zip(s1.tokens, s1.support_ids))
    assert s1.tokens.tolist() == s2.tokens.tolist()
    prop.release("a")
    assert prop.context_length("a") == 0 and len(d_new.tokens) == 16 and len(d_b.tokens) == 16


def _greedy_world(world, seed: int, n: int, max_new: int):
    """engine, a randomized tiny EAGLE drafter, n random prompts and a maker of their greedy requests."""
    _, target, engine = world
    model = randomize(init_eagle(target, seed=1, **TINY)).eval()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 500, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]
    return (
        engine,
        model,
        prompts,
        lambda: [GenerationRequest(p, max_new, SamplingParams()) for p in prompts],
    )


def test_eagle_is_lossless_in_decode(world):
    engine, model, prompts, reqs = _greedy_world(world, seed=1, n=4, max_new=24)
    base = [r.token_ids for r in decode(engine, reqs())]
    out = decode(engine, reqs(), EagleProposer(model, n_slots=2, max_context=96))
    assert [r.token_ids for r in out] == base
    assert all(r.stats.drafts > 0 for r in out)
    # T > 0 runs through the exact sampler (support + q) without error
    out = decode(
        engine,
        [
            GenerationRequest(p, 16, SamplingParams(temperature=1.0, seed=i))
            for i, p in enumerate(prompts)
        ],
        EagleProposer(model, n_slots=2, max_context=96),
    )
    assert all(len(r.token_ids) > 0 for r in out)


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="torch.compile (inductor) needs a C++ compiler",
)
@pytest.mark.slow
def test_compiled_chain_is_lossless_in_decode(world):
    """enable_compile: the chain step through torch.compile, batched decode (2 slots) as above."""
    engine, model, _, reqs = _greedy_world(world, seed=2, n=3, max_new=20)
    eager = decode(engine, reqs(), EagleProposer(model, n_slots=2, max_context=96))
    prop = EagleProposer(model, n_slots=2, max_context=96)
    prop.enable_compile(warmup=False)
    out = decode(engine, reqs(), prop)
    assert (
        [r.token_ids for r in out]
        == [r.token_ids for r in eager]
        == [r.token_ids for r in decode(engine, reqs())]
    )
    assert [r.stats.accepted for r in out] == [r.stats.accepted for r in eager]  # the same drafts
    assert prop._step.failed is None


def test_training_step_lowers_loss_and_cli(world, tmp_path):
    from training import drafter_data as dd
    from training import train_eagle as te
    from training import trainer

    root, target, engine = world
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, size=int(rng.integers(3, 9))).tolist() for _ in range(4)]
    data = root / "data"
    if not data.exists():
        dd.build(
            engine,
            prompts,
            data,
            max_new_tokens=16,
            chunk_size=4,
            target_dir=target,
            progress=False,
        )
    model = init_eagle(target, seed=0, **TINY).train()
    batch = te.make_seq_batch(trainer.SequenceStream(data).take(0, 4), 256)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss, stats = te.eagle_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[0]) and losses[-1] < losses[0] - 0.5, losses
    assert {"ce0", "acc0", "ce2", "acc2"} <= set(stats)

    out = tmp_path / "eagle"
    common = [
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--small",
        "--batch-size",
        "2",
        "--n-heads",
        "4",
        "--train-depth",
        "2",
        "--log-every",
        "1",
        "--no-progress",
    ]
    assert te.main([*common, "--steps", "2"]) == 0
    assert te.main([*common, "--steps", "3", "--resume"]) == 0
    assert torch.load(out / trainer.STATE_FILE, weights_only=False)["step"] == 3
    assert (out / trainer.PNG_FILE).stat().st_size > 0
    assert checkpoint_kind(out) == "eagle"
    assert load_eagle(out, target).cfg.train_depth == 2


def test_save_load_round_trip_and_target_check(world, tmp_path):
    root, target, _ = world
    model = randomize(init_eagle(target, seed=2, **TINY)).eval()
    save_eagle(model, tmp_path / "e")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["kind"] == "eagle" and cfg["format"] == "flashmap-drafter"
    from safetensors.torch import load_file

    assert not {"embed", "lm_head"} & set(
        load_file(str(tmp_path / "e" / "model.safetensors"))
    )  # trainable only
    back = load_eagle(tmp_path / "e", target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    feats = np.random.default_rng(0).standard_normal((5, model.cfg.feature_dim)).astype(np.float32)
    drafts = []
    for m in (model, back):
        p = EagleProposer(m, n_slots=1, max_context=32)
        p.extend("s", np.arange(5), feats)
        drafts.append(p.propose([ProposeRequest("s", 3)])[0].tokens.tolist())
    assert drafts[0] == drafts[1]
    from target_service.random_checkpoint import make_random_qwen3

    other = make_random_qwen3(root / "other", with_tokenizer=False, seed=7)
    with pytest.raises(CheckpointError, match="another target"):
        load_eagle(tmp_path / "e", other)
    save_drafter(
        init_drafter(target, dim=64, n_blocks=1, n_heads=4, time_freq_dim=32), tmp_path / "f"
    )
    with pytest.raises(CheckpointError, match="not an EAGLE"):
        load_eagle(tmp_path / "f", target)


@pytest.mark.slow
def test_eval_end_to_end_and_resume(world, tmp_path):
    from training import evaluate as ev

    _, target, _ = world
    small = dict(dim=64, n_blocks=1, n_heads=4, time_freq_dim=32)
    save_drafter(
        init_drafter(target, seed=0, shared_noise=True, **small), tmp_path / "fm"
    )  # has a shuffle pair
    save_drafter(init_drafter(target, seed=1, kind="dflash", **small), tmp_path / "df")
    save_eagle(init_eagle(target, seed=0, **TINY), tmp_path / "eg")
    rng = np.random.default_rng(3)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i, dom in enumerate(["code", "math", "code"]):
            rec = {
                "domain": dom,
                "id": f"{dom}-{i}",
                "prompt_ids": rng.integers(0, 500, 6).tolist(),
            }
            f.write(json.dumps(rec) + "\n")
    out = tmp_path / "results"
    argv = [
        "--target",
        str(target),
        "--flashmap",
        str(tmp_path / "fm"),
        "--dflash",
        str(tmp_path / "df"),
        "--dflash-start",
        str(tmp_path / "df"),
        "--eagle",
        str(tmp_path / "eg"),
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "10",
        "--teacher-steps",
        "3",
        "--out-dir",
        str(out),
        "--no-progress",
        "--threads",
        "1",
        "--min-confidence",
        "0.3",
    ]
    assert ev.main(argv) == 0
    report = (out / "eval.md").read_text()
    for needle in (
        "Command: `python -m training.evaluate",
        "Machine:",
        "FlashMap, 1 jump",
        "FlashMap, 2 jumps",
        "teacher flow, 3 Euler steps",
        "DFlash-style",
        "FlashMap's warm start",
        "EAGLE-style chain",
        "Shuffle test",
        "Conditional acceptance per slot",
        "code T=0",
        "math T=1",
    ):
        assert needle in report, needle
    assert (out / "eval_acceptance.png").stat().st_size > 0 and (
        out / "eval_conditional.png"
    ).stat().st_size > 0
    cells = json.loads((out / "eval_cells.json").read_text())["cells"]
    # The cut rows at T = 0 only, the rejection-sampled trees at T = 1 only, the others at both.
    for row in ("flashmap-1-cut", "dflash-cut"):
        assert f"{row}|code|T=0" in cells and f"{row}|code|T=1" not in cells
    for row in ("flashmap-tree4-rejection", "dflash-tree4-rejection"):
        assert f"{row}|code|T=1" in cells and f"{row}|code|T=0" not in cells
    for row in ("flashmap-1", "flashmap-tree4", "dflash-tree4", "flashmap-1-indep", "eagle"):
        assert f"{row}|code|T=0" in cells and f"{row}|math|T=1" in cells
    assert "tree of 4 blocks" in report and "drafts cut below 0.3" in report
    assert all(len(c["gamma_ci"]) == 2 and len(c["speedup_ci"]) == 2 for c in cells.values())
    for c in cells.values():
        assert c["gamma"] >= 1 and c["speedup"] > 0 and c["n_prompts"] == 1
        assert c["cond_num"][0] <= c["cond_den"][0] == c["drafts"]
        if c["temperature"] == 0:
            assert c["greedy_equal"]
    a, b = cells["dflash|code|T=1"], cells["dflash-indep|code|T=1"]
    assert (a["accepted"], a["drafts"]) == (b["accepted"], b["drafts"])
    c = cells["dflash-start|code|T=1"]  # the same checkpoint given twice
    assert (a["accepted"], a["drafts"]) == (c["accepted"], c["drafts"])
    # resumed: every cell cached, nothing re-measured
    before = {k: c["run"] for k, c in cells.items()}
    del cells["eagle|math|T=1"]
    data = json.loads((out / "eval_cells.json").read_text())
    del data["cells"]["eagle|math|T=1"]
    (out / "eval_cells.json").write_text(json.dumps(data))
    assert ev.main(argv) == 0
    again = json.loads((out / "eval_cells.json").read_text())["cells"]
    assert set(again) == set(before) and all(again[k]["run"] == before[k] for k in cells)
    # other settings refuse the cache (one-line error)
    assert ev.main([*argv, "--max-new-tokens", "11"]) == 2


def test_per_slot_counts():
    from flashmap.types import SpecStats

    s = SpecStats(block_size=4)
    for drafted, accepted in [(4, 4), (4, 0), (2, 1), (3, 2)]:
        s.record_round(drafted, accepted)
    # slot 1: drafted in all 4 rounds, accepted in 3; slot 2: 3 rounds reached it, accepted in 2 ...
    assert s.verified_per_slot.tolist() == [4, 3, 2, 1] and s.accepted_per_slot.tolist() == [
        3,
        2,
        1,
        1,
    ]
    assert s.drafted_per_slot.tolist() == [4, 4, 3, 2]
    assert np.allclose(s.conditional_acceptance(), [0.75, 2 / 3, 0.5, 1.0])


def test_paired_timing_runs_every_prompt_with_every_method(world, monkeypatch):
    """run_paired: each prompt decoded by every runner back to back in rotating order, each
    runner keeps per prompt its fastest run; counts and outputs are those of one decode."""
    from flashmap import inprocess
    from flashmap.measure import run_paired, run_prompts

    _, target, engine = world
    proposer = FlashMapProposer(
        init_drafter(target, seed=0, dim=64, n_blocks=1, n_heads=4),
        n_slots=1,
        max_context=engine.max_seq_len,
    )
    order, real = [], inprocess.decode

    def spy(engine_, reqs, proposer_, *a, **kw):
        order.append(("alone" if proposer_ is None else "fm", reqs[0].request_id))
        return real(engine_, reqs, proposer_, *a, **kw)

    monkeypatch.setattr(inprocess, "decode", spy)
    prompts = [{"id": f"p{i}", "ids": [3 + i, 7, 11, 2 * i]} for i in range(2)]
    runs = run_paired(
        engine,
        prompts,
        0.0,
        8,
        0,
        {"alone": (None, 1, 1, "pick"), "fm": (proposer, 1, 1, "pick")},
        repeats=2,
    )
    assert order == [
        ("alone", "p0"),
        ("fm", "p0"),
        ("alone", "p1"),
        ("fm", "p1"),
        ("fm", "p0"),
        ("alone", "p0"),
        ("fm", "p1"),
        ("alone", "p1"),
    ]
    once = run_prompts(engine, prompts, 0.0, 8, 0, proposer)
    for name in ("alone", "fm"):
        assert len(runs[name]["prompt_walls"]) == 2 and runs[name]["wall_s"] == sum(
            runs[name]["prompt_walls"]
        )
    assert runs["fm"]["outputs"] == runs["alone"]["outputs"] == once["outputs"]
    assert (runs["fm"]["drafts"], runs["fm"]["accepted"]) == (once["drafts"], once["accepted"])
    assert runs["alone"]["drafts"] == 0 and runs["fm"]["drafts"] > 0
