"""Training the published architectures (training/train_published.py) and their `flashmap eval`
rows: on a tiny random target's own answers, a few steps lower the loss, the run directory is a
checkpoint in the published layout that the one factory loads and that decodes exactly what the
target alone decodes, a killed run resumes to the same result, and the eval adds the two
methods to an existing cell cache, each on an engine computing its own target layers."""

from __future__ import annotations

import csv
import json
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from drafter_service.dflash import DFlashDrafter
from drafter_service.eagle3 import Eagle3Drafter
from drafter_service.factory import load_model, load_proposer
from flashmap.drafter_inputs import target_inputs
from flashmap.inprocess import decode
from flashmap.types import GenerationRequest
from target_service.engine import TargetEngine
from tests.drafter_helpers import distilled_world, one_thread  # noqa: F401 - autouse fixture
from training import train_published as tp

DATA_LAYERS = [0, 1, 2, 3]  # every layer of the tiny target; EAGLE-3 reads [0, 2, 3] of them


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("published_training")
    target, _, _, _ = distilled_world(root, 16, 40, feature_layers=DATA_LAYERS)
    return root, target


def _config(kind: str, **arch):
    cfg = tp.PublishedTrainConfig.for_kind(kind, small=True)
    return replace(cfg, arch={**cfg.arch, **arch})


@pytest.fixture(scope="module")
def trained(world):
    root, target = world
    out = {}
    for kind, arch in (("dflash", {}), ("eagle3", {"draft_vocab_size": 128})):
        tp.train(_config(kind, **arch), target=target, data=root / "data", out=root / kind)
        out[kind] = root / kind
    return out


def _losses(run) -> list[float]:
    with open(run / "loss.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.slow
def test_training_lowers_the_loss_and_writes_the_published_layout(world, trained, kind):
    _, target = world
    losses = _losses(trained[kind])
    assert np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses
    config = json.loads((trained[kind] / "config.json").read_text())
    want = "DFlashDraftModel" if kind == "dflash" else "LlamaForCausalLMEagle3"
    assert config["architectures"] == [want]
    assert (trained[kind] / "loss.png").stat().st_size > 0
    model = load_model(trained[kind], target)
    if kind == "dflash":
        assert isinstance(model, DFlashDrafter)
        assert list(model.cfg.target_layer_ids) == DATA_LAYERS
    else:
        assert isinstance(model, Eagle3Drafter) and model.cfg.draft_vocab_size == 128
        assert list(model.layer_ids) == [0, 2, 3]
        # the draft vocabulary is the most frequent response tokens of the data
        counts = tp.response_token_counts(world[0] / "data", model.cfg.vocab_size)
        assert bool(model.t2d[counts.argmax()]) and int(model.t2d.sum()) == 128


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.slow
def test_the_trained_checkpoint_decodes_exactly_like_the_target(world, trained, kind):
    _, target = world
    layers, _ = target_inputs(trained[kind], target, project=False)
    engine = TargetEngine(target, n_slots=4, max_seq_len=128, feature_layers=layers)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 500, int(rng.integers(4, 12))).tolist() for _ in range(4)]
    alone = [r.token_ids for r in decode(engine, [GenerationRequest(p, 32) for p in prompts])]
    proposer = load_proposer(trained[kind], target, n_slots=4, max_context=128)
    out = decode(engine, [GenerationRequest(p, 32) for p in prompts], proposer)
    assert [r.token_ids for r in out] == alone
    assert sum(r.stats.accepted for r in out) > 0  # trained on the target's answers: it drafts


