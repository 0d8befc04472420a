"""Published drafter configs read as the reference loaders read them: RoPE from `rope_theta`
(transformers 4.x) or `rope_parameters` (5.x) alike, transformers' defaults where a field is
missing, the scaled kinds transformers computes (linear, llama3, yarn) with its own
frequencies, DFlash's sliding-window and causal layers with the masks the references use, and
every field the drafters cannot run refused in one line that names it. The reference is the
installed transformers: its Qwen3Config / LlamaConfig, rotary embeddings and mask functions."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from transformers import masking_utils
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from drafter_service import dflash_config, eagle3
from drafter_service.dflash import block_mask, init_dflash, save_dflash
from drafter_service.dflash_config import DFlashConfig, attention_layout, published_config
from drafter_service.eagle3 import Eagle3Config, init_eagle3, save_eagle3
from drafter_service.factory import load_model, load_proposer
from drafter_service.layers import Rotary, rope
from flashmap.checkpoint import CheckpointError
from flashmap.drafter_inputs import target_inputs
from flashmap.drafts import ProposeRequest
from flashmap.inprocess import decode
from flashmap.rope_config import DEFAULT_ROPE_THETA, RopeParameters, read_rope_parameters
from flashmap.types import GenerationRequest
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3

N_LAYERS = 6
REFERENCE = {"dflash": transformers.Qwen3Config, "eagle3": transformers.LlamaConfig}
ROTARY = {  # the reference loaders' rotary embedding and its application
    "dflash": (modeling_qwen3.Qwen3RotaryEmbedding, modeling_qwen3.apply_rotary_pos_emb),
    "eagle3": (modeling_llama.LlamaRotaryEmbedding, modeling_llama.apply_rotary_pos_emb),
}


def _sharpen(model):
    """Larger attention weights than a fresh drafter's, so that positions (RoPE, windows)
    change its drafts, not only its logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10)
            if name.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(5)
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    target = make_random_qwen3(d / "target", num_hidden_layers=N_LAYERS, seed=5)
    dflash = _sharpen(init_dflash(target, num_hidden_layers=2, seed=1))
    save_dflash(dflash, d / "dflash", N_LAYERS)
    save_eagle3(_sharpen(init_eagle3(target, draft_vocab_size=300, seed=1)), d / "eagle3", N_LAYERS)
    return target, d


def _variant(src, dst, change):
    """A copy of checkpoint src whose config.json `change` edits (returns dst)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _keys(model, kind: str) -> torch.Tensor:
    """The drafter's rotated keys of 40 positions on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(40)
    with torch.no_grad():
        if kind == "dflash":
            return model.context_kv(torch.randn(40, model.cfg.feature_dim, generator=g), pos)[0]
        h = torch.randn(1, 40, model.cfg.hidden_size, generator=g)
        return model.qkv(h, pos[None] + 3, pos[None])[1]


def _drafts(directory, target) -> list:
    """The drafts of a proposer over the checkpoint, for two fixed contexts."""
    p = load_proposer(directory, target, n_slots=4, max_context=64)
    rng = np.random.default_rng(0)
    for i, m in enumerate((5, 30)):
        ids, feats = rng.integers(0, 500, m), rng.standard_normal((m, p.feature_dim))
        p.extend(f"s{i}", ids, feats.astype(np.float32))
    out = p.propose([ProposeRequest(f"s{i}", anchor=11 + i, seed=i) for i in range(2)])
    return [(x.tokens.tolist(), None if x.parents is None else x.parents.tolist()) for x in out]


