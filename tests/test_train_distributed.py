"""Drafter training at scale, on the CPU: token data (training.generate_data), the target's
features computed online (training.online_features), two torchrun ranks over gloo
(training.distributed): equal replicas after every optimizer step, a run killed by SIGKILL
and resumed equal to the uninterrupted run bit for bit, FSDP2's path, and a configuration
that does not fit the target refused before any step.

A tiny random target (V = 512, H = 64, 4 layers) and the --small drafter; every torchrun
launch costs ~10 s of process start on two cores, so the 2-rank runs are few and short.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from drafter_service.checkpoint import init_drafter, save_drafter
from flashmap.types import SamplingParams, VerifyRow
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3
from training import drafter_data as dd
from training import generate_data as gd
from training import train_drafter as td
from training.online_features import OnlineTarget, share_frozen, shares_storage
from training.smoke_check import reference

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--small", "--batch-size", "16", "--anchors-per-seq", "4", "--log-every", "1"]


def _tokens(target, prompts, out, *, temperature=0.0, workers=1, worker=0, chunk=4, calls=None):
    engine = TargetEngine(target, n_slots=4, max_seq_len=96)

    def respond(chunk_prompts, first):
        if calls is not None:
            calls.append(first)
        return dd.generate_responses(engine, chunk_prompts, 24, temperature, 0, first)

    return gd.generate(
        prompts,
        out,
        target=target,
        respond=respond,
        vocab_size=engine.vocab_size,
        max_new_tokens=24,
        temperature=temperature,
        chunk_size=chunk,
        workers=workers,
        worker=worker,
        progress=False,
        say=lambda *_: None,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(root, target dir, token data dir, prompts): 16 random prompts answered greedily."""
    root = tmp_path_factory.mktemp("train_distributed")
    target = make_random_qwen3(root / "target", with_tokenizer=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, size=int(rng.integers(3, 9))).tolist() for _ in range(16)]
    _tokens(target, prompts, root / "tokens")
    return root, target, root / "tokens", prompts


def _torchrun(args: list[str], env: dict | None = None, timeout: int = 240):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "training.train_drafter", *args, "--device", "cpu", "--no-progress"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _state(run: Path) -> dict:
    return torch.load(run / "train_state.pt", weights_only=False, map_location="cpu")


def _csv(run: Path) -> list[dict]:
    with open(run / "loss.csv") as f:
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(f)]


def _equal(a, b) -> bool:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- data


def test_token_data_shards_resume_and_split_over_workers(world, tmp_path):
    root, target, tokens, prompts = world
    meta = dd.read_meta(tokens, tokens_ok=True)
    assert meta["format"] == dd.TOKEN_FORMAT
    with pytest.raises(ValueError, match="token data"):
        dd.read_meta(tokens)  # the offline trainers' reader says what they are
    seqs = [s for p in dd.list_shards(tokens) for s in dd.read_shard(p)]
    assert len(seqs) == 16 and all(s.features is None for s in seqs)
    assert [s.tokens[: s.prompt_len].tolist() for s in seqs] == prompts
    # Two workers, each its chunks (0, 2 / 1, 3), make the same shards as one.
    for w in (0, 1):
        _tokens(target, prompts, tmp_path / "split", workers=2, worker=w)
    for a, b in zip(dd.list_shards(tokens), dd.list_shards(tmp_path / "split"), strict=True):
        assert torch.equal(dd.read_shard(a)[0].tokens, dd.read_shard(b)[0].tokens)
    calls: list = []
    _tokens(target, prompts, tmp_path / "split", calls=calls)  # resumed: nothing left to do
    assert calls == []
    with pytest.raises(ValueError, match="temperature"):
        _tokens(target, prompts, tmp_path / "split", temperature=1.0)


# ----------------------------------------------------------------------------- online features


def test_online_features_are_the_serving_engines(world):
    """The trainer's features equal the serving engine's for the same tokens: bit for bit against
    the offline extractor (training.drafter_data.target_features: the same verify pass over the
    same rows), and to float rounding against one sequence per pass and against a served
    sequence (a prefill of the prompt, then rounds of K + 1 tokens), whose matmuls have other
    shapes."""
    _, target, tokens, _ = world
    seqs = [s.tokens.tolist() for p in dd.list_shards(tokens) for s in dd.read_shard(p)][:6]
    online = OnlineTarget(target, n_slots=3, max_len=96)
    got = online.features(seqs)
    assert all(g.dtype == torch.float32 and g.shape == (len(q), 64) for g, q in zip(got, seqs))
    serving = TargetEngine(target, n_slots=3, max_seq_len=96)
    for g, want in zip(got, dd.target_features(serving, seqs)):
        assert torch.equal(g, torch.from_numpy(want))
    for seq, g in zip(seqs, got):
        (alone,) = dd.target_features(serving, [seq])
        assert np.allclose(alone, g.numpy(), rtol=1e-5, atol=1e-4)
    seq, slot = seqs[0], serving.allocate()
    parts, pos = [], 0
    for n in (5, 17, 17, 100):  # a prompt, then verify rows
        chunk = np.asarray(seq[pos : pos + n], np.int64)
        if len(chunk) == 0:
            break
        (res,) = serving.verify([VerifyRow(slot, pos, chunk, SamplingParams())])
        parts.append(res.features)
        pos += len(chunk)
    serving.release(slot)
    assert np.allclose(np.concatenate(parts), got[0].numpy(), rtol=1e-5, atol=1e-4)


