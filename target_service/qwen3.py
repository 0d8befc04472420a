"""Qwen3 forward in plain PyTorch for the target engine (gpt-fast style).

Why not transformers: the target needs one forward over a batch of rows that each
continue their own sequence from their own position (a verify round for one
request, a prefill for another), a static slot KV cache that rolls back by
truncation, logits for a few positions per row only, and the hidden states of a
few chosen layers. That is a handful of free functions over an nn.Module that
keeps Hugging Face parameter names, so any HF Qwen3 checkpoint loads as is.

Qwen3 specifics: RMSNorm over head_dim on q and k (before RoPE), no attention
bias, SwiGLU MLP, optional tied embeddings, GQA with head_dim free of hidden/heads.

Shapes: B rows, L tokens per row (padded), S = attended cache length, H heads,
KV kv-heads, D head_dim, E hidden size, V vocabulary, N = selected positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashmap.checkpoint import CheckpointError, load_tensors, read_config

_SUPPORTED_ROPE_TYPES = (None, "default")


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: tuple[int, ...] = field(default=())  # normalised: HF allows int, list or null

    @classmethod
    def from_dict(cls, cfg: dict) -> "Qwen3Config":
        """Build from an HF config.json dict (transformers 4.x or 5.x layout)."""
        if cfg.get("attention_bias", False):
            raise CheckpointError("config.json: attention_bias=true is not Qwen3 (unsupported)")
        if cfg.get("use_sliding_window", False):
            raise CheckpointError("config.json: sliding-window attention is unsupported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                eos_token_id=eos,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
        except CheckpointError:
            raise
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: bad field value ({e})") from None


def _rope_theta(cfg: dict) -> float:
    """rope_theta from a 4.x config (top level + rope_scaling) or 5.x (rope_parameters)."""
    theta = cfg.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if not params:
            continue
        if not isinstance(params, dict):
            raise CheckpointError(f"config.json: {key} must be an object, got {params!r}")
        kind = params.get("rope_type", params.get("type"))
        if kind not in _SUPPORTED_ROPE_TYPES:
            raise CheckpointError(f"config.json: unsupported RoPE scaling type {kind!r} in {key} (only 'default')")
        theta = params.get("rope_theta", theta)
    return float(10000.0 if theta is None else theta)


# -- building blocks (parameter names follow Hugging Face) -------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in fp32 and the gain applied after casting back, as HF does, so
        # bf16 results round the same way.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class KVCache(nn.Module):
    """One layer's static cache: K and V [n_slots, KV, max_seq_len, D] (not saved)."""

    def __init__(self, n_slots: int, n_kv: int, max_seq_len: int, head_dim: int, *, dtype, device):
        super().__init__()
        shape = (n_slots, n_kv, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.kv_cache: KVCache | None = None  # set by Qwen3.setup_caches


class MLP(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, decoder layers, final norm."""

    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


# -- free functions ----------------------------------------------------------------


def rope_tables(head_dim: int, theta: float, max_seq_len: int) -> tuple[Tensor, Tensor]:
    """cos, sin [max_seq_len, D] in fp32, computed exactly as HF does (same op order)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [D/2]
    freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, L, heads, D]; cos, sin [B, L, D]."""
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def attention_mask(positions: Tensor, valid: Tensor, kv_len: int) -> Tensor:
    """[B, 1, L, S] bool: a query at position p sees cache positions <= p of its own slot.

    Entries of the slot beyond the row's start position are stale (rolled back) or
    being written by this very pass; the causal bound hides the stale ones. Padding
    queries look at position 0 only, which keeps their softmax finite.
    """
    q_pos = torch.where(valid, positions, 0)  # [B, L]
    cache_pos = torch.arange(kv_len, device=positions.device)  # [S]
    return (cache_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, L, S]


def attention(
    attn: Attention,
    x: Tensor,  # [B, L, E], already normed
    cos: Tensor,  # [B, L, D]
    sin: Tensor,  # [B, L, D]
    slots: Tensor,  # [B]
    positions: Tensor,  # [B, L] cache index each token is written at
    valid: Tensor,  # [B, L]
    mask: Tensor,  # [B, 1, L, S]
) -> Tensor:
    B, L, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(B, L, attn.n_heads, attn.head_dim))  # [B, L, H, D]
    k = attn.k_norm(attn.k_proj(x).view(B, L, attn.n_kv, attn.head_dim))  # [B, L, KV, D]
    v = attn.v_proj(x).view(B, L, attn.n_kv, attn.head_dim)  # [B, L, KV, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    # Write only real tokens: a padded entry must never land on a real position.
    rows, cols = valid.nonzero(as_tuple=True)  # [M], [M]
    write_slot, write_pos = slots[rows], positions[rows, cols]
    cache = attn.kv_cache
    cache.k[write_slot, :, write_pos] = k[rows, cols]  # cache.k [n_slots, KV, T, D] <- [M, KV, D]
    cache.v[write_slot, :, write_pos] = v[rows, cols]

    S = mask.shape[-1]
    keys = cache.k[slots, :, :S]  # [B, KV, S, D]
    values = cache.v[slots, :, :S]  # [B, KV, S, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))  # [B, L, E]


class Qwen3(nn.Module):
    """Qwen3ForCausalLM weights plus a static slot KV cache (see `forward`)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_seq_len = 0  # set by setup_caches

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "Qwen3":
        config = Qwen3Config.from_dict(read_config(model_dir))
        with torch.device("meta"):
            model = cls(config)
        state = load_tensors(model_dir)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # some exports keep a copy; the tie wins
        expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing:
            raise CheckpointError(f"{model_dir}: missing tensors {sorted(missing)[:5]}")
        if unexpected:
            raise CheckpointError(f"{model_dir}: unexpected tensors {sorted(unexpected)[:5]} (not a Qwen3 checkpoint?)")
        for name, t in state.items():
            want = model.get_parameter(name).shape
            if t.shape != want:
                raise CheckpointError(
                    f"{model_dir}: tensor {name} has shape {tuple(t.shape)}, config implies {tuple(want)}"
                )
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(device=device, dtype=dtype).eval()

    def setup_caches(self, n_slots: int, max_seq_len: int) -> None:
        """Allocate per-layer K/V [n_slots, KV, max_seq_len, D] and the RoPE tables."""
        c, w = self.config, self.lm_head.weight
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(
                n_slots, c.num_key_value_heads, max_seq_len, c.head_dim, dtype=w.dtype, device=w.device
            )
        cos, sin = rope_tables(c.head_dim, c.rope_theta, max_seq_len)
        # fp32 like HF; they are cast to the activation dtype where applied.
        self.register_buffer("rope_cos", cos.to(w.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(w.device), persistent=False)
        self.max_seq_len = max_seq_len

    def forward(
        self,
        tokens: Tensor,  # [B, L] int64 (padding: any valid id)
        positions: Tensor,  # [B, L] int64, absolute positions in each row's sequence
        slots: Tensor,  # [B] int64, distinct cache slots
        valid: Tensor,  # [B, L] bool, False on padding
        logits_mask: Tensor,  # [B, L] bool, positions that need logits (subset of valid)
        feature_layers: tuple[int, ...] = (),
        kv_len: int | None = None,  # max(position)+1 over the batch; computed when None
        cache_positions: Tensor | None = None,  # [B, L] where K/V are written; default: positions
        attn_mask: Tensor | None = None,  # [B, 1, L, kv_len] bool; default: causal over positions
    ) -> tuple[Tensor, Tensor]:
        """One pass over rows that each continue their own slot.

        Writes K/V of the valid tokens at (slot, position) and returns
        logits [N, V] fp32 for the logits_mask positions (row-major order) and
        features [M, F] for the M valid positions (row-major), F = len(feature_layers) * E.
        Feature layer l is the output of decoder layer l, i.e. HF hidden_states[l+1]
        (for the last layer HF reports the final-normed state, and so does this).
        Tree verification (TargetEngine.verify_tree) writes sibling branches at their own
        cache indices (cache_positions) while RoPE uses their positions in the sequence, and
        passes the tree's attention mask.
        """
        if not self.max_seq_len:
            raise RuntimeError("call setup_caches() before forward()")
        if cache_positions is None:
            cache_positions = positions
        if kv_len is None:
            kv_len = int(torch.where(valid, cache_positions, 0).max()) + 1
        n_layers = self.config.num_hidden_layers
        safe_pos = torch.where(valid, positions, 0)
        cos, sin = self.rope_cos[safe_pos], self.rope_sin[safe_pos]  # [B, L, D]
        mask = attention_mask(positions, valid, kv_len) if attn_mask is None else attn_mask  # [B, 1, L, S]

        h = self.model.embed_tokens(tokens)  # [B, L, E]
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            h = h + attention(layer.self_attn, layer.input_layernorm(h), cos, sin, slots, cache_positions, valid, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in feature_layers and i != n_layers - 1:
                captured[i] = h[valid]  # [M, E]
        h = self.model.norm(h)  # [B, L, E]
        if n_layers - 1 in feature_layers:
            captured[n_layers - 1] = h[valid]
        logits = self.lm_head(h[logits_mask]).float()  # [N, V]
        if feature_layers:
            features = torch.cat([captured[l] for l in feature_layers], dim=-1).float()  # [M, F]
        else:
            features = h.new_zeros((int(valid.sum()), 0), dtype=torch.float32)
        return logits, features
