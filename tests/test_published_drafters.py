"""The drafters users already have for Qwen3: DFlash (z-lab's layout) and EAGLE-3 (SafeAILab's,
as SGLang and vLLM load it), as tiny random checkpoints written in those layouts (the same
tensor names and config keys, shapes scaled down). Loaded by the one factory, they are exact
against the target alone: greedy identical (EAGLE-3 drafting trees of 16), the first three
tokens' law at T > 0 by a chi-square test, and through the stack; a checkpoint that does not
fit the target is refused with a message naming the mismatch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from drafter_service.dflash import init_dflash, save_dflash
from drafter_service.eagle3 import init_eagle3, save_eagle3
from drafter_service.factory import load_model, load_proposer
from flashmap.checkpoint import CheckpointError
from flashmap.drafter_inputs import target_inputs
from flashmap.inprocess import decode
from flashmap.types import GenerationRequest, SamplingParams
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3
from tests.test_lossless import (
    BATCH,
    _assert_follows,
    _exact_first3,
    _first3_counts,
    _tiny_vocab_target,
)

N_LAYERS = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("published")
    target = make_random_qwen3(d / "target", num_hidden_layers=N_LAYERS, seed=5)
    save_dflash(init_dflash(target, num_hidden_layers=2, seed=1), d / "dflash", N_LAYERS)
    save_eagle3(init_eagle3(target, draft_vocab_size=300, seed=1), d / "eagle3", N_LAYERS)
    return target, d


def test_the_checkpoints_are_in_the_published_layouts(world):
    _, d = world
    dflash = json.loads((d / "dflash" / "config.json").read_text())
    assert dflash["architectures"] == ["DFlashDraftModel"] and dflash["block_size"] == 16
    assert set(dflash["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    with safe_open(str(d / "dflash" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert {f"layers.1.self_attn.{p}_proj.weight" for p in "qkvo"} <= names
    assert "layers.0.self_attn.k_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    eagle3 = json.loads((d / "eagle3" / "config.json").read_text())
    assert (
        eagle3["architectures"] == ["LlamaForCausalLMEagle3"] and eagle3["draft_vocab_size"] == 300
    )
    assert len(eagle3["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    with safe_open(str(d / "eagle3" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "lm_head.weight", "norm.weight", "midlayer.hidden_norm.weight"} <= names
    assert "midlayer.self_attn.q_proj.weight" in names


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, rng.integers(4, 24)).tolist() for _ in range(n)]


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_greedy_output_is_the_targets(world, kind):
    target, d = world
    layers, _ = target_inputs(d / kind, target, project=False)
    engine = TargetEngine(target, n_slots=6, max_seq_len=256, feature_layers=layers)
    prompts = _prompts(6, 7)
    alone = [r.token_ids for r in decode(engine, [GenerationRequest(p, 40) for p in prompts])]
    proposer = load_proposer(d / kind, target, n_slots=8, max_context=256)
    out = decode(engine, [GenerationRequest(p, 40) for p in prompts], proposer)
    assert [r.token_ids for r in out] == alone
    s = [r.stats for r in out]
    assert sum(x.drafts for x in s) > 0
    if kind == "eagle3":  # trees of 16 tokens, at most `depth` of them on one path
        assert proposer.block_size == 16
        assert sum(x.draft_tokens for x in s) > proposer.depth * sum(x.drafts for x in s)
    else:  # a block of 16 positions: the anchor and 15 drafts
        assert proposer.block_size == 15


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.slow
def test_first_three_tokens_follow_the_target(tmp_path, kind):
    path = _tiny_vocab_target(tmp_path, layers=4)  # EAGLE-3 reads three distinct layers
    if kind == "dflash":
        save_dflash(
            init_dflash(path, num_hidden_layers=1, mask_token_id=7, seed=2), tmp_path / kind, 4
        )
    else:
        save_eagle3(init_eagle3(path, draft_vocab_size=6, seed=2), tmp_path / kind, 4)
    params = SamplingParams(1.0)
    layers, _ = target_inputs(tmp_path / kind, path, project=False)
    engine = TargetEngine(path, n_slots=BATCH, feature_layers=layers)
    proposer = load_proposer(tmp_path / kind, path, n_slots=BATCH, max_context=64)
    counts, accepted = _first3_counts(engine, [1, 5, 2], params, 0, proposer=proposer)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise acceptance"
    _assert_follows(counts, _exact_first3(path, [1, 5, 2], params))


def _edit_config(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_checkpoint_that_does_not_fit_the_target_is_refused_by_name(world, tmp_path):
    target, d = world
    cases = {
        "dflash_layers": (
            "dflash",
            lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 3, 4, 9]),
            "target_layer_ids",
        ),
        "dflash_hidden": ("dflash", lambda c: c.update(hidden_size=96), "hidden_size 96"),
        "dflash_vocab": ("dflash", lambda c: c.update(vocab_size=1000), "vocab_size 1000"),
        "eagle3_layers": (
            "eagle3",
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 3, 6]),
            "eagle_aux_hidden_state_layer_ids",
        ),
        "eagle3_hidden": (
            "eagle3",
            lambda c: c.update(target_hidden_size=128),
            "target_hidden_size 128",
        ),
        "eagle3_vocab": ("eagle3", lambda c: c.update(vocab_size=100), "vocab_size 100"),
    }
    for name, (kind, change, words) in cases.items():
        bad = _edit_config(d / kind, tmp_path / name, change)
        with pytest.raises(CheckpointError, match=words):
            load_model(bad, target)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.stack
def test_served_by_the_stack_exactly(world, kind):
    """`flashmap up --drafter DIR`: the target computes the drafter's layers and its context
    projection; the text equals the target alone's, and acceptance is in the metrics."""
    import urllib.request

    from flashmap.client import Client
    from flashmap_cli.stack import Stack, StackConfig

    target, d = world
    layers, _ = target_inputs(d / kind, target, project=False)
    engine = TargetEngine(target, n_slots=2, max_seq_len=256, feature_layers=layers)
    prompts = _prompts(3, 11)
    want = [
        r.token_ids for r in decode(engine, [GenerationRequest(p, 32) for p in prompts])
    ]  # no stop ids
    cfg = StackConfig.on_free_ports(
        target_dir=str(target),
        drafter=str(d / kind),
        n_slots=4,
        max_seq_len=256,
        speculation="full",
    )
    with Stack(cfg), Client(cfg.url) as c:
        got = [
            list(c.generate(prompt_ids=p, max_new_tokens=32, ignore_eos=True).token_ids)
            for p in prompts
        ]
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{cfg.metrics_port}/metrics").read().decode()
        )
    assert got == want

    def total(name):
        return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(name + "{"))

    drafts, tokens = total("flashmap_num_drafts_total"), total("flashmap_num_draft_tokens_total")
    assert drafts > 0 and total("flashmap_acceptance_length_count") > 0
    if kind == "eagle3":  # trees of 16 nodes, counted as the tokens they verify
        assert tokens / drafts > 8
    else:
        assert tokens / drafts <= 15


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_flashmap_generate_in_process_serves_the_directory(world, kind, capsys):
    """`flashmap generate --in-process --drafter DIR`: the same text as --ar, with drafts."""
    from flashmap_cli.main import main

    target, d = world
    base = ["generate", "--in-process", "--target", str(target), "--prompt-ids", "5,9,14,3"]
    base += ["--max-new-tokens", "24", "--ignore-eos", "--json"]
    outs = []
    for extra in (["--ar"], ["--drafter", str(d / kind)]):
        assert main([*base, *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[1]["drafts"] > 0


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_the_graph_path_drafts_what_the_eager_path_drafts(world, kind):
    """enable_graphs(mode="static"): the padded, fixed-window pass a CUDA graph captures,
    run eagerly on the CPU, gives the eager path's drafts (batches padded to their bucket,
    contexts of different lengths, a sequence without context)."""
    target, d = world
    eager = load_proposer(d / kind, target, n_slots=8, max_context=64)
    graphed = load_proposer(d / kind, target, n_slots=8, max_context=64)
    report = graphed.enable_graphs(mode="static", batch_buckets=(4,), context_buckets=(16,))
    assert report["graphs"] == 2  # batch bucket 4 x windows 16 and max_context
    rng = np.random.default_rng(0)
    F = eager.feature_dim
    for i, m in enumerate((5, 12, 30)):
        ids, feats = rng.integers(0, 500, m), rng.standard_normal((m, F)).astype(np.float32)
        for p in (eager, graphed):
            p.extend(f"s{i}", ids, feats)
    from flashmap.drafts import ProposeRequest

    for seqs in (["s0"], ["s0", "s1", "new"], ["s2", "s1"]):  # windows 16, 16, 64
        reqs = [ProposeRequest(s, anchor=11 + j, seed=j) for j, s in enumerate(seqs)]
        want, got = eager.propose(reqs), graphed.propose(reqs)
        for a, b in zip(want, got):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert (a.parents is None) == (b.parents is None)
            if a.parents is not None:
                assert a.parents.tolist() == b.parents.tolist()