def test_the_drafter_reads_the_targets_embedding_and_lm_head_in_place(world):
    _, target, _, _ = world
    online = OnlineTarget(target, n_slots=2, max_len=64)
    model = share_frozen(init_drafter(target, seed=0, dim=64, n_blocks=1, n_heads=4), online)
    assert shares_storage(model.embed, online.model.model.embed_tokens.weight)
    assert shares_storage(model.lm_head, online.model.lm_head.weight)


def test_online_training_is_offline_training_with_the_same_features(world, tmp_path):
    """Token data + online features train exactly what stored fp32 features train."""
    root, target, tokens, prompts = world
    engine = TargetEngine(target, n_slots=4, max_seq_len=96)
    dd.build(
        engine,
        prompts,
        tmp_path / "feats",
        max_new_tokens=24,
        chunk_size=4,
        target_dir=target,
        progress=False,
        feature_dtype="float32",
    )
    args = ["--stage", "flow", "--target", str(target), *SMALL, "--steps", "2"]
    args += ["--check-batches", "0", "--no-progress", "--device", "cpu"]
    assert td.main([*args, "--data", str(tokens), "--out", str(tmp_path / "on")]) == 0
    assert td.main([*args, "--data", str(tmp_path / "feats"), "--out", str(tmp_path / "off")]) == 0
    assert _equal(_state(tmp_path / "on")["model"], _state(tmp_path / "off")["model"])


# ----------------------------------------------------------------------------- refused


def test_a_config_that_does_not_fit_the_target_is_refused_before_any_step(world, tmp_path, capsys):
    root, target, tokens, _ = world
    other = make_random_qwen3(tmp_path / "other", with_tokenizer=False, seed=1)
    wrong_vocab = make_random_qwen3(tmp_path / "v1024", with_tokenizer=False, vocab_size=1024)
    dflash_other = save_drafter(
        init_drafter(wrong_vocab, seed=0, kind="dflash", dim=64, n_blocks=1, n_heads=4),
        tmp_path / "dflash-other",
    )
    base = ["--stage", "flow", *SMALL, "--steps", "2", "--device", "cpu", "--no-progress"]
    cases = [
        (["--target", str(other), "--data", str(tokens)], "another target"),
        (["--target", str(target), "--data", str(tokens), "--max-len", "1024"], "context"),
        (
            ["--target", str(target), "--data", str(tokens), "--init-from", str(dflash_other)],
            "another target",
        ),
        (["--target", str(target), "--data", str(tokens), "--accum-steps", "3"], "split"),
    ]
    for i, (args, words) in enumerate(cases):
        out = tmp_path / f"run{i}"
        assert td.main([*base, *args, "--out", str(out)]) == 2, args
        assert words in capsys.readouterr().err, args
        assert not (out / "train_state.pt").exists() and not (out / "loss.csv").exists()


# ----------------------------------------------------------------------------- two ranks