# ----------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_rope_parameters_only_drafts_what_top_level_rope_theta_drafts(world, tmp_path, kind):
    target, d = world
    top = _variant(d / kind, tmp_path / "top", lambda c: c.update(rope_theta=5e5))
    params = {"rope_type": "default", "rope_theta": 5e5}
    new = _variant(d / kind, tmp_path / "new", lambda c: c.update(rope_parameters=params))
    other = _variant(d / kind, tmp_path / "other", lambda c: c.update(rope_theta=2e4))
    models = {p.name: load_model(p, target) for p in (top, new, other)}
    assert models["top"].cfg.rope.theta == models["new"].cfg.rope.theta == 5e5
    keys = {name: _keys(m, kind) for name, m in models.items()}
    assert torch.equal(keys["top"], keys["new"])
    assert not torch.allclose(keys["top"], keys["other"])
    drafts = _drafts(top, target)
    assert drafts == _drafts(new, target)
    assert drafts != _drafts(other, target)  # the base reaches the drafts


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_config_without_rope_theta_gets_transformers_default(world, tmp_path, kind):
    target, d = world
    default = REFERENCE[kind]().rope_parameters["rope_theta"]
    none = _variant(d / kind, tmp_path / "none", lambda c: None)
    explicit = _variant(d / kind, tmp_path / "explicit", lambda c: c.update(rope_theta=default))
    a, b = load_model(none, target), load_model(explicit, target)
    assert a.cfg.rope.theta == default
    assert torch.equal(_keys(a, kind), _keys(b, kind))
    assert _drafts(none, target) == _drafts(explicit, target)


def test_the_defaults_are_transformers():
    q, ll = transformers.Qwen3Config(), transformers.LlamaConfig()
    assert DEFAULT_ROPE_THETA == q.rope_parameters["rope_theta"] == ll.rope_parameters["rope_theta"]
    assert dflash_config.QWEN3_MAX_POSITIONS == q.max_position_embeddings
    assert eagle3.QWEN3_MAX_POSITIONS == q.max_position_embeddings
    assert eagle3.LLAMA_MAX_POSITIONS == ll.max_position_embeddings
    assert dflash_config.QWEN3_MAX_WINDOW_LAYERS == q.max_window_layers
    assert (
        dflash_config.QWEN3_SLIDING_WINDOW
        == transformers.Qwen3Config(use_sliding_window=True).sliding_window
    )


