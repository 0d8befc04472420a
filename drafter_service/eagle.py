"""EAGLE-3-style autoregressive baseline drafter: model, serving proposer, checkpoints.

The paper's second baseline (docs/ARCHITECTURE.md, "The method in one page"): a small causal
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

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from drafter_service.checkpoint import init_model, load_model, read_model_config, save_drafter
from drafter_service.config import TargetRefConfig
from drafter_service.dit_blocks import Attention
from drafter_service.flashmap_proposer import request_generator
from drafter_service.frozen_target import FrozenTarget
from drafter_service.slots import SlotCacheProposer
from flashmap.drafts import Draft, ProposeRequest
from flashmap.types import BLOCK_SIZE

KIND = "eagle"


# ----------------------------------------------------------------------------- config


@dataclass
class EagleConfig(TargetRefConfig):
    _WHAT = "eagle"

    kind: str = KIND
    dim: int = 4096  # EAGLE-3 uses the target's hidden size (init_eagle's default; Qwen3-8B: 4096)
    n_layers: int = 1  # EAGLE-3: one decoder layer
    n_heads: int = 32
    mlp_ratio: float = 3.0  # SwiGLU hidden = dim * mlp_ratio (Qwen3-8B's 12288 / 4096)
    block_size: int = BLOCK_SIZE  # K draft tokens per round (a chain)
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
    step_loss_decay: float = (
        7.0  # rollout step s (= draft slot s+1) weighted exp(-s/decay), like FlashMap's slots
    )

    @property
    def mlp_hidden(self) -> int:
        return max(1, int(round(self.dim * self.mlp_ratio)))

    def validate(self) -> EagleConfig:
        if self.kind != KIND:
            raise ValueError(f"kind must be {KIND!r}, got {self.kind!r}")
        self._check_widths(("dim", "n_layers", "n_heads", "block_size", "train_depth"))
        if self.mlp_ratio <= 0 or self.step_loss_decay <= 0:
            raise ValueError("mlp_ratio and step_loss_decay must be > 0")
        self._check_target()
        return self


# ----------------------------------------------------------------------------- model


class EagleLayer(Attention):
    """Pre-norm decoder layer: causal self-attention (RoPE, qk-norm) + SwiGLU MLP. Split into
    `qkv` and `finish` so callers choose which keys a query sees (cache, rollout mask).
    The attention projections (wq, wk, wv, wo, q_norm, k_norm) are dit_blocks.Attention's,
    inherited so their weight names stay flat (layers.i.wq, ...)."""

    def __init__(self, cfg: EagleConfig):
        nn.Module.__init__(self)
        D = cfg.dim
        # Registration order norm1, attention projections, norm2, MLP: the parameter order
        # (seeded init, optimizer state of saved training runs) of this layer as first written.
        self.norm1 = nn.RMSNorm(D, eps=cfg.norm_eps)
        self._init_projections(cfg)
        self.norm2 = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.gate = nn.Linear(D, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(D, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, D, bias=False)

    def qkv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, D], pos [B, L] absolute positions -> q, k, v [B, h, L, d] (q, k rotated)."""
        y = self.norm1(x)
        return (self.query(y, pos), *self.project_kv(y, pos))

    def finish(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """x [B, L, D] with its queries q attends to k, v [B, h, T, d]; mask broadcastable to
        [B, h, L, T] (True = attend)."""
        x = x + self.attend(q, k, v, mask)
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


class EagleDrafter(FrozenTarget):
    def __init__(
        self, cfg: EagleConfig, embed: Tensor | None = None, lm_head: Tensor | None = None
    ):
        super().__init__()
        self.cfg = cfg.validate()
        H, D = cfg.target_hidden_size, cfg.dim
        self._init_target(embed, lm_head)  # frozen target tensors [V, H]
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

    def chain_step(
        self,
        g: Tensor,
        tok: Tensor,
        pos: Tensor,
        kbuf: list[Tensor],
        vbuf: list[Tensor],
        rows: Tensor,
        key_idx: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """One drafted token per row: g [B, D] (features or own hidden state), tok [B] the token
        before, pos [B] its position; writes that position's K/V into kbuf / vbuf [B, h, T, d] and
        returns the hidden state [B, D] and the next token's logits [B, V]."""
        h = self.fuse(g, tok)[:, None]  # [B, 1, D]
        mask = (key_idx[None] <= pos[:, None])[:, None, None]  # [B, 1, 1, T]
        for i, layer in enumerate(self.layers):
            q, kk, vv = layer.qkv(h, pos[:, None])
            kbuf[i][rows, :, pos] = kk[:, :, 0]
            vbuf[i][rows, :, pos] = vv[:, :, 0]
            h = layer.finish(h, q, kbuf[i], vbuf[i], mask)
        h = h[:, 0]
        return h, self.logits(h)

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


def init_eagle(
    target_dir: str | Path,
    *,
    seed: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> EagleDrafter:
    """A freshly initialised EAGLE-style drafter for the target in target_dir (dim defaults
    to the target's hidden size, as in EAGLE-3; overrides that are None keep the default)."""
    return init_model(
        EagleDrafter,
        EagleConfig,
        "eagle drafter",
        target_dir,
        seed=seed,
        device=device,
        dtype=dtype,
        config_overrides={k: v for k, v in config_overrides.items() if v is not None},
        defaults=lambda target: dict(dim=target["target_hidden_size"]),
    )


def save_eagle(model: EagleDrafter, directory: str | Path) -> Path:
    """Write config.json + model.safetensors (trainable weights only) into directory."""
    return save_drafter(model, directory)


def read_eagle_config(directory: str | Path) -> EagleConfig:
    return read_model_config(
        directory, EagleConfig, "eagle drafter", kind=KIND, kind_name="an EAGLE-style one"
    )


def load_eagle(
    directory: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EagleDrafter:
    """Load an EAGLE-style drafter, attaching (and checking) the target's embedding / LM head."""
    return load_model(
        EagleDrafter, read_eagle_config(directory), directory, target_dir, device, dtype
    )


# ----------------------------------------------------------------------------- proposer


class EagleProposer(SlotCacheProposer):
    """Per-sequence cache + batched chain drafting (one forward per drafted token).

    Sequences (slots, release, truncate): SlotCacheProposer. A slot's length L counts context
    positions; K/V are finalized for 0..L-2. Truncating to n keeps them valid: the K/V of
    positions <= n-2 depend only on tokens <= n-1, and g of position n-1 is cached."""

    COMPILED = {"_step": ("chain_step", False)}

    def __init__(
        self, model: EagleDrafter, n_slots: int = 64, max_context: int = 4096, device: str = "cpu"
    ):
        # No flow: draft_steps (set_steps, a request's) is accepted and ignored
        c = model.cfg
        super().__init__(
            model,
            n_slots,
            max_context,
            device,
            (c.n_layers, c.n_heads, c.head_dim),
            c.block_size,
            c.dim,
        )
        self.g_cache = torch.zeros(
            n_slots, max_context, self.cfg.dim, dtype=self.k_cache.dtype, device=self.device
        )
        self._step = self.model.chain_step  # COMPILED: enable_compile() swaps in a compiled one

    @property
    def bytes_per_context_token(self) -> int:
        return (2 * self.cfg.n_layers + 1) * self.cfg.dim * self.k_cache.element_size()

    def _write_many(self, slots, positions, token_ids: np.ndarray, features) -> None:
        """Per sequence (a baseline: its context keys need the layers' attention over the
        earlier positions, so a sequence's run is one pass of its own)."""
        s, p = slots.cpu().numpy(), positions.cpu().numpy()
        cut = np.flatnonzero((np.diff(s) != 0) | (np.diff(p) != 1)) + 1
        for a, b in zip(np.r_[0, cut], np.r_[cut, len(s)]):
            self._write(int(s[a]), int(p[a]), token_ids[a:b], features[a:b])

    def _write(self, slot: int, start: int, token_ids: np.ndarray, features) -> None:
        m = len(token_ids)
        g = features if features.shape[-1] == self.cfg.dim != self.feature_dim else None
        self.g_cache[slot, start : start + m] = (
            self.model.features_in(features) if g is None else g.to(self.g_cache.dtype)
        )
        # Finalize positions p0..p1: each needs the token at p + 1, now known.
        p0, p1 = max(start - 1, 0), start + m - 2
        self.slots.lengths[slot] = start + m
        if p1 < p0:
            return
        nxt = torch.from_numpy(token_ids[p0 + 1 - start : p1 + 2 - start]).to(self.device)
        h = self.model.fuse(self.g_cache[slot, p0 : p1 + 1], nxt)[None]  # [1, n, D]
        pos = torch.arange(p0, p1 + 1, device=self.device)[None]  # [1, n]
        mask = torch.arange(p1 + 1, device=self.device)[None] <= pos[0, :, None]  # [n, p1+1]
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(h, pos)
            self.k_cache[i, slot, :, p0 : p1 + 1] = k[0]
            self.v_cache[i, slot, :, p0 : p1 + 1] = v[0]
            h = layer.finish(
                h,
                q,
                self.k_cache[i, slot, :, : p1 + 1][None],
                self.v_cache[i, slot, :, : p1 + 1][None],
                mask,
            )

    @torch.inference_mode()
    def propose(
        self, requests: list[ProposeRequest], draft_steps: int | None = None
    ) -> list[Draft]:
        """One chain of block_size tokens per request (draft_steps: accepted and ignored)."""
        if not requests:
            return []
        for r in requests:
            if r.temperature < 0 or (r.temperature > 0 and r.top_m < 1):
                raise ValueError(f"request {r.seq_id!r}: need temperature >= 0 and top_m >= 1")
        B, K, dev = len(requests), self.block_size, self.device
        rows = [self.slots.lookup(r.seq_id) for r in requests]
        slots = [slot for slot, _ in rows]
        L = np.array([length for _, length in rows], np.int64)
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
            h, logits = self._step(g, tok, p0_t + k, kbuf, vbuf, rows, key_idx)  # [B, D], [B, V]
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
                out.append(
                    Draft(tokens[b].copy(), sup_ids[b, :, :m].copy(), sup_q[b, :, :m].copy())
                )
        return out
