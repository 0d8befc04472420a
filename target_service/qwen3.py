"""Qwen3 forward in plain PyTorch for the target engine (gpt-fast style).

Why not transformers: the target needs one forward over a batch of rows that each
continue their own sequence from their own position (a verify round for one
request, a prefill for another), a static slot KV cache that rolls back by
truncation, logits for a few positions per row only, and the hidden states of a
few chosen layers. That is a handful of free functions over an nn.Module that
keeps Hugging Face parameter names, so any HF Qwen3 checkpoint loads as is.

Qwen3 specifics: RMSNorm over head_dim on q and k (before RoPE), no attention
bias, SwiGLU MLP, optional tied embeddings, GQA with head_dim free of hidden/heads.

Shapes: B rows, L tokens per row (padded), M flat tokens (B * L padded, or the rows' real
tokens back to back: target_service.packing), S = attended cache length, H heads,
KV kv-heads, D head_dim, E hidden size, V vocabulary, N = selected positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashmap.checkpoint import CheckpointError, load_tensors, read_config
from target_service.qwen3_config import Qwen3Config
from target_service.torch_ops import TorchOps, rms_norm_ref

# -- building blocks (parameter names follow Hugging Face) -------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in fp32 and the gain applied after casting back, as HF does, so
        # bf16 results round the same way.
        return rms_norm_ref(x, self.weight, self.eps)


class KVCache(nn.Module):
    """One layer's static cache: K and V [n_slots, KV, max_seq_len + 1, D] (not saved).

    Position max_seq_len of each slot is scratch: padding tokens write their K/V there, so
    every pass can write all B x L entries with static shapes (no data-dependent index
    list, which a CUDA graph could not capture), and no padded entry lands on a real
    position. Attention never reads it."""

    def __init__(self, n_slots: int, n_kv: int, max_seq_len: int, head_dim: int, *, dtype, device):
        super().__init__()
        shape = (n_slots, n_kv, max_seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.kv_cache: KVCache | None = None  # set by Qwen3.setup_caches
        self.wqkv: Tensor | None = (
            None  # [(H + 2 KV) D, E]: q/k/v weights as one matrix (setup_caches)
        )


class MLP(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.w_gate_up: Tensor | None = (
            None  # [2I, E]: gate and up weights as one matrix (setup_caches)
        )


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
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    )  # [D/2]
    freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def fuse_projections(model: Qwen3) -> None:
    """Store q/k/v and gate/up of every layer as one matrix each, with the nn.Linear weights
    re-pointed at views of it (same parameter names, no second copy): one GEMM instead of
    three (two), which at batch 1 on a GPU is fewer launches and wider, more efficient reads.
    Call after the model has its final device and dtype (.to() would split them again)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, attr, linears in (
            (attn, "wqkv", (attn.q_proj, attn.k_proj, attn.v_proj)),
            (mlp, "w_gate_up", (mlp.gate_proj, mlp.up_proj)),
        ):
            ws = [lin.weight for lin in linears]
            fused = getattr(owner, attr)
            if fused is not None and _views_of(fused, ws):
                continue
            fused = torch.cat([w.detach() for w in ws], dim=0)
            start = 0
            for lin in linears:
                n = lin.weight.shape[0]
                lin.weight = nn.Parameter(
                    fused[start : start + n], requires_grad=lin.weight.requires_grad
                )
                start += n
            setattr(owner, attr, fused)


def _views_of(fused: Tensor, ws: list[Tensor]) -> bool:
    """True when ws are consecutive row blocks of fused (already fused, same storage)."""
    start = 0
    for w in ws:
        if (
            w.device != fused.device
            or w.dtype != fused.dtype
            or w.data_ptr() != fused.data_ptr() + start * fused.stride(0) * fused.element_size()
        ):
            return False
        start += w.shape[0]
    return start == fused.shape[0]


@dataclass
class AttnGroup:
    """Rows whose queries attend in one call, padded to [b, L]: query (r, l) reads its slot
    slots[r] up to cache index q_limit[r, l] (or the explicit mask). gather [b * L] maps each
    padded query to its token in the flat batch (a padding query repeats a real one and is
    dropped again); keep [n] are the real queries among the b * L and dest [n] their flat
    indices. gather None: the flat batch is this [b, L] block itself (the padded forward)."""

    slots: Tensor  # [b] int64
    q_limit: Tensor  # [b, L] int64
    kv_len: int  # cache positions the torch attention reads (>= max(q_limit) + 1)
    gather: Tensor | None = None  # [b * L] int64
    keep: Tensor | None = None  # [n] int64, None: all b * L
    dest: Tensor | None = None  # [n] int64
    mask: Tensor | None = (
        None  # [b, 1, L, kv_len] bool (tree verification) instead of the causal q_limit rule
    )