@pytest.mark.slow
def test_two_ranks_stay_equal_and_a_killed_run_resumes_bit_for_bit(world, tmp_path):
    """torchrun, 2 ranks (gloo): the flow stage (DDP, held-out acceptance check), then
    distillation with 2 micro-batches per rank: the replicas' parameters are equal after every
    optimizer step; distillation killed by SIGKILL after step 3 (last save: step 2) and resumed
    ends equal to the uninterrupted run, model, optimizer, EMA, scheduler, data position and
    every logged loss, bit for bit. A 1-rank run with 2 micro-batches computes the same steps
    (to rounding), and FSDP2's path trains what DDP trains (to rounding)."""
    root, target, tokens, _ = world
    common = ["--target", str(target), "--data", str(tokens), *SMALL, "--save-every", "2"]
    flow = tmp_path / "flow"
    r = _torchrun(
        ["--stage", "flow", "--out", str(flow), "--steps", "3", *common, "--replica-digests"]
        + ["--accept-every", "3", "--accept-data", str(tokens), "--check-batches", "1"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    digests = [(flow / "replicas" / f"rank-{k}.txt").read_text().split("\n") for k in (0, 1)]
    assert digests[0] == digests[1] and len(digests[0]) == 4  # steps 1..3 and the last newline
    with open(flow / "acceptance.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["step"] == "3" and float(row["gamma_steps1"]) >= 1.0
    st = _state(flow)
    assert st["world_size"] == 2 and len(st["rng"]) == 2 and st["data"]["position"] == 12

    # One process, 2 micro-batches: the same 2 parts per step, gradients summed instead of averaged.
    one = tmp_path / "one"
    args = ["--stage", "flow", "--out", str(one), "--steps", "3", *common, "--accum-steps", "2"]
    assert td.main([*args, "--check-batches", "0", "--device", "cpu", "--no-progress"]) == 0
    for k, v in st["model"].items():
        assert torch.allclose(v, _state(one)["model"][k], atol=1e-6), k

    distill = ["--stage", "distill", "--teacher", str(flow), "--steps", "4", *common]
    distill += ["--accum-steps", "2", "--replica-digests"]
    full, cut = tmp_path / "map", tmp_path / "map-killed"
    r = _torchrun([*distill, "--out", str(full)])
    assert r.returncode == 0, r.stderr[-3000:]
    digests = [(full / "replicas" / f"rank-{k}.txt").read_text() for k in (0, 1)]
    assert digests[0] == digests[1]
    r = _torchrun([*distill, "--out", str(cut)], env={"FLASHMAP_TRAIN_KILL_AFTER_STEP": "3"})
    assert r.returncode != 0 and "SIGKILL" in r.stderr + r.stdout
    assert _state(cut)["step"] == 2 and [x["step"] for x in _csv(cut)] == ["1", "2", "3"]
    r = _torchrun([*distill, "--out", str(cut), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _state(full), _state(cut)
    for key in ("step", "model", "optimizer", "scheduler", "ema", "data"):
        assert _equal(a[key], b[key]), key
    assert _csv(full) == _csv(cut)

    fsdp = tmp_path / "fsdp"
    r = _torchrun(["--stage", "flow", "--out", str(fsdp), "--steps", "3", *common, "--fsdp"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _state(fsdp)["fsdp"] is True
    for k, v in st["model"].items():
        assert torch.allclose(v, _state(fsdp)["model"][k], atol=1e-6), k


# ----------------------------------------------------------------------------- sizing


@pytest.mark.slow
def test_the_gpu_training_step_mode_runs_at_tiny_sizes(tmp_path):
    """`python -m bench.gpu --only training` (the sizing of docs/training.md) at tiny sizes on
    the CPU: one step measured, the estimate written."""
    import json

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu",
            "--smoke",
            "--only",
            "training",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    tr = json.loads((tmp_path / "gpu_check.json").read_text())["training"]
    (row,) = tr["configs"].values()
    assert row["flow_step_ms"] > 0 and row["distill_step_ms_est"] >= row["flow_step_ms"]
    assert "training step" in p.stdout


@pytest.mark.stack
def test_token_data_through_a_running_stack_are_the_engines(tmp_path):
    """`generate_data --server`: greedy answers from the stack's Generate (speculative, exact)
    are the in-process engine's, shard for shard."""
    import json

    from flashmap_cli.stack import Stack, StackConfig

    target = make_random_qwen3(tmp_path / "target", vocab_size=320)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, size=int(rng.integers(3, 9))).tolist() for _ in range(6)]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    common = ["--target", str(target), "--prompts", str(jsonl), "--max-new-tokens", "16"]
    common += ["--temperature", "0", "--chunk-size", "3", "--no-progress", "--device", "cpu"]
    assert gd.main([*common, "--out", str(tmp_path / "engine"), "--slots", "4"]) == 0
    cfg = StackConfig.on_free_ports(
        target_dir=str(target), drafter="init", n_slots=4, max_seq_len=128
    )
    with Stack(cfg):
        assert gd.main([*common, "--out", str(tmp_path / "stack"), "--server", cfg.url]) == 0
    got = [s.tokens.tolist() for p in dd.list_shards(tmp_path / "stack") for s in dd.read_shard(p)]
    want = [
        s.tokens.tolist() for p in dd.list_shards(tmp_path / "engine") for s in dd.read_shard(p)
    ]
    # A near-tie may round either way (docs/ARCHITECTURE.md, "Floating point").
    _, gaps = reference(target, prompts, 16)
    assert len(got) == len(want) == 6
    assert all(g == w for g, w, gap in zip(got, want, gaps) if gap > 1e-3)
    assert sum(gap > 1e-3 for gap in gaps) >= 3
