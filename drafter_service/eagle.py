"""EAGLE-3-style autoregressive baseline drafter: model, serving proposer, checkpoints.

The paper's second baseline (DESIGN.md, "The method in one page"): a small causal
transformer head on the target's fused feature-layer hidden states that drafts a CHAIN
of K tokens one at a time.

Position p of a sequence t_0 t_1 ... holds

    g_p = rms(linear F->D (target features of position p))          fused features
    e_p = linear H->D (rms(E[t_{p+1}]))                              next token, frozen target embedding
    x_p = linear 2D->D ([g_p, e_p])

and n_layers causal pre-norm layers (RoPE self-attention at absolute positions, SwiGLU
MLP) give h_p, read out through  rms -> linear D->H -> frozen target LM head  as the
logits of t_{p+2}.

Drafting after an anchor t_L with context positions 0..L-1 (features known): position
L-1 (features g_{L-1}, token = anchor) gives d_1; then the drafter feeds ITS OWN hidden
state in place of the target features (as EAGLE does): position L-1+k uses
g = rms(h_{L-2+k}) and token d_k, and gives d_{k+1}, attending causally to every earlier
position (real ones and drafted ones).

Training ("training-time test", EAGLE-3): step 0 runs on the real features at every
position; step s >= 1 re-runs every position p with g = rms(h^{s-1}_{p-1}), as the s-th
drafted position after real context ending at p - s. Its queries see the step-0 keys of
positions <= p - s and the step-r key of position p - s + r for r = 1..s, which is
exactly what the proposer sees when it drafts slot s + 1. See `EagleDrafter.rollout`.

Serving (`EagleProposer`): per sequence a slot in static caches of the drafter's own
K/V ([n_layers, n_slots, h, max_context, d]) and of the projected features g. Position
p's K/V need token t_{p+1}, so the cache holds the finalized positions 0..L-2 and the
last context position is run with the anchor at propose time. Drafted positions go to a
per-call scratch copy, never to the cache. Greedy proposals at T = 0 (support {x_k});
at T > 0 slot k samples x_k from softmax(logits / T) restricted to its top-m tokens and
renormalised (support = those m ids with their q), the chain continuing from the
sampled token, so q_k is the drafter's conditional law given the drafted prefix, as
exact speculative sampling needs. Randomness per request, as in FlashMapProposer.

Checkpoints: config.json (the FlashMap drafter format tag, kind "eagle", architecture,
target reference with embedding / LM head hashes) + model.safetensors with trainable
weights only; the frozen embedding / LM head are taken from the target at load and
checked against the hashes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from drafter_service.checkpoint import CONFIG_FILE, FORMAT, FORMAT_VERSION, WEIGHTS_FILE, _hashes, _target_fields, \
    check_target
from drafter_service.flashmap_dit import apply_rope
from drafter_service.flashmap_proposer import ContextTooLong, SlotsExhausted, request_generator
from drafter_service.proposer import Proposer, ProposeRequest
from flashmap.types import Draft, feature_layers_for
from target_service.checkpoint import CheckpointError, load_embeddings

KIND = "eagle"


# ----------------------------------------------------------------------------- config

@dataclass
class EagleConfig:
    kind: str = KIND
    dim: int = 4096  # EAGLE-3 uses the target's hidden size (init_eagle's default; Qwen3-8B: 4096)
    n_layers: int = 1  # EAGLE-3: one decoder layer
    n_heads: int = 32
    mlp_ratio: float = 3.0  # SwiGLU hidden = dim * mlp_ratio (Qwen3-8B's 12288 / 4096)
    block_size: int = 16  # K draft tokens per round (a chain)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True

    target_name: str = ""
    vocab_size: int = 0
    target_hidden_size: int = 0
    target_num_layers: int = 0
    feature_layers: list[int] = field(default_factory=list)
    embed_hash: str = ""
    lm_head_hash: str = ""

    train_depth: int = 7  # training-time-test rollout steps (EAGLE-3 uses 7)
    step_loss_decay: float = 7.0  # rollout step s (= draft slot s+1) weighted exp(-s/decay), like FlashMap's slots

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return max(1, int(round(self.dim * self.mlp_ratio)))

    @property
    def feature_dim(self) -> int:
        return len(self.feature_layers) * self.target_hidden_size

    def validate(self) -> "EagleConfig":
        if self.kind != KIND:
            raise ValueError(f"kind must be {KIND!r}, got {self.kind!r}")
        for name in ("dim", "n_layers", "n_heads", "block_size", "train_depth"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads or self.head_dim % 2:
            raise ValueError(f"dim {self.dim} must split into {self.n_heads} heads of even width")
        if self.mlp_ratio <= 0 or self.step_loss_decay <= 0:
            raise ValueError("mlp_ratio and step_loss_decay must be > 0")
        if self.vocab_size < 2 or self.target_hidden_size < 1 or self.target_num_layers < 1:
            raise ValueError("target fields (vocab_size >= 2, target_hidden_size, target_num_layers) are not set")
        if not self.feature_layers:
            raise ValueError("feature_layers is empty")
        bad = [l for l in self.feature_layers if not 0 <= l < self.target_num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} outside 0..{self.target_num_layers - 1}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown eagle config fields {unknown}")
        cfg = cls(**d)
        cfg.feature_layers = [int(x) for x in cfg.feature_layers]
        return cfg


# ----------------------------------------------------------------------------- model

class EagleLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention (RoPE, qk-norm) + SwiGLU MLP. Split into
    `qkv` and `finish` so callers choose which keys a query sees (cache, rollout mask)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        D, self.n_heads, self.theta = cfg.dim, cfg.n_heads, cfg.rope_theta
        self.norm1 = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        norm = (lambda: nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()
        self.norm2 = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.gate = nn.Linear(D, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(D, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, D, bias=False)

    def _heads(self, x: Tensor) -> Tensor:  # [B, L, D] -> [B, h, L, d]
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, -1).transpose(1, 2)

    def qkv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, D], pos [B, L] absolute positions -> q, k, v [B, h, L, d] (q, k rotated)."""
        y = self.norm1(x)
        q = apply_rope(self.q_norm(self._heads(self.wq(y))), pos, self.theta)
        k = apply_rope(self.k_norm(self._heads(self.wk(y))), pos, self.theta)
        return q, k, self._heads(self.wv(y))

    def finish(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """x [B, L, D] with its queries q attends to k, v [B, h, T, d]; mask broadcastable to
        [B, h, L, T] (True = attend)."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.wo(o.transpose(1, 2).flatten(2))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def rollout_mask(P: int, s: int, device=None) -> Tensor:
    """[P, (s+1)P] bool: which keys query p of rollout step s sees. Keys are the step-0..s
    keys of positions 0..P-1, concatenated by step: step 0 at positions <= p - s, step r >= 1
    at position p - s + r (the drafted chain after real context ending at p - s)."""
    p = torch.arange(P, device=device)[:, None]
    q = torch.arange(P, device=device)[None]
    blocks = [q <= p - s] + [q == p - s + r for r in range(1, s + 1)]
    return torch.cat(blocks, dim=1)


class EagleDrafter(nn.Module):
    def __init__(self, cfg: EagleConfig, embed: Tensor | None = None, lm_head: Tensor | None = None):
        super().__init__()
        self.cfg = cfg.validate()
        V, H, D = cfg.vocab_size, cfg.target_hidden_size, cfg.dim
        self.register_buffer("embed", torch.empty(V, H) if embed is None else embed, persistent=False)
        self.register_buffer("lm_head", torch.empty(V, H) if lm_head is None else lm_head, persistent=False)
        self._check_target_shapes()
        self.feat_proj = nn.Linear(cfg.feature_dim, D, bias=False)
        self.feat_norm = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.hid_norm = nn.RMSNorm(D, eps=cfg.norm_eps)  # own hidden state fed back in place of g
        self.tok_norm = nn.RMSNorm(H, eps=cfg.norm_eps, elementwise_affine=False)
        self.tok_in = nn.Linear(H, D, bias=False)
        self.fuse_proj = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList(EagleLayer(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(D, H, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)

    def _check_target_shapes(self) -> None:
        want = (self.cfg.vocab_size, self.cfg.target_hidden_size)
        for name in ("embed", "lm_head"):
            if tuple(getattr(self, name).shape) != want:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, config wants {want}")

    def set_target(self, embed: Tensor, lm_head: Tensor) -> None:
        """Attach the frozen target embedding / LM head [V, H] (cast to the model's dtype)."""
        ref = next(self.parameters())
        self.embed = embed.detach().to(ref.device, ref.dtype)
        self.lm_head = lm_head.detach().to(ref.device, ref.dtype)
        self._check_target_shapes()

    # ------------------------------------------------------------------ pieces
    def features_in(self, features: Tensor) -> Tensor:
        """Target features [..., F] -> g [..., D]."""
        return self.feat_norm(self.feat_proj(features.to(self.feat_proj.weight.dtype)))

    def hidden_in(self, h: Tensor) -> Tensor:
        """The drafter's own hidden state [..., D] in the role of g (drafted positions)."""
        return self.hid_norm(h)

    def fuse(self, g: Tensor, next_ids: Tensor) -> Tensor:
        """[g, token embedding of t_{p+1}] -> layer input x [..., D]."""
        e = self.tok_in(self.tok_norm(self.embed[next_ids]))
        return self.fuse_proj(torch.cat([g, e], dim=-1))

    def logits(self, h: Tensor) -> Tensor:
        """Hidden [..., D] -> logits [..., V] (float32) of the token two positions on."""
        return (self.out_proj(self.final_norm(h)) @ self.lm_head.T).float()

    # ------------------------------------------------------------------ training
    def rollout(self, features: Tensor, tokens: Tensor, depth: int | None = None) -> list[Tensor]:
        """Training-time test on whole sequences.

        features [B, T, F] and tokens [B, T] (zero-padded past each length). Returns per
        rollout step s = 0..depth-1 the hidden states [B, T-1, D] of positions p = 0..T-2;
        step s at position p predicts tokens[:, p+2] as slot s+1 of a draft whose real
        context ends at p - s (valid only for p >= s)."""
        depth = self.cfg.train_depth if depth is None else depth
        B, T = tokens.shape
        P = T - 1
        pos = torch.arange(P, device=tokens.device).expand(B, P)
        nxt = tokens[:, 1:]
        g = self.features_in(features[:, :P])
        keys: list[list[Tensor]] = [[] for _ in self.layers]
        vals: list[list[Tensor]] = [[] for _ in self.layers]
        outs: list[Tensor] = []
        for s in range(depth):
            if s > 0:
                prev = self.hidden_in(outs[-1])  # h^{s-1}_{p-1} feeds position p
                g = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
            h = self.fuse(g, nxt)
            mask = rollout_mask(P, s, tokens.device)
            for i, layer in enumerate(self.layers):
                q, k, v = layer.qkv(h, pos)
                keys[i].append(k)
                vals[i].append(v)
                h = layer.finish(h, q, torch.cat(keys[i], 2), torch.cat(vals[i], 2), mask)
            outs.append(h)
        return outs


# ----------------------------------------------------------------------------- checkpoints

def init_eagle(target_dir: str | Path, *, seed: int | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, **config_overrides) -> EagleDrafter:
    """A freshly initialised EAGLE-style drafter for the target in target_dir (dim defaults
    to the target's hidden size, as in EAGLE-3)."""
    fixed = sorted(set(config_overrides) & {"vocab_size", "target_hidden_size", "target_num_layers",
                                            "embed_hash", "lm_head_hash"})
    if fixed:
        raise ValueError(f"{fixed} come from the target checkpoint and cannot be overridden")
    target = _target_fields(target_dir)
    embed, lm_head = load_embeddings(target_dir)
    embed_hash, lm_head_hash = _hashes(embed, lm_head)
    fields_ = dict(target_name=Path(target_dir).resolve().name,
                   feature_layers=feature_layers_for(target["target_num_layers"]),
                   dim=target["target_hidden_size"])
    fields_.update({k: v for k, v in config_overrides.items() if v is not None})
    fields_.update(target, embed_hash=embed_hash, lm_head_hash=lm_head_hash)
    try:
        cfg = EagleConfig(**fields_)
        if seed is not None:
            torch.manual_seed(seed)
        model = EagleDrafter(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad eagle drafter config: {e}") from None
    model.set_target(embed, lm_head)
    return model.to(device, dtype)


def save_eagle(model: EagleDrafter, directory: str | Path) -> Path:
    """Write config.json + model.safetensors (trainable weights only) into directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp_w, tmp_c = directory / f".{WEIGHTS_FILE}.tmp", directory / f".{CONFIG_FILE}.tmp"
    save_file(weights, str(tmp_w), metadata={"format": FORMAT})
    tmp_c.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **model.cfg.to_dict()},
                                indent=2, sort_keys=True) + "\n")
    os.replace(tmp_w, directory / WEIGHTS_FILE)
    os.replace(tmp_c, directory / CONFIG_FILE)
    return directory


def checkpoint_kind(directory: str | Path) -> str:
    """The "kind" of a drafter checkpoint directory ("flashmap", "dflash", "eagle")."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (not a drafter checkpoint directory?)")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable drafter config ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a drafter config (missing \"format\": \"{FORMAT}\")")
    return str(d.get("kind", "flashmap"))


def read_eagle_config(directory: str | Path) -> EagleConfig:
    directory = Path(directory)
    path = directory / CONFIG_FILE
    kind = checkpoint_kind(directory)
    if kind != KIND:
        raise CheckpointError(f"{path}: a {kind!r} drafter, not an EAGLE-style one")
    d = json.loads(path.read_text())
    if d.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported format_version {d.get('format_version')!r} "
                              f"(this build reads {FORMAT_VERSION})")
    d = {k: v for k, v in d.items() if k not in ("format", "format_version")}
    try:
        return EagleConfig.from_dict(d).validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad eagle drafter config ({e})") from None


def load_eagle(directory: str | Path, target_dir: str | Path, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> EagleDrafter:
    """Load an EAGLE-style drafter, attaching (and checking) the target's embedding / LM head."""
    directory = Path(directory)
    cfg = read_eagle_config(directory)
    embed, lm_head = load_embeddings(target_dir)
    check_target(cfg, target_dir, embed, lm_head)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        weights = load_file(str(path))
    except Exception as e:  # safetensors raises several types for a corrupt file
        raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from None
    with torch.device("meta"):
        model = EagleDrafter(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    bad = [f"{k} {tuple(weights[k].shape)} vs {want[k]}" for k in want if tuple(weights[k].shape) != want[k]]
    if bad:
        raise CheckpointError(f"{path}: weight shape mismatch: {'; '.join(bad[:3])} (stored vs config)")
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
    model.set_target(embed, lm_head)
    return model.to(device, dtype).eval()


# ----------------------------------------------------------------------------- proposer

class EagleProposer(Proposer):
    """Per-sequence cache + batched chain drafting (one forward per drafted token)."""

    def __init__(self, model: EagleDrafter, n_slots: int = 64, max_context: int = 4096, device: str = "cpu"):
        cfg = model.cfg
        self.model = model.to(device).eval()
        self.cfg = cfg
        self.device = torch.device(device)
        self.block_size = cfg.block_size
        self.vocab_size = cfg.vocab_size
        self.n_slots, self.max_context = n_slots, max_context
        self.steps = 1  # no flow: accepted (set_steps / per-request steps) and ignored
        dtype = next(model.parameters()).dtype
        shape = (cfg.n_layers, n_slots, cfg.n_heads, max_context, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.g_cache = torch.zeros(n_slots, max_context, cfg.dim, dtype=dtype, device=self.device)
        self.lengths = np.zeros(n_slots, np.int64)  # context positions; K/V finalized for 0..L-2
        self.slot_of: dict[str, int] = {}
        self._free = list(range(n_slots - 1, -1, -1))

    def set_steps(self, n: int) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"steps must be an integer >= 1, got {n}")
        self.steps = int(n)

    def _slot(self, seq_id: str) -> int:
        slot = self.slot_of.get(seq_id)
        if slot is None:
            if not self._free:
                raise SlotsExhausted(f"all {self.n_slots} drafter slots are in use; release finished "
                                     f"sequences or start the drafter with more slots")
            slot = self._free.pop()
            self.slot_of[seq_id] = slot
            self.lengths[slot] = 0
        return slot

    def release(self, seq_id: str) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.lengths[slot] = 0
            self._free.append(slot)

    def context_length(self, seq_id: str) -> int:
        slot = self.slot_of.get(seq_id)
        return 0 if slot is None else int(self.lengths[slot])

    def truncate(self, seq_id: str, n: int) -> None:
        """Keep the first n positions: the K/V of positions <= n-2 depend only on tokens <= n-1
        and stay valid; g of position n-1 is cached."""
        have = self.context_length(seq_id)
        if not 0 <= n <= have:
            raise ValueError(f"cannot truncate {seq_id!r} to {n}: it holds {have} positions")
        if seq_id in self.slot_of:
            self.lengths[self.slot_of[seq_id]] = n

    @property
    def bytes_per_context_token(self) -> int:
        return (2 * self.cfg.n_layers + 1) * self.cfg.dim * self.k_cache.element_size()

    @torch.inference_mode()
    def extend(self, seq_id: str, token_ids: np.ndarray, features: np.ndarray) -> None:
        features = np.asarray(features, np.float32)
        token_ids = np.asarray(token_ids, np.int64).reshape(-1)
        m = len(token_ids)
        if features.shape != (m, self.cfg.feature_dim):
            raise ValueError(f"features must be [{m}, {self.cfg.feature_dim}] for {m} tokens, got {features.shape}")
        slot = self._slot(seq_id)
        start = int(self.lengths[slot])
        if start + m > self.max_context:
            raise ContextTooLong(f"sequence {seq_id!r}: context {start + m} exceeds the drafter's "
                                 f"max_context {self.max_context}")
        if m == 0:
            return
        self.g_cache[slot, start:start + m] = self.model.features_in(torch.from_numpy(features).to(self.device))
        # Finalize positions p0..p1: each needs the token at p + 1, now known.
        p0, p1 = max(start - 1, 0), start + m - 2
        self.lengths[slot] = start + m
        if p1 < p0:
            return
        nxt = torch.from_numpy(token_ids[p0 + 1 - start:p1 + 2 - start]).to(self.device)
        h = self.model.fuse(self.g_cache[slot, p0:p1 + 1], nxt)[None]  # [1, n, D]
        pos = torch.arange(p0, p1 + 1, device=self.device)[None]  # [1, n]
        mask = torch.arange(p1 + 1, device=self.device)[None] <= pos[0, :, None]  # [n, p1+1]
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(h, pos)
            self.k_cache[i, slot, :, p0:p1 + 1] = k[0]
            self.v_cache[i, slot, :, p0:p1 + 1] = v[0]
            h = layer.finish(h, q, self.k_cache[i, slot, :, :p1 + 1][None], self.v_cache[i, slot, :, :p1 + 1][None],
                             mask)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest], steps: int | None = None) -> list[Draft]:
        """One chain of block_size tokens per request (steps: accepted and ignored)."""
        if not requests:
            return []
        for r in requests:
            if r.temperature < 0 or (r.temperature > 0 and r.top_m < 1):
                raise ValueError(f"request {r.seq_id!r}: need temperature >= 0 and top_m >= 1")
        B, K, dev = len(requests), self.block_size, self.device
        slots = [self.slot_of.get(r.seq_id, -1) for r in requests]
        L = np.array([0 if s < 0 else int(self.lengths[s]) for s in slots], np.int64)
        p0 = np.maximum(L - 1, 0)  # position of the first drafted step (the last context position)
        T = int(p0.max()) + K
        slot_t = torch.tensor([max(s, 0) for s in slots], device=dev)
        keep = int(p0.max())  # finalized keys to copy: positions < p0 per row
        kbuf, vbuf = [], []
        for i in range(self.cfg.n_layers):
            kb = self.k_cache.new_zeros(B, self.cfg.n_heads, T, self.cfg.head_dim)
            vb = torch.zeros_like(kb)
            if keep:
                kb[:, :, :keep] = self.k_cache[i, :, :, :keep].index_select(0, slot_t)
                vb[:, :, :keep] = self.v_cache[i, :, :, :keep].index_select(0, slot_t)
            kbuf.append(kb)
            vbuf.append(vb)
        p0_t = torch.from_numpy(p0).to(dev)
        g = self.g_cache[slot_t, p0_t]  # [B, D]
        g = torch.where(torch.from_numpy(L > 0).to(dev)[:, None], g, torch.zeros_like(g))
        tok = torch.tensor([int(r.anchor) for r in requests], device=dev)
        gens = [request_generator(r.seed) for r in requests]
        rows = torch.arange(B, device=dev)
        key_idx = torch.arange(T, device=dev)
        tokens = np.zeros((B, K), np.int64)
        m_max = max([min(r.top_m, self.vocab_size) for r in requests if r.temperature > 0] + [1])
        sup_ids = np.full((B, K, m_max), -1, np.int64)
        sup_q = np.zeros((B, K, m_max), np.float32)
        for k in range(K):
            pos = p0_t + k  # [B]
            h = self.model.fuse(g, tok)[:, None]  # [B, 1, D]
            mask = (key_idx[None] <= pos[:, None])[:, None, None]  # [B, 1, 1, T]
            for i, layer in enumerate(self.model.layers):
                q, kk, vv = layer.qkv(h, pos[:, None])
                kbuf[i][rows, :, pos] = kk[:, :, 0]
                vbuf[i][rows, :, pos] = vv[:, :, 0]
                h = layer.finish(h, q, kbuf[i], vbuf[i], mask)
            h = h[:, 0]
            logits = self.model.logits(h)  # [B, V]
            nxt = logits.argmax(-1).cpu().numpy()
            top_l, top_i = logits.topk(m_max, dim=-1)
            top_l, top_i = top_l.cpu(), top_i.cpu()
            for b, r in enumerate(requests):
                if r.temperature == 0:
                    sup_ids[b, k, 0], sup_q[b, k, 0] = nxt[b], 1.0
                    continue
                m = min(r.top_m, self.vocab_size)
                q_ = (top_l[b, :m].double() / r.temperature).softmax(-1)
                pick = int(torch.multinomial(q_, 1, generator=gens[b])[0])
                nxt[b] = int(top_i[b, pick])
                sup_ids[b, k, :m] = top_i[b, :m].numpy()
                sup_q[b, k, :m] = q_.float().numpy()
            tokens[:, k] = nxt
            tok = torch.from_numpy(nxt).to(dev)
            g = self.model.hidden_in(h)
        out = []
        for b, r in enumerate(requests):
            if r.temperature == 0:
                out.append(Draft.greedy(tokens[b]))
            else:
                m = min(r.top_m, self.vocab_size)
                out.append(Draft(tokens[b].copy(), sup_ids[b, :, :m].copy(), sup_q[b, :, :m].copy()))
        return out


def load_proposer(directory: str | Path, target_dir: str | Path, device: str = "cpu", n_slots: int = 8,
                  max_context: int = 4096) -> EagleProposer:
    """An EagleProposer from a checkpoint directory (for flashmap.cli.load_proposer to dispatch
    to when checkpoint_kind(directory) == "eagle")."""
    return EagleProposer(load_eagle(directory, target_dir, device=device), n_slots=n_slots,
                         max_context=max_context, device=device)
