"""DFlash as published (z-lab `dflash/model.py`): model, checkpoint layout and loader.

A DFlash drafter is a stack of Qwen3-style decoder layers that drafts a whole block in one
pass. The block is [anchor, mask, ..., mask] (`block_size` positions, the anchor at the
position after the committed context), embedded with the target's embedding; its
`block_size - 1` outputs after the anchor, through the final norm and the target's LM head,
are the draft's logits. The target's context enters by "KV injection": the hidden states of
the layers `target_layer_ids` of every committed position, concatenated and fused,

    c_p = hidden_norm(fc([h_p^(l1), ..., h_p^(ln)]))                      [H]

are projected by each layer's own k_proj / v_proj (k_norm, RoPE at position p) and
prepended to that layer's keys and values, so every block position attends to the whole
context and to the whole block (no causal mask), except in the sliding-window and causal
layers a config may ask for (drafter_service.dflash_config; the masks: `block_mask`). Only
committed positions enter the context; the block's own keys are never kept.

Checkpoint directory (the published layout): config.json, a Qwen3 config with
`architectures: ["DFlashDraftModel"]`, `block_size` and `dflash_config: {target_layer_ids,
mask_token_id}` (read at the top level too, as the reference does), and model.safetensors
with `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm
.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`. The embedding and LM head are
the target's. How config.json is read: drafter_service.dflash_config.

The injected keys / values of all layers are one matmul over stacked k/v weights
(`context_kv`, drafter_service.layers), so a round's new positions of every sequence are
written in one pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from drafter_service.dflash_config import (
    ARCHITECTURE,
    QWEN3_MAX_POSITIONS,
    WEIGHTS_FILE,
    DFlashConfig,
    published_config,
)
from drafter_service.frozen_target import FrozenTarget
from drafter_service.layers import Rotary, StackedKV, context_kv, rope
from flashmap.checkpoint import CheckpointError, load_embeddings, load_tensors, read_config
from flashmap.rope_config import read_rope_parameters


def block_mask(seen: Tensor, start: Tensor, size: int, causal: bool, window: int | None) -> Tensor:
    """Which keys the block's positions see, [B, 1, size, W + size] ([B, 1, 1, W + size] when
    every position sees the same): the context keys seen [B, W] (context key j at position j),
    then the block's (positions start [B] onwards); causal: only the block's positions up to
    the query's; window: only keys at positions > the query's - window."""
    B, W = seen.shape
    if not causal and window is None:
        return torch.cat([seen, seen.new_ones(B, size)], 1)[:, None, None]
    q = torch.arange(size, device=seen.device)
    ctx = seen[:, None].expand(B, size, W)
    blk = torch.ones(size, size, dtype=torch.bool, device=seen.device)  # [query, key]
    if causal:
        blk = blk & (q[None] <= q[:, None])
    if window is not None:
        at = start[:, None] + q  # [B, size] the block's positions
        ctx = ctx & (torch.arange(W, device=seen.device) > (at - window)[..., None])
        blk = blk & (q[None] > q[:, None] - window)
    return torch.cat([ctx, blk.expand(B, size, size)], -1)[:, None]


# ----------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        h, kv, d, b = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, h * d, bias=b)
        self.k_proj = nn.Linear(c.hidden_size, kv * d, bias=b)
        self.v_proj = nn.Linear(c.hidden_size, kv * d, bias=b)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=b)
        self.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class DFlashDrafter(FrozenTarget):
    """The published DFlash network over the target's frozen embedding / LM head."""

    def __init__(
        self, cfg: DFlashConfig, embed: Tensor | None = None, lm_head: Tensor | None = None
    ):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, ARCHITECTURE)
        self._init_target(embed, lm_head)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.feature_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._stacked_kv: StackedKV | None = None  # every layer's k/v weights (context_kv)

    @property
    def block_size(self) -> int:
        """Draft tokens per block: the block's positions after the anchor."""
        return self.cfg.block_size - 1

    def project_context(self, features: Tensor) -> Tensor:
        """The context projection (flashmap.drafter_inputs): features [.., F] -> [.., H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The injected keys and values of N context positions, every layer in one pass:
        x [N, F] features (or [N, H], projected by the target), positions [N] -> k, v
        [n_layers, N, kv_heads, head_dim] (k normalised and rotated)."""
        c = self.project_context(x) if x.shape[-1] == self.cfg.feature_dim else x
        if self._stacked_kv is None:
            attn = [layer.self_attn for layer in self.layers]
            self._stacked_kv = StackedKV([(a.k_proj, a.v_proj, a.k_norm) for a in attn])
        c_ = self.cfg
        return context_kv(
            c, positions, self._stacked_kv, c_.num_key_value_heads, c_.rms_norm_eps, self.rotary
        )

    def block_logits(
        self,
        anchor: Tensor,
        start: Tensor,
        ctx_k: list[Tensor],
        ctx_v: list[Tensor],
        lengths: Tensor,
    ) -> Tensor:
        """Draft logits [B, K, V] of the blocks after `anchor` [B] at positions `start` [B]
        (the anchor's), attending to context keys / values [B, kv, W, d] per layer, of which
        the first `lengths` [B] positions are real."""
        c = self.cfg
        B, S = anchor.shape[0], c.block_size
        W = ctx_k[0].shape[2]
        ids = torch.full((B, S), c.mask_token_id, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        x = F.embedding(ids, self.embed)  # [B, S, H]
        pos = start[:, None] + torch.arange(S, device=anchor.device)  # [B, S]
        seen = torch.arange(W, device=anchor.device)[None] < lengths[:, None]  # [B, W]
        masks: dict[tuple[bool, int | None], Tensor] = {}  # [B, 1, S | 1, W + S] per kind
        for i, (layer, k_ctx, v_ctx) in enumerate(zip(self.layers, ctx_k, ctx_v)):
            kind = c.attention(i)
            if kind not in masks:
                masks[kind] = block_mask(seen, start, S, *kind)
            mask = masks[kind]
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = rope(a.q_norm(a.q_proj(h).view(B, S, -1, c.head_dim)), pos, self.rotary)
            k = rope(a.k_norm(a.k_proj(h).view(B, S, -1, c.head_dim)), pos, self.rotary)
            v = a.v_proj(h).view(B, S, -1, c.head_dim)
            k = torch.cat([k_ctx, k.transpose(1, 2)], 2)  # [B, kv, W + S, d]
            v = torch.cat([v_ctx, v.transpose(1, 2)], 2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, mask, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(B, S, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.norm(x[:, 1:]) @ self.lm_head.T * c.output_multiplier  # [B, K, V]
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


# ----------------------------------------------------------------------------- checkpoints


def check_fits(cfg: DFlashConfig, target: dict, where: str) -> None:
    """Refuse a drafter whose shapes do not fit the target's config.json, naming the field."""
    n = int(target["num_hidden_layers"])
    if cfg.hidden_size != int(target["hidden_size"]):
        raise CheckpointError(
            f"{where}: hidden_size {cfg.hidden_size} does not fit the target's "
            f"hidden_size {target['hidden_size']}"
        )
    if cfg.vocab_size != int(target["vocab_size"]):
        raise CheckpointError(
            f"{where}: vocab_size {cfg.vocab_size} does not fit the target's "
            f"vocab_size {target['vocab_size']}"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n]
    if bad or len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids):
        raise CheckpointError(
            f"{where}: target_layer_ids {list(cfg.target_layer_ids)} do not fit a target of "
            f"{n} layers (distinct ids in [0, {n}))"
        )
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise CheckpointError(
            f"{where}: mask_token_id {cfg.mask_token_id} is outside the vocabulary [0, {cfg.vocab_size})"
        )


def load_dflash(
    directory: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> DFlashDrafter:
    """A published DFlash checkpoint directory over the target in target_dir."""
    directory = Path(directory)
    where = str(directory / "config.json")
    cfg = DFlashConfig.from_json(read_config(directory), where)
    check_fits(cfg, read_config(target_dir), where)
    embed, lm_head = load_embeddings(target_dir)
    model = DFlashDrafter(cfg)
    state = load_tensors(directory)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unknown = sorted(set(state) - set(want))
    if missing or unknown:
        raise CheckpointError(
            f"{directory}: not the DFlash layout (missing {missing[:4]}, unexpected {unknown[:4]})"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise CheckpointError(
                f"{directory}: {name} has shape {tuple(t.shape)}, the config wants "
                f"{tuple(want[name].shape)}"
            )
    if dtype is None:
        dtype = (
            next(iter(state.values())).dtype if str(device).startswith("cuda") else torch.float32
        )
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    model.set_target(embed.float(), lm_head.float())
    return model.to(device, dtype).eval()


def save_dflash(model: DFlashDrafter, directory: str | Path, num_target_layers: int) -> Path:
    """Write model in the published layout (bf16 weights, as released)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = published_config(model.cfg) | {"num_target_layers": num_target_layers}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {
        k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()
    }
    save_file(state, str(directory / WEIGHTS_FILE))
    return directory


def init_dflash(
    target_dir: str | Path,
    *,
    num_hidden_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
) -> DFlashDrafter:
    """A freshly initialised DFlash for the target (its width, heads and vocabulary), e.g. to
    write a tiny checkpoint in the published layout for tests, or to train one."""
    from flashmap.types import feature_layers_for

    t = read_config(target_dir)
    where = str(Path(target_dir) / "config.json")
    positions = int(t.get("max_position_embeddings") or QWEN3_MAX_POSITIONS)
    n = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    cfg = DFlashConfig(
        hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads", heads)),
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        vocab_size=int(t["vocab_size"]),
        target_layer_ids=tuple(target_layer_ids or feature_layers_for(n)),
        mask_token_id=int(t["vocab_size"]) - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope=read_rope_parameters(t, where, positions),
        max_position_embeddings=positions,
    )
    check_fits(cfg, t, where)
    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02, generator=g)
    embed, lm_head = load_embeddings(target_dir)
    model.set_target(embed.float(), lm_head.float())
    return model