def test_a_killed_run_resumes_to_the_same_result(world, tmp_path, monkeypatch):
    root, target = world
    cfg = replace(_config("dflash"), steps=12, save_every=5, log_every=1)
    tp.train(cfg, target=target, data=root / "data", out=tmp_path / "whole", progress=False)

    real, calls = tp.dflash_loss, []

    def dies_at_step_8(*a, **k):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tp, "dflash_loss", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        tp.train(cfg, target=target, data=root / "data", out=tmp_path / "cut", progress=False)
    monkeypatch.setattr(tp, "dflash_loss", real)
    tp.train(
        cfg, target=target, data=root / "data", out=tmp_path / "cut", resume=True, progress=False
    )
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    a, b = (load_model(tmp_path / r, target).state_dict() for r in ("whole", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_eval_adds_the_published_rows_to_a_cell_cache(world, trained, tmp_path):
    from training import evaluate as ev

    _, target = world
    rng = np.random.default_rng(3)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i, dom in enumerate(["code", "math"]):
            ids = rng.integers(0, 500, 6).tolist()
            f.write(json.dumps({"domain": dom, "id": f"{dom}-{i}", "prompt_ids": ids}) + "\n")
    base = ["--target", str(target), "--prompts", str(tmp_path / "prompts.jsonl")]
    base += ["--max-new-tokens", "12", "--out-dir", str(tmp_path / "out"), "--no-progress"]
    dflash = ["--dflash-published", str(trained["dflash"])]
    assert ev.main([*base, *dflash]) == 0
    first = json.loads((tmp_path / "out" / "eval_cells.json").read_text())["cells"]
    time.sleep(1.1)  # another run id (seconds)
    assert ev.main([*base, *dflash, "--eagle3", str(trained["eagle3"])]) == 0
    cells = json.loads((tmp_path / "out" / "eval_cells.json").read_text())["cells"]
    assert all(cells[k]["run"] == c["run"] for k, c in first.items())  # kept, not re-measured
    for m in ("dflash-published", "eagle3-tree16"):
        for d in ("code", "math"):
            for t in (0, 1):
                c = cells[f"{m}|{d}|T={t}"]
                assert c["gamma"] >= 1 and c["speedup"] > 0
                assert c["greedy_equal"] is (True if t == 0 else None)
    report = (tmp_path / "out" / "eval.md").read_text()
    for needle in ("DFlash (published architecture)", "EAGLE-3, tree of 16", "runs of this cell"):
        assert needle in report, needle


def _random_batch(model_feature_dim: int, rng, lens, prompt_lens, vocab: int = 512):
    from training.train_eagle import SeqBatch

    T = max(lens)
    tokens = torch.zeros(len(lens), T, dtype=torch.long)
    feats = torch.zeros(len(lens), T, model_feature_dim)
    for b, n in enumerate(lens):
        tokens[b, :n] = torch.from_numpy(rng.integers(0, vocab, n))
        feats[b, :n] = torch.from_numpy(rng.standard_normal((n, model_feature_dim))).float()
    return SeqBatch(tokens, feats, torch.tensor(lens), torch.tensor(prompt_lens))


@pytest.mark.slow
def test_eagle3_windowed_rollout_is_the_whole_sequences_rollout(world, trained):
    """Steps >= 1 run on each sequence's window only; on every row that counts they give what
    the plain training-time test over whole sequences (every position, every step) gives."""
    from drafter_service.eagle import rollout_mask

    _, target = world
    model = load_model(trained["eagle3"], target)
    depth, rng = 4, np.random.default_rng(1)
    batch = _random_batch(model.cfg.feature_dim, rng, [30, 22, 17], [12, 3, 9])
    with torch.no_grad():
        o0, idx, outs = tp.eagle3_rollout(model, batch, depth)
        B, T = batch.tokens.shape
        P, nxt = T - 1, batch.tokens[:, 1:]
        pos = torch.arange(P).expand(B, P)
        g, keys, vals, full = model.fuse(batch.features[:, :P]), [], [], []
        for s in range(depth):
            if s:
                g = torch.cat([torch.zeros_like(full[-1][:, :1]), full[-1][:, :-1]], 1)
            q, k, v = model.qkv(g, nxt, pos)
            keys.append(k.transpose(1, 2))
            vals.append(v.transpose(1, 2))
            mask = rollout_mask(P, s)[None, None]
            full.append(model.finish(g, q, torch.cat(keys, 2), torch.cat(vals, 2), mask))
    assert torch.allclose(o0, full[0])
    checked = 0
    for s, o in enumerate(outs, 1):
        for b in range(B):
            for j, p in enumerate(idx[b].tolist()):
                if p >= s and batch.prompt_lens[b] <= p + 2 < batch.lengths[b]:
                    assert torch.allclose(o[b, j], full[s][b, p], atol=1e-5), (s, b, p)
                    checked += 1
    assert checked > 30


@pytest.mark.slow
def test_training_predicts_what_the_serving_proposers_draft(world, trained):
    """The training forward passes are the served drafters': DFlash's block logits for an anchor
    and EAGLE-3's rollout along a drafted chain give the proposers' greedy drafts."""
    from flashmap.drafts import ProposeRequest
    from training.flow import Batch

    _, target = world
    rng = np.random.default_rng(2)
    L, anchor = 14, 7
    for kind in ("dflash", "eagle3"):
        model = load_model(trained[kind], target)
        # EAGLE-3's chain (its sampling rows' draft with sampled_tree off), the rollout's shape.
        proposer = load_proposer(
            trained[kind], target, n_slots=2, max_context=64, sampled_tree=kind != "eagle3"
        )
        F_ = model.cfg.feature_dim
        ctx = rng.integers(0, 512, L)
        feats = rng.standard_normal((L, F_)).astype(np.float32)
        proposer.extend("s", ctx, feats)
        with torch.no_grad():
            if kind == "dflash":
                (d,) = proposer.propose([ProposeRequest("s", anchor)])
                K = model.block_size
                batch = Batch(
                    torch.from_numpy(feats)[None], torch.tensor([0]), torch.tensor([L]),
                    torch.tensor([anchor]), torch.zeros(1, K, dtype=torch.long),
                    torch.ones(1, K, dtype=torch.bool),
                )  # fmt: skip
                assert tp.dflash_logits(model, batch)[0].argmax(-1).tolist() == d.tokens.tolist()
            else:  # a chain: sampling from the top-1 is the argmax
                req = ProposeRequest("s", anchor, temperature=1.0, top_m=1)
                (d,) = proposer.propose([req])
                depth = 5
                seq = np.concatenate([ctx, [anchor], d.tokens[: depth - 1]])
                junk = rng.standard_normal((len(seq) - L, F_)).astype(np.float32)
                batch = _random_batch(F_, rng, [len(seq)], [L])
                batch.tokens[0] = torch.from_numpy(seq)
                batch.features[0] = torch.from_numpy(np.concatenate([feats, junk]))
                o0, idx, outs = tp.eagle3_rollout(model, batch, depth)
                logp, ids = model.log_probs(o0[0, L - 1])
                got = [int(ids[logp.argmax()])]
                for s, o in enumerate(outs, 1):
                    j = (idx[0] == L - 1 + s).nonzero()[0, 0]
                    logp, ids = model.log_probs(o[0, j])
                    got.append(int(ids[logp.argmax()]))
                assert got == d.tokens[:depth].tolist()


@pytest.mark.parametrize("name", ["demo-dflash-published", "demo-eagle3"])
def test_the_committed_checkpoints_are_exact_on_the_demo_target(name):
    """checkpoints/demo-dflash-published and demo-eagle3 (made by train_published) load through
    the factory and decode the demo target's own greedy text, with drafts accepted."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    drafter, target = root / name, root / "demo-target"
    if not (drafter / "model.safetensors").is_file():
        pytest.skip(f"{drafter} is not there")
    layers, _ = target_inputs(drafter, target, project=False)
    engine = TargetEngine(target, n_slots=2, max_seq_len=256, feature_layers=layers)
    from flashmap.prompts import DEV_PROMPTS, read_domain_prompts

    held = read_domain_prompts(DEV_PROMPTS, target)
    prompts = [next(p["ids"] for p in held if p["domain"] == d) for d in ("code", "math")]
    reqs = lambda: [GenerationRequest(p, 24) for p in prompts]  # noqa: E731
    alone = [r.token_ids for r in decode(engine, reqs())]
    out = decode(engine, reqs(), load_proposer(drafter, target, n_slots=2, max_context=256))
    assert [r.token_ids for r in out] == alone
    assert sum(r.stats.accepted for r in out) > 0