RAW = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=100,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
STYLES = [
    {},
    {"rope_theta": 5e5},
    {"rope_theta": 5e5, "rope_scaling": None},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 3e5},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 3e5},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 3e5},
    {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_theta": 7e5},
    },
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}},
    {"rope_scaling": {"type": "yarn", "factor": 4.0}, "original_max_position_embeddings": 32},
    {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "max_position_embeddings": 512},
]


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.parametrize("style", STYLES, ids=range(len(STYLES)))
def test_rope_is_read_and_rotates_as_transformers_does(kind, style):
    """Both layouts standardize to transformers' own rope_parameters, and the rotation of q / k
    is its rotary embedding's (the scaled kinds by its init functions)."""
    raw = {**RAW, **style}
    ref = REFERENCE[kind].from_dict(copy.deepcopy(raw))
    ref.standardize_rope_params()  # as its rotary embedding does before reading them
    want = {k: v for k, v in ref.rope_parameters.items() if k != "type"}
    positions = raw.get("max_position_embeddings", ref.max_position_embeddings)
    got = read_rope_parameters(copy.deepcopy(raw), "config.json", positions)
    assert got.as_dict() == want
    rotary = Rotary(got, 16, positions, "config.json")
    x = torch.randn(2, 50, 4, 16, generator=torch.Generator().manual_seed(1))  # [B, L, h, d]
    pos = torch.arange(50).expand(2, 50) * 3
    embedding, apply = ROTARY[kind]
    cos, sin = embedding(ref)(x, pos)
    want_x, _ = apply(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(rope(x, pos, rotary), want_x.transpose(1, 2), rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_scaled_rope_config_loads_and_serves_exactly(world, tmp_path, kind):
    """yarn in the 4.x layout: the drafter's rotation is the yarn one, and greedy output through
    it is the target's alone."""
    target, d = world
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}  # of 512
    scaled = _variant(d / kind, tmp_path / "yarn", lambda c: c.update(rope_scaling=yarn))
    plain = _variant(d / kind, tmp_path / "plain", lambda c: None)
    model = load_model(scaled, target)
    assert model.cfg.rope.rope_type == "yarn" and model.rotary.scale != 1.0
    assert not torch.allclose(_keys(model, kind), _keys(load_model(plain, target), kind))
    assert_serves_exactly(scaled, target)


def assert_serves_exactly(directory, target):
    layers, _ = target_inputs(directory, target, project=False)
    engine = TargetEngine(target, n_slots=2, max_seq_len=128, feature_layers=layers)
    prompts = [[5, 9, 14, 3, 7], [11, 2, 8, 30, 41, 6, 19]]
    alone = [r.token_ids for r in decode(engine, [GenerationRequest(p, 20) for p in prompts])]
    proposer = load_proposer(directory, target, n_slots=4, max_context=128)
    out = decode(engine, [GenerationRequest(p, 20) for p in prompts], proposer)
    assert [r.token_ids for r in out] == alone
    assert sum(r.stats.drafts for r in out) > 0


def test_what_is_written_is_read_back_by_transformers_and_by_the_loaders():
    rope_p = RopeParameters(
        5e5, "yarn", (("factor", 4.0), ("original_max_position_embeddings", 64))
    )
    cfg = DFlashConfig(
        **{k: v for k, v in RAW.items() if k != "vocab_size"},
        vocab_size=100,
        target_layer_ids=(1, 2),
        mask_token_id=99,
        rope=rope_p,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=24,
    )
    written = published_config(cfg)
    assert DFlashConfig.from_json(copy.deepcopy(written)) == cfg
    ref = transformers.Qwen3Config.from_dict(copy.deepcopy(written))
    assert {k: v for k, v in ref.rope_parameters.items() if k != "type"} == rope_p.as_dict()
    assert (tuple(ref.layer_types), ref.sliding_window) == (cfg.layer_types, 24)
    e = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        draft_vocab_size=50,
        target_hidden_size=64,
        aux_layer_ids=(1, 2, 3),
        rope=rope_p,
    )
    written = eagle3.published_config(e, 6)
    assert Eagle3Config.from_json(copy.deepcopy(written)) == e
    ref = transformers.LlamaConfig.from_dict(copy.deepcopy(written))
    assert {k: v for k, v in ref.rope_parameters.items() if k != "type"} == rope_p.as_dict()


# ----------------------------------------------------------------------------- DFlash layers


LAYOUTS = [
    {},
    {"use_sliding_window": True, "sliding_window": 8},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    {"use_sliding_window": True, "max_window_layers": 0},
    {
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 8,
    },
    {"layer_types": ["full_attention", "full_attention"], "sliding_window": 8},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=range(len(LAYOUTS)))
def test_layer_types_and_window_are_read_as_qwen3config_does(layout):
    raw = {**RAW, **layout}
    ref = transformers.Qwen3Config.from_dict(copy.deepcopy(raw))
    types, window, _ = attention_layout(copy.deepcopy(raw), 16, "config.json")
    assert list(types) == ref.layer_types
    assert window == (ref.sliding_window if "sliding_attention" in types else None)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 20)])
def test_block_masks_are_the_reference_masks(causal, window):
    """Each block position (absolute position start + s) sees the committed context keys and the
    block's keys that transformers' mask functions allow: causal_mask_function when causal,
    sliding_window_overlay for a window (the left edge every reference shares)."""
    S, W = 6, 12
    lengths = torch.tensor([12, 7, 0])
    seen = torch.arange(W)[None] < lengths[:, None]
    got = block_mask(seen, lengths, S, causal, window).expand(3, 1, S, W + S)
    rules = [masking_utils.causal_mask_function] if causal else []
    if window is not None:
        rules.append(masking_utils.sliding_window_overlay(window))
    rule = masking_utils.and_masks(*rules) if rules else None
    for b, n in enumerate(lengths.tolist()):
        for s in range(S):
            q = n + s
            for k in range(W + S):
                kv = k if k < W else n + (k - W)
                ok = k < n if k < W else True
                if rule is not None:
                    ok = ok and bool(rule(0, 0, torch.tensor(q), torch.tensor(kv)))
                assert bool(got[b, 0, s, k]) == ok, (b, s, k)