def attention(
    attn: Attention,
    ops: TorchOps,
    x: Tensor,  # [M, E], already normed
    cos: Tensor,  # [T, D] fp32 RoPE tables
    sin: Tensor,
    rope_pos: Tensor,  # [M] position of each token in its sequence
    write_slot: Tensor,  # [M] cache slot each token's K/V go to
    write_pos: Tensor,  # [M] cache index (padding: the scratch position)
    groups: list[AttnGroup],
) -> Tensor:
    M = x.shape[0]
    H, D = attn.n_heads, attn.head_dim
    qkv = F.linear(x, attn.wqkv)  # [M, (H + 2 KV) D]
    cache = attn.kv_cache
    q = ops.qk_norm_rope_write(
        qkv,
        attn.q_norm.weight,
        attn.k_norm.weight,
        attn.q_norm.eps,
        cos,
        sin,
        rope_pos,
        cache.k,
        cache.v,
        write_slot,
        write_pos,
        attn.n_heads,
        attn.n_kv,
    )  # [M, H, D]
    out = None
    for g in groups:
        b, L = g.q_limit.shape
        qg = q if g.gather is None else q.index_select(0, g.gather)  # [b * L, H, D]
        og = ops.attention(
            qg.view(b, L, H, D), cache.k, cache.v, g.slots, g.q_limit, g.kv_len, g.mask
        )
        og = og.reshape(b * L, H * D)
        if g.gather is None:
            out = og
            continue
        if out is None:
            out = og.new_empty(M, H * D)
        out.index_copy_(0, g.dest, og if g.keep is None else og.index_select(0, g.keep))
    return F.linear(out, attn.o_proj.weight)  # [M, E]


def cast_features(features: Tensor, dtype: torch.dtype) -> Tensor:
    """Features in the dtype they leave the engine in. float16 saturates at its range: a
    hidden-state outlier past 65504 must reach the drafter large, not inf."""
    if dtype == torch.float16:
        features = features.clamp(-65504.0, 65504.0)
    return features.to(dtype)


def forward_step(
    model: Qwen3,
    tokens: Tensor,  # [M] int64, the batch's tokens back to back (padding: any valid id)
    rope_pos: Tensor,  # [M] int64 position in the sequence (RoPE); padding: any valid index
    write_slot: Tensor,  # [M] int64 cache slot of each token
    write_pos: Tensor,  # [M] int64 cache index K/V are written at; padding: model.max_seq_len (scratch)
    groups: list[AttnGroup],  # every real query in exactly one group
    logit_rows: Tensor | None,  # [N] indices into M that need logits; None: all M
    feature_rows: Tensor | None,  # [M'] indices that need features; None: all M
    feature_layers: tuple[int, ...],
) -> tuple[Tensor, Tensor]:
    """The one forward of the target. Projections, MLP and LM head run over the M flat
    tokens; attention runs per group of rows (AttnGroup). Two layouts use it:
    - padded (CUDA graphs, Qwen3.forward): M = B * L with one group over the whole [B, L]
      block; static shapes, every entry computed and written (padding to the scratch
      position), nothing depends on host values but kv_len;
    - packed (the engine's eager verify, target_service.packing): M = the rows' real
      tokens, and rows grouped by length for attention, so no linear layer pays for padding.
    A query sees its slot's cache up to q_limit: entries beyond the row's start position are
    stale (rolled back) or written by this very pass, and the causal bound hides the stale
    ones; padding queries see position 0 only, which keeps their softmax finite.
    Returns logits [N, V] fp32 and features [M', F] fp32 (F = len(feature_layers) * E).
    Feature layer l is the output of decoder layer l, i.e. HF hidden_states[l+1] (for the
    last layer HF reports the final-normed state, and so does this)."""
    c, ops, layers = model.config, model.ops, model.model.layers
    n = len(layers)
    residual = model.model.embed_tokens(tokens)  # [M, E]
    x = ops.rms_norm(residual, layers[0].input_layernorm.weight, c.rms_norm_eps)
    captured: dict[int, Tensor] = {}
    for i, layer in enumerate(layers):
        a = attention(
            layer.self_attn,
            ops,
            x,
            model.rope_cos,
            model.rope_sin,
            rope_pos,
            write_slot,
            write_pos,
            groups,
        )
        residual, x = ops.add_rms_norm(
            a, residual, layer.post_attention_layernorm.weight, c.rms_norm_eps
        )
        m = F.linear(
            ops.silu_mul(F.linear(x, layer.mlp.w_gate_up)), layer.mlp.down_proj.weight
        )  # [M, E]
        norm = layers[i + 1].input_layernorm if i + 1 < n else model.model.norm
        residual, x = ops.add_rms_norm(m, residual, norm.weight, c.rms_norm_eps)
        if i in feature_layers:
            captured[i] = (
                x if i == n - 1 else residual
            )  # the last layer's output: final-normed (HF)
    pick = (lambda t: t) if logit_rows is None else (lambda t: t.index_select(0, logit_rows))
    logits = F.linear(pick(x), model.lm_head.weight).float()  # [N, V]
    if feature_layers:
        fpick = (
            (lambda t: t) if feature_rows is None else (lambda t: t.index_select(0, feature_rows))
        )
        features = torch.cat(
            [fpick(captured[l]) for l in feature_layers], dim=-1
        ).float()  # [M', F]
    else:
        features = x.new_zeros(
            (len(tokens) if feature_rows is None else len(feature_rows), 0), dtype=torch.float32
        )
    return logits, features


