"""The FlashMap drafter network: a small DiT over one block of K draft slots, with its time
conditioning and its evaluation entry points.

Input: the flow state x_s [B, K, V] (noise at s = 0, one-hot at s = 1), the anchor token
(last committed token) and the target's context features (strictly before the anchor).
Output: per-slot logits [B, K, V] of the clean block, conditioned on the jump (s, t).

    x_s @ E (frozen target embedding) -> whiten -> rms -> linear H->D   } K slot tokens
    E[anchor] -> rms -> linear H->D                          } 1 prefix token
    + learned positions [K+1, D]
    n_blocks x [ self-attention over [anchor, slots] (bidirectional)
                 cross-attention to the projected context (RoPE, absolute positions)
                 MLP ], each wrapped in adaLN-Zero conditioned on embed(s, t)
    final norm -> linear D->H -> frozen target LM head -> logits [B, K, V]

The blocks are in drafter_service.dit_blocks; the flow map that turns the logits into the next
state (`jump`) and the embedded noise (`noise_factor`) in drafter_service.flow_map. The network
sees the state only through y = x @ E: `forward` takes x (training), `evaluate` takes y
(serving).

Reading the state: eps @ E has covariance E^T E, whose spectrum is very uneven (a few
directions carry most of the noise), so after a plain rms-normalisation the directions that
tell tokens apart are buried under a few loud noise directions. With state_input = "whiten" y
is first multiplied by (E^T E)^{-1/2} (a frozen buffer computed from E): the noise is isotropic
and every direction weighs what it tells. The flow time is conditioned on tau of the config's
time map (flow_time; "embedded" for new drafters: tau measured on what the embedded state can
tell), whose table is measured when the target's E is attached if the config lacks it.

kind "dflash" (DFlash-style baseline) is the same backbone with the state replaced by a
learned mask embedding and the time conditioning fixed at (0, 1): one pass gives
independent per-slot marginals.

With cfg.second_jump_net the model holds `second_jump`: a network of its own (this module, the
same shape) for the second of two jumps of T = 0 rows drafted from the zero state, conditioned
on (0, 1) and reading this network's context K/V; flashmap_proposer decides which rows take it.

Context K/V of every block come from one pass (`context_kv`) and are held in a
`CrossContext`; the training path builds it from padded features, the serving path
(flashmap_proposer) from its static per-slot cache. Both go through the same `forward`.
The frozen embedding / LM head are the target's (drafter_service.frozen_target).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
from torch import Tensor

from drafter_service.config import DrafterConfig
from drafter_service.dit_blocks import CrossContext, DiTBlock, timestep_embedding
from drafter_service.flow_map import greedy_summary, jump, noise_factor, per_row
from drafter_service.flow_time import (
    embedded_time_knots,
    interp_torch,
    map_t_of_tau,
    map_time_grid,
    time_knots,
    zca_whitening,
)
from drafter_service.frozen_target import FrozenTarget
from drafter_service.layers import StackedKV, context_kv


class FlashMapDiT(FrozenTarget):
    def __init__(
        self, cfg: DrafterConfig, embed: Tensor | None = None, lm_head: Tensor | None = None
    ):
        super().__init__()
        self.cfg = cfg.validate()
        H, D, K = cfg.target_hidden_size, cfg.dim, cfg.block_size
        self.second_jump = None  # built last (below)
        self._tau_cache: dict = {}  # device -> tau tables; kept out of buffers so .to(bf16) leaves them exact
        self._mod_cache: dict = {}  # see modulations()
        self._noise_factor: tuple | None = None  # see noise_factor()
        self._stacked_kv: StackedKV | None = None  # every block's context K/V weights (context_kv)
        if cfg.kind == "flashmap" and cfg.state_input == "whiten":
            # (E^T E)^{-1/2} [H, H] (set with the target; identity until then)
            self.register_buffer("state_whiten", torch.eye(H), persistent=False)
        self._init_target(embed, lm_head)  # frozen target tensors [V, H]

        # Magnitudes of x_s @ E vary with s (noise ~ sqrt(V) x a row of E), so inputs are rms-normalised.
        self.in_norm = nn.RMSNorm(H, eps=cfg.norm_eps, elementwise_affine=False)
        if cfg.kind == "flashmap":
            self.state_in = nn.Linear(H, D, bias=False)
        else:
            self.mask_embed = nn.Parameter(torch.zeros(D))
        self.anchor_in = nn.Linear(H, D, bias=False)
        self.pos_embed = nn.Parameter(torch.zeros(K + 1, D))  # [anchor, slot 1..K]
        self.time_embed = nn.Sequential(
            nn.Linear(2 * cfg.time_freq_dim, D), nn.SiLU(), nn.Linear(D, D)
        )
        self.ctx_proj = nn.Linear(cfg.feature_dim, D, bias=False)
        self.ctx_norm = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.n_blocks))
        self.final_norm = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(D, H, bias=False)
        self.reset_parameters()
        if cfg.second_jump_net:  # its frozen target tensors and whitening are this network's
            self.second_jump = FlashMapDiT(replace(cfg, second_jump_net=False))
            self._share_with_second_jump()

    # ------------------------------------------------------------------ setup
    def _target_attached(self) -> None:
        """Derive from the newly attached embedding E: the whitening of the state input and,
        when the config has none yet, the embedded time map's table (measured on E)."""
        if self.cfg.kind != "flashmap" or self.embed.device.type == "meta":
            return
        if self.cfg.state_input == "whiten":
            self.state_whiten = zca_whitening(self.embed).to(self.embed.device, self.embed.dtype)
        if self.cfg.time_map == "embedded" and not self.cfg.time_table_t:
            # V x H x samples multiply-adds (Qwen3-8B: ~20 TFLOP): on a GPU when there is one
            E = (
                self.embed.to("cuda")
                if self.embed.device.type == "cpu" and torch.cuda.is_available()
                else self.embed
            )
            t, tau = embedded_time_knots(
                E.float(),
                samples=self.cfg.time_map_samples,
                candidates=self.cfg.time_map_candidates,
            )
            self.cfg.time_table_t, self.cfg.time_table_tau = t, tau
            self._tau_cache.clear()
            self._mod_cache.clear()
        self._share_with_second_jump()

    def _apply(self, fn, recurse: bool = True):
        # .to() / .half() convert each module's buffers on their own: share again after it
        out = super()._apply(fn, recurse)
        self._share_with_second_jump()
        return out

    def _share_with_second_jump(self) -> None:
        """The second jump's network reads this one's frozen target tensors, whitening and time
        table: the same tensors, not copies (one embedding in memory)."""
        second = self.second_jump
        if second is None or self.embed.device.type == "meta":
            return
        second.embed, second.lm_head = self.embed, self.lm_head
        if self.cfg.state_input == "whiten":
            second.state_whiten = self.state_whiten
        second.cfg.time_table_t = self.cfg.time_table_t
        second.cfg.time_table_tau = self.cfg.time_table_tau
        second._tau_cache.clear()
        second._mod_cache.clear()

    def reset_parameters(self) -> None:
        """DiT init: xavier linears, small normal embeddings, adaLN-Zero modulation at 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos_embed, std=0.02)
        if self.cfg.kind == "dflash":
            nn.init.normal_(self.mask_embed, std=0.02)
        for m in self.time_embed:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for blk in self.blocks:
            nn.init.zeros_(blk.adaln.weight)
            nn.init.zeros_(blk.adaln.bias)

    # ------------------------------------------------------------------ context
    def project_context(self, features: Tensor) -> Tensor:
        """The context projection (flashmap.drafter_inputs): features [.., F] -> [.., D]."""
        return self.ctx_norm(self.ctx_proj(features.to(self.ctx_proj.weight.dtype)))

    def context_kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys / values of N context positions for every block in one pass:
        x [N, F] features (or [N, D], projected by the target), positions [N] -> k, v
        [n_blocks, N, h, d]."""
        c = self.project_context(x) if x.shape[-1] == self.cfg.feature_dim else x
        if self._stacked_kv is None:
            self._stacked_kv = StackedKV(
                [(b.cross_attn.wk, b.cross_attn.wv, b.cross_attn.k_norm) for b in self.blocks]
            )
        cfg = self.cfg
        return context_kv(c, positions, self._stacked_kv, cfg.n_heads, cfg.norm_eps, cfg.rope_theta)

    def encode_context(
        self, features: Tensor, positions: Tensor | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """Per-block cross-attention K/V of context positions (`context_kv` over a batch).

        features [B, T, F] (concatenated feature-layer hidden states), positions [B, T]
        absolute positions (default 0..T-1) -> per block (k, v) [B, h, T, d]."""
        B, T, _ = features.shape
        if positions is None:
            positions = torch.arange(T, device=features.device).expand(B, T)
        k, v = self.context_kv(features.flatten(0, 1), positions.flatten())  # [n, B*T, h, d]
        return [
            (
                k[i].view(B, T, *k.shape[2:]).transpose(1, 2),
                v[i].view(B, T, *v.shape[2:]).transpose(1, 2),
            )
            for i in range(len(self.blocks))
        ]

    def context(self, features: Tensor, lengths: Tensor) -> CrossContext:
        """Training path: padded features [B, T, F] with valid lengths [B] (= anchor positions)."""
        return CrossContext(self.encode_context(features), lengths.to(features.device, torch.long))

    # ------------------------------------------------------------------ forward
    def _tau(self, t: Tensor) -> Tensor:
        """tau(t) [B] under the config's time map: the network is conditioned on tau, not t.
        Training draws tau ~ U(0, 1), which puts almost no mass where the state is unreadable;
        in tau every such t is ~0, the start of drafting, so inference stays in distribution."""
        if t.device not in self._tau_cache:  # filled before any CUDA-graph capture (warm-up runs)
            tau_k, t_k = time_knots(self.cfg)
            calc = torch.float32 if t.device.type == "mps" else torch.float64  # mps has no float64
            self._tau_cache[t.device] = (
                torch.tensor(t_k, dtype=calc, device=t.device),
                torch.tensor(tau_k, dtype=calc, device=t.device),
            )
        return interp_torch(t, *self._tau_cache[t.device])

    def t_of_tau(self, tau):
        """Flow time t of tau under this drafter's time map (float, numpy or torch)."""
        return map_t_of_tau(tau, self.cfg)

    def time_grid(self, steps: int):
        """The drafting grid of `steps` jumps / Euler steps: steps+1 times uniform in tau, 0 .. 1."""
        return map_time_grid(steps, self.cfg)

    def time_cond(self, s: Tensor | float, t: Tensor | float, n: int) -> Tensor:
        """Conditioning vector [B, D] from the jump (s, t) in tau units; fixed (0, 1) for dflash."""
        dev = self.pos_embed.device
        fd = self.cfg.time_freq_dim
        if self.cfg.kind == "dflash":  # tau(0) = 0 and tau(1) = 1 under every time map
            s, t = per_row(0.0, n, dev), per_row(1.0, n, dev)
        else:
            s, t = self._tau(per_row(s, n, dev)), self._tau(per_row(t, n, dev))
        e = torch.cat([timestep_embedding(s, fd), timestep_embedding(t, fd)], -1)
        return self.time_embed(e.to(self.pos_embed.dtype))  # [B, D]

    def modulations(self, s: Tensor | float, t: Tensor | float, n: int) -> list[Tensor]:
        """Per DiT block its adaLN vectors [n, 9D] for the jump (s, t), then, when the config
        gates the state (state_gate_tau > 0), the gate g(tau_t) [n, 1].

        When drafting, s and t are host floats (one grid per step count) and the vectors only
        depend on them: they are computed once and reused, which at batch 1 saves reading the
        adaLN weights (9 D^2 per block, a third of the drafter) on every call. The cache key
        holds the version counters of the weights involved, so any in-place update (optimizer
        step, EMA, load_state_dict) invalidates it; tensor times (training, CUDA graphs) never
        use it."""
        params = [
            *self.time_embed.parameters(),
            *(p for b in self.blocks for p in b.adaln.parameters()),
        ]
        cacheable = isinstance(s, float) and isinstance(t, float) and not torch.is_grad_enabled()
        key = (s, t, self.pos_embed.device, self.pos_embed.dtype, tuple(p._version for p in params))
        if cacheable and key in self._mod_cache:
            return [m.expand(n, -1) for m in self._mod_cache[key]]
        c = self.time_cond(s, t, 1 if cacheable else n)  # [B, D]
        mods = [blk.modulation(c) for blk in self.blocks]  # n_blocks x [B, 9D]
        if self.cfg.kind == "flashmap" and self.cfg.state_gate_tau > 0:
            tau_t = self._tau(per_row(t, 1 if cacheable else n, c.device))
            mods.append((tau_t / self.cfg.state_gate_tau).clamp(max=1.0)[:, None].to(c.dtype))
        if not cacheable:
            return mods
        if len(self._mod_cache) > 64:  # a handful of grids in practice; bound it anyway
            self._mod_cache.clear()
        self._mod_cache[key] = mods
        return [m.expand(n, -1) for m in mods]

    def forward(
        self,
        x: Tensor | None,
        s: Tensor | float,
        t: Tensor | float,
        anchor: Tensor,
        ctx: CrossContext,
    ) -> Tensor:
        """Per-slot logits [B, K, V] (float32) of the clean block.

        x [B, K, V] flow state at time s (unused for dflash, may be None); s, t floats or
        [B]; anchor [B] int64 token ids; ctx: the rows' projected context."""
        y = self.embed_state(x) if self.cfg.kind == "flashmap" else None
        return self.evaluate(
            y, self.modulations(s, t, anchor.shape[0]), anchor, ctx.kv, ctx.lengths
        )

    # ------------------------------------------------------------------ embedded state
    def embed_state(self, x: Tensor) -> Tensor:
        """x [B, K, V] -> y = x @ E [B, K, H]; a draw broadcast over the K slots is projected once."""
        if x.stride(1) == 0:
            return (x[:, :1].to(self.embed.dtype) @ self.embed).expand(-1, x.shape[1], -1)
        return x.to(self.embed.dtype) @ self.embed

    def noise_factor(self) -> Tensor:
        """`noise_factor` of the frozen embedding, computed once (again if it is replaced)."""
        E = self.embed
        key = (E.data_ptr(), E._version, E.device, E.dtype)
        if self._noise_factor is None or self._noise_factor[0] != key:
            self._noise_factor = (key, noise_factor(E))
        return self._noise_factor[1]

    def read_state(self, y: Tensor) -> Tensor:
        """The embedded state as the network reads it: y [B, K, H] whitened (state_input
        "whiten") or as is ("rms"), before the rms-normalisation."""
        y = y.to(self.embed.dtype)
        return y @ self.state_whiten if self.cfg.state_input == "whiten" else y

    def evaluate(
        self,
        y: Tensor | None,
        mods: list[Tensor],
        anchor: Tensor,
        kv: list[tuple[Tensor, Tensor]],
        lengths: Tensor,
    ) -> Tensor:
        """`forward` given the embedded state y = x_s @ E [B, K, H] (None for dflash), the
        jump's adaLN vectors (`modulations`) and the context as plain tensors: no host floats
        and no caches, so torch.compile can trace it whole (SlotCacheProposer.enable_compile)."""
        B, K, D = anchor.shape[0], self.cfg.block_size, self.cfg.dim
        if self.cfg.kind == "flashmap":
            if (
                y.stride(1) == 0
            ):  # one state broadcast over the K slots (shared noise): project it once
                h_state = self.state_in(self.in_norm(self.read_state(y[:, :1]))).expand(B, K, D)
            else:
                h_state = self.state_in(self.in_norm(self.read_state(y)))  # [B, K, D]
            if len(mods) > len(self.blocks):  # the state gate (modulations)
                h_state = h_state * mods[-1][:, :, None]
        else:
            h_state = self.mask_embed.expand(B, K, D)  # [B, K, D]
        h_anchor = self.anchor_in(self.in_norm(self.embed[anchor]))[:, None]  # [B, 1, D]
        h = torch.cat([h_anchor, h_state], dim=1) + self.pos_embed  # [B, K+1, D]

        T = kv[0][0].shape[2]
        q_pos = lengths[:, None] + torch.arange(
            K + 1, device=h.device
        )  # [B, K+1]: anchor at len, slot k at len+k
        has = lengths > 0  # [B]
        valid = torch.arange(T, device=h.device)[None] < lengths[:, None]  # [B, T]
        if T > 0:
            valid[
                :, 0
            ] |= ~has  # rows without context attend to a dummy key (output zeroed below): no NaN
        mask = valid[:, None, None, :]  # [B, 1, 1, T]
        has_ctx = has.to(h.dtype)[:, None, None]  # [B, 1, 1]
        for blk, mod, (k, v) in zip(self.blocks, mods, kv):
            h = blk(h, mod, k, v, mask, q_pos, has_ctx)

        h = self.out_proj(self.final_norm(h[:, 1:]))  # [B, K, H]
        return (h @ self.lm_head.T).float()  # [B, K, V]

    def evaluate_greedy(
        self,
        y: Tensor | None,
        mods: list[Tensor],
        anchor: Tensor,
        kv: list[tuple[Tensor, Tensor]],
        lengths: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`evaluate` and the `greedy_summary` of its logits: (logits, ids, prob). Drafting's
        last evaluation; compiled, the summary is one fused pass over the logits (eagerly it is
        a separate max with indices over [B, K, V])."""
        logits = self.evaluate(y, mods, anchor, kv, lengths)
        return (logits, *greedy_summary(logits))

    def denoise_logits(
        self, x_t: Tensor, t: Tensor | float, anchor: Tensor, ctx: CrossContext
    ) -> Tensor:
        """Teacher denoiser (the diagonal s = t): logits [B, K, V] of the clean block given x_t."""
        return self(x_t, t, t, anchor, ctx)

    def flow_map(
        self, x_s: Tensor, s: Tensor | float, t: Tensor | float, anchor: Tensor, ctx: CrossContext
    ) -> tuple[Tensor, Tensor]:
        """One jump s -> t: (X_{s,t}(x_s) [B, K, V], logits [B, K, V])."""
        logits = self(x_s, s, t, anchor, ctx)
        return jump(x_s, logits.softmax(-1), s, t), logits