def test_sliding_window_layers_draft_and_serve_exactly(world, tmp_path):
    target, d = world
    types = ["sliding_attention", "full_attention"]

    def layout(window, causal=None):
        def change(c):
            c.update(layer_types=types, use_sliding_window=True, sliding_window=window)
            if causal is not None:
                c["is_causal"] = causal

        return change

    full = _variant(d / "dflash", tmp_path / "full", lambda c: None)
    wide = _variant(d / "dflash", tmp_path / "wide", layout(10_000, causal=False))
    narrow = _variant(d / "dflash", tmp_path / "narrow", layout(4))
    m = {p.name: load_model(p, target) for p in (full, wide, narrow)}
    assert [m["narrow"].cfg.attention(i) for i in (0, 1)] == [(True, 4), (False, None)]

    def logits(model):  # two blocks over one 30-position context, of which 30 and 9 committed
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            features = torch.randn(30, model.cfg.feature_dim, generator=g)
            k, v = model.context_kv(features, torch.arange(30))  # [L, 30, kv, d]
            k, v = (list(t.transpose(1, 2)[:, None].expand(-1, 2, -1, -1, -1)) for t in (k, v))
            n = torch.tensor([30, 9])
            return model.block_logits(torch.tensor([5, 8]), n, k, v, n)

    assert torch.equal(logits(m["full"]), logits(m["wide"]))  # a window that never bites
    assert not torch.allclose(logits(m["full"]), logits(m["narrow"]))
    drafts = _drafts(full, target)
    assert drafts == _drafts(wide, target) and drafts != _drafts(narrow, target)
    assert_serves_exactly(narrow, target)


# ----------------------------------------------------------------------------- refusals


REFUSED = {
    "dynamic": (
        "both",
        lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
        "rope_type 'dynamic'",
    ),
    "longrope": (
        "both",
        lambda c: c.update(
            rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
        ),
        "rope_type 'longrope'",
    ),
    "no_factor": ("both", lambda c: c.update(rope_parameters={"rope_type": "linear"}), "factor"),
    "null_theta": ("both", lambda c: c.update(rope_theta=None), "rope_theta null"),
    "partial": ("both", lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    "nested": (
        "both",
        lambda c: c.update(rope_parameters={"full_attention": {"rope_type": "default"}}),
        "rope_parameters nested",
    ),
    "no_window": (
        "dflash",
        lambda c: c.update(layer_types=["sliding_attention"] * 2),
        "layer_types",
    ),
    "kind": ("dflash", lambda c: c.update(layer_types=["chunked_attention"] * 2), "layer_types"),
    "length": ("dflash", lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    "window": (
        "dflash",
        lambda c: c.update(
            layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=0
        ),
        "sliding_window 0",
    ),
    "bidirectional": (
        "dflash",
        lambda c: c.update(
            layer_types=["sliding_attention"] * 2,
            use_sliding_window=True,
            sliding_window=8,
            is_causal=False,
        ),
        "sliding_window 8",
    ),
    "causal": ("dflash", lambda c: c.update(is_causal="yes"), "is_causal"),
    "eagle_types": ("eagle3", lambda c: c.update(layer_types=["sliding_attention"]), "layer_types"),
    "eagle_window": (
        "eagle3",
        lambda c: c.update(use_sliding_window=True, sliding_window=8),
        "use_sliding_window",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_field_the_drafter_cannot_run_is_refused_in_one_line_naming_it(world, tmp_path, name):
    target, d = world
    kinds, change, words = REFUSED[name]
    for kind in ("dflash", "eagle3") if kinds == "both" else (kinds,):
        bad = _variant(d / kind, tmp_path / kind, change)
        with pytest.raises(CheckpointError, match=words) as e:
            load_model(bad, target)
        assert "\n" not in str(e.value) and "config.json" in str(e.value)
