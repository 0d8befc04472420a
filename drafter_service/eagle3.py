"""EAGLE-3 as published (SafeAILab `EAGLE`, `eagle/model/cnets.py`; the layout SGLang, vLLM
and SpecForge read): model, checkpoint layout and loader.

One Llama-style decoder layer ("midlayer") drafts a token per step. Position p holds

    g_p = fc([h_p^(a), h_p^(b), h_p^(c)])     the target's three layers fused   [H]
    x_p = [input_layernorm(E[t_{p+1}]), hidden_norm(g_p)]                        [2H]

q/k/v project x_p (RoPE at p, causal attention), o_proj and the MLP add onto the residual
g_p, and the layer's output o_p gives the logits of t_{p+2} through norm and lm_head over
the draft vocabulary (`draft_vocab_size` ids; target id = draft id + d2t[draft id]).
Drafting past the context feeds the layer's own output o_p in place of g (fc is skipped:
it already has width H), as EAGLE does.

Checkpoint directory: config.json (`architectures: ["LlamaForCausalLMEagle3"]`, Llama
fields read as transformers' LlamaConfig reads them (RoPE: flashmap.rope_config; the scaled
kinds linear, llama3 and yarn honoured, other kinds and sliding-window layers refused),
`draft_vocab_size`, optional `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; without them the layers are SGLang's
default, the outputs of layers 1, N/2 - 1 and N - 4 of an N-layer target) and safetensors
with `fc.weight`, `midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`, and optionally `embed_tokens.weight`
(otherwise the target's embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from drafter_service.dflash import MLP
from drafter_service.layers import Rotary, rope
from flashmap.checkpoint import (
    CheckpointError,
    config_fields,
    load_embeddings,
    load_tensors,
    read_config,
)
from flashmap.drafter_inputs import eagle3_default_layers
from flashmap.rope_config import RopeParameters, read_rope_parameters, rope_config_fields

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
LLAMA_MAX_POSITIONS = 2048  # transformers' LlamaConfig.max_position_embeddings default
QWEN3_MAX_POSITIONS = 32768  # ... and Qwen3Config's (a target's config without the field)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: default_layers of the target
    rms_norm_eps: float = 1e-6
    rope: RopeParameters = RopeParameters()
    max_position_embeddings: int = LLAMA_MAX_POSITIONS

    @property
    def feature_dim(self) -> int:
        return 3 * self.target_hidden_size

    @staticmethod
    def from_json(d: dict, where: str = "config.json") -> Eagle3Config:
        with config_fields(where):
            heads = int(d["num_attention_heads"])
            ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if int(d.get("num_hidden_layers", 1)) != 1:
                raise ValueError(f"num_hidden_layers {d['num_hidden_layers']} (EAGLE-3 has 1)")
            if ids is not None and len(ids) != 3:
                raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids} (EAGLE-3 fuses 3)")
            refuse_sliding_window(d, where)
            positions = int(d.get("max_position_embeddings") or LLAMA_MAX_POSITIONS)
            head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // heads)
            rope_params = read_rope_parameters(d, where, positions)
            Rotary(rope_params, head_dim, positions, where)  # refuses what it cannot run
            return Eagle3Config(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=head_dim,
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
                aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=rope_params,
                max_position_embeddings=positions,
            )


def is_eagle3(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def refuse_sliding_window(d: dict, where: str) -> None:
    """EAGLE-3's layer is a Llama layer: full causal attention. A config asking for a sliding
    window (which the reference loaders would ignore) is refused, naming the field."""
    types = d.get("layer_types") or []
    if "sliding_attention" in types:
        raise CheckpointError(
            f"{where}: layer_types {types} asks for sliding-window attention, which EAGLE-3's "
            "Llama layer does not have"
        )
    if d.get("use_sliding_window") and d.get("sliding_window") is not None:
        raise CheckpointError(
            f"{where}: use_sliding_window true (sliding_window {d['sliding_window']}) asks for "
            "sliding-window attention, which EAGLE-3's Llama layer does not have"
        )


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=False)


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class Eagle3Drafter(nn.Module):
    """The published EAGLE-3 network. The embedding is the checkpoint's when it has one,
    else the target's (set_embedding)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, ARCHITECTURE)
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_dim, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed", torch.empty(cfg.vocab_size, H), persistent=False)

    def set_embedding(self, embed: Tensor) -> None:
        if tuple(embed.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(
                f"embedding has shape {tuple(embed.shape)}, the config wants "
                f"{(self.cfg.vocab_size, self.cfg.hidden_size)}"
            )
        ref = self.fc.weight
        self.embed = embed.detach().to(ref.device, ref.dtype)

    def fuse(self, features: Tensor) -> Tensor:
        """g [.., H] of the target's fused layers features [.., 3 * target H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def qkv(self, g: Tensor, tokens: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries [.., n, h, d], keys and values [.., n, kv, d] of positions with hidden g
        [.., n, H] (fused features or the layer's own output), next tokens [.., n] at
        positions pos [.., n]."""
        c, m = self.cfg, self.midlayer
        x = torch.cat([m.input_layernorm(F.embedding(tokens, self.embed)), m.hidden_norm(g)], -1)
        shape = (*x.shape[:-1], -1, c.head_dim)
        a = m.self_attn
        q = rope(a.q_proj(x).view(shape), pos, self.rotary)
        k = rope(a.k_proj(x).view(shape), pos, self.rotary)
        return q, k, a.v_proj(x).view(shape)

    def finish(self, g: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """The layer's output o [B, n, H] for queries q [B, n, h, d] over keys / values
        [B, kv, T, d] with mask [B, 1, n, T] (True: visible), residual g [B, n, H]."""
        m = self.midlayer
        B, n = q.shape[:2]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, mask, enable_gqa=True)
        x = g + m.self_attn.o_proj(o.transpose(1, 2).reshape(B, n, -1))
        return x + m.mlp(m.post_attention_layernorm(x))

    def log_probs(self, o: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probabilities over the draft vocabulary [.., Vd] of the layer's output o, and
        the target ids of the draft vocabulary [Vd]."""
        logits = self.lm_head(self.norm(o)).float()
        ids = torch.arange(self.cfg.draft_vocab_size, device=o.device) + self.d2t
        return logits.log_softmax(-1), ids


# ----------------------------------------------------------------------------- checkpoints


def check_fits(cfg: Eagle3Config, target: dict, where: str) -> tuple[int, ...]:
    """The target layers the drafter reads; refuses a drafter that does not fit the target's
    config.json, naming the field."""
    n = int(target["num_hidden_layers"])
    if cfg.target_hidden_size != int(target["hidden_size"]):
        raise CheckpointError(
            f"{where}: target_hidden_size {cfg.target_hidden_size} does not fit the target's "
            f"hidden_size {target['hidden_size']}"
        )
    if cfg.vocab_size != int(target["vocab_size"]):
        raise CheckpointError(
            f"{where}: vocab_size {cfg.vocab_size} does not fit the target's "
            f"vocab_size {target['vocab_size']}"
        )
    ids = cfg.aux_layer_ids or tuple(eagle3_default_layers(n))
    if any(not 0 <= i < n for i in ids) or len(set(ids)) != 3:
        raise CheckpointError(
            f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} do not fit a target of "
            f"{n} layers (3 distinct ids in [0, {n}))"
        )
    return tuple(ids)


def load_eagle3(
    directory: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> Eagle3Drafter:
    """A published EAGLE-3 checkpoint directory over the target in target_dir."""
    directory = Path(directory)
    where = str(directory / "config.json")
    cfg = Eagle3Config.from_json(read_config(directory), where)
    layers = check_fits(cfg, read_config(target_dir), where)
    model = Eagle3Drafter(cfg)
    model.layer_ids = layers
    state = load_tensors(directory)
    embed = state.pop("embed_tokens.weight", None)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unknown = sorted(set(state) - set(want))
    if missing or unknown:
        raise CheckpointError(
            f"{directory}: not the EAGLE-3 layout (missing {missing[:4]}, unexpected {unknown[:4]})"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise CheckpointError(
                f"{directory}: {name} has shape {tuple(t.shape)}, the config wants "
                f"{tuple(want[name].shape)}"
            )
    if embed is None:
        if cfg.hidden_size != cfg.target_hidden_size:
            raise CheckpointError(
                f"{directory}: no embed_tokens.weight, and the target's embedding "
                f"({cfg.target_hidden_size} wide) does not fit hidden_size {cfg.hidden_size}"
            )
        embed, _ = load_embeddings(target_dir)
    if dtype is None:
        dtype = state["fc.weight"].dtype if str(device).startswith("cuda") else torch.float32
    model.load_state_dict(
        {k: v if k in ("d2t", "t2d") else v.to(torch.float32) for k, v in state.items()}
    )
    model = model.to(device, dtype)
    model.set_embedding(embed)
    bad = (model.d2t + torch.arange(cfg.draft_vocab_size, device=model.d2t.device)).max()
    if int(bad) >= cfg.vocab_size:
        raise CheckpointError(f"{directory}: d2t maps a draft id outside the vocabulary")
    return model.eval()


def published_config(cfg: Eagle3Config, num_target_layers: int) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(
                cfg.aux_layer_ids or eagle3_default_layers(num_target_layers)
            ),
            "use_aux_hidden_state": True,
        },
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_config_fields(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def save_eagle3(model: Eagle3Drafter, directory: str | Path, num_target_layers: int) -> Path:
    """Write model in the published layout (bf16 weights; d2t and t2d as they are)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(published_config(model.cfg, num_target_layers), indent=2) + "\n"
    )
    state = {
        k: v.detach().cpu().contiguous()
        if k in ("d2t", "t2d")
        else v.detach().to("cpu", torch.bfloat16)
        for k, v in model.state_dict().items()
    }
    save_file(state, str(directory / WEIGHTS_FILE))
    return directory


def draft_vocabulary(counts: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """d2t [size] and t2d [V] for a draft vocabulary of the `size` most frequent target ids
    (counts [V] of the training data), as EAGLE-3 builds it: draft id i is target id
    i + d2t[i], draft ids in increasing target-id order."""
    keep = counts.argsort(descending=True, stable=True)[:size].sort().values  # target ids
    d2t = keep - torch.arange(size)
    t2d = torch.zeros(counts.shape[0], dtype=torch.bool)
    t2d[keep] = True
    return d2t, t2d


def init_eagle3(
    target_dir: str | Path,
    *,
    draft_vocab_size: int | None = None,
    token_counts: Tensor | None = None,
    aux_layer_ids: tuple[int, ...] | None = None,
    seed: int = 0,
) -> Eagle3Drafter:
    """A freshly initialised EAGLE-3 for the target (its width, heads and vocabulary; the
    draft vocabulary from token_counts, else the first draft_vocab_size ids)."""
    t = read_config(target_dir)
    where = str(Path(target_dir) / "config.json")
    positions = int(t.get("max_position_embeddings") or QWEN3_MAX_POSITIONS)
    heads = int(t["num_attention_heads"])
    V = int(t["vocab_size"])
    Vd = draft_vocab_size or V
    cfg = Eagle3Config(
        hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads", heads)),
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        vocab_size=V,
        draft_vocab_size=Vd,
        target_hidden_size=int(t["hidden_size"]),
        aux_layer_ids=aux_layer_ids,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope=read_rope_parameters(t, where, positions),
        max_position_embeddings=positions,
    )
    layers = check_fits(cfg, t, where)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(cfg)
    model.layer_ids = layers
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02, generator=g)
        counts = token_counts if token_counts is not None else torch.arange(V, 0, -1).float()
        model.d2t, model.t2d = draft_vocabulary(counts, Vd)
    embed, _ = load_embeddings(target_dir)
    model.set_embedding(embed.float())
    return model