def padded_step(
    model: Qwen3,
    tokens: Tensor,  # [B, L] int64
    rope_pos: Tensor,  # [B, L] int64; padding: any valid index
    slots: Tensor,  # [B] int64
    write_pos: Tensor,  # [B, L] int64; padding: model.max_seq_len (scratch)
    q_limit: Tensor,  # [B, L] int64 last cache index each query attends to; padding: 0
    logit_rows: Tensor | None,  # [N] flat indices (b * L + l); None: all B * L
    feature_rows: Tensor | None,
    feature_layers: tuple[int, ...],
    kv_len: int,
    attn_mask: Tensor | None = None,  # [B, 1, L, kv_len] bool
) -> tuple[Tensor, Tensor]:
    """forward_step over a [B, L] block with static shapes (CUDA graphs, Qwen3.forward)."""
    B, L = tokens.shape
    write_slot = slots[:, None].expand(B, L).reshape(-1)  # [M]
    return forward_step(
        model,
        tokens.reshape(-1),
        rope_pos.reshape(-1),
        write_slot,
        write_pos.reshape(-1),
        [AttnGroup(slots, q_limit, kv_len, mask=attn_mask)],
        logit_rows,
        feature_rows,
        feature_layers,
    )


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
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Qwen3:
        config = Qwen3Config.from_dict(read_config(model_dir))
        with torch.device("meta"):
            model = cls(config)
        state = load_tensors(model_dir)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # some exports keep a copy; the tie wins
        expected = {
            k
            for k in model.state_dict()
            if not (config.tie_word_embeddings and k == "lm_head.weight")
        }
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing:
            raise CheckpointError(f"{model_dir}: missing tensors {sorted(missing)[:5]}")
        if unexpected:
            raise CheckpointError(
                f"{model_dir}: unexpected tensors {sorted(unexpected)[:5]} (not a Qwen3 checkpoint?)"
            )
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

    def setup_caches(self, n_slots: int, max_seq_len: int, ops: TorchOps | None = None) -> None:
        """Allocate per-layer K/V [n_slots, KV, max_seq_len + 1, D] and the RoPE tables, fuse
        the q/k/v and gate/up weights (`fuse_projections`) and pick the ops (default: the
        fused Triton kernels on CUDA when Triton is there, torch otherwise)."""
        from target_service.kernels import select_ops

        c, w = self.config, self.lm_head.weight
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(
                n_slots,
                c.num_key_value_heads,
                max_seq_len,
                c.head_dim,
                dtype=w.dtype,
                device=w.device,
            )
        cos, sin = rope_tables(c.head_dim, c.rope_theta, max_seq_len)
        # fp32 like HF; they are cast to the activation dtype where applied.
        self.register_buffer("rope_cos", cos.to(w.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(w.device), persistent=False)
        self.max_seq_len = max_seq_len
        fuse_projections(self)
        self.ops = ops if ops is not None else select_ops(w.device)

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
        """One padded pass over rows that each continue their own slot (`padded_step` with
        the index lists taken from the masks).

        Writes K/V of the valid tokens at (slot, position) and returns
        logits [N, V] fp32 for the logits_mask positions (row-major order) and
        features [M, F] for the M valid positions (row-major), F = len(feature_layers) * E.
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
        write_pos = torch.where(
            valid, cache_positions, self.max_seq_len
        )  # padding -> the scratch position
        q_limit = torch.where(valid, cache_positions, 0)
        rope_pos = torch.where(valid, positions, 0)
        logit_rows = logits_mask.reshape(-1).nonzero()[:, 0]
        feature_rows = valid.reshape(-1).nonzero()[:, 0]
        return padded_step(
            self,
            tokens,
            rope_pos,
            slots,
            write_pos,
            q_limit,
            logit_rows,
            feature_rows,
            tuple(feature_layers),
            kv_len,
            attn_mask,
        )
