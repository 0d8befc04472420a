"""Training of the FlashMap drafter (flow stage, flow-map distillation) and the DFlash-style baseline.

Data: shards from `training.drafter_data` (the target's own responses + target features).
A training row ("block") is one anchor inside a response: the context is the target
features strictly before the anchor, the anchor token is the last committed token, and
the target block is the next K tokens after the anchor (slots past the end are masked).
Many anchors of one sequence share one encoded context (`CrossContext.select`).

Stages (DESIGN.md, "The method in one page"):

- flow: tau ~ U(0, 1) mapped to t by the drafter's time map (flow_time; new drafters: the
  embedded map, measured on what the network can read); x_t = (1-t)*eps + t*onehot with
  ONE noise draw [V] shared by the K slots; the model is called on the diagonal (s = t)
  and trained with the cross-entropy of its clean-block logits, slot k (1-based)
  weighted exp(-(k-1)/slot_loss_decay). At every save the flow check (`flow_check`) logs
  the denoiser's accuracy against tau and writes OUT/flow_summary.json; it warns when
  the denoiser does not improve with tau (a model that ignores its state is no flow).
- distill: the student starts from the trained flow model, which stays frozen as the
  teacher. Per block a jump (s, t): a share `zero_jump_fraction` of the blocks are
  zero-length jumps (s = t) whose output distribution must match the frozen teacher
  denoiser's; `full_jump_fraction` of all jumps are the full 0 -> 1 jump; the rest have
  tau_s < tau_t uniform. Non-zero jumps follow the semigroup X_{s,t}(x_s) = X_{u,t}(X_{s,u}(x_s))
  for the midpoint u (midpoint in tau), the right-hand side computed under no_grad by
  an EMA of the student (or the student itself with ema_decay = 0).
  Because X_{s,t}(x) = x + (t-s)/(1-s) (pi - x), the composed jump is again of this form
  with pi* = lam * pi_{s,u} + (1 - lam) * pi_{u,t}, lam = (u-s)(1-t) / ((t-s)(1-u)):
  matching the maps is matching distributions, and the loss is KL(pi* || pi_student)
  (slot-weighted like the flow loss). It is exactly 0 when u = s or u = t for a
  self-consistent model and for any map whose pi does not depend on (x, s, t).
- dflash: the baseline (kind = "dflash": one pass over a masked block), same data, the
  same slot-weighted cross-entropy.

    python -m training.train_drafter --stage flow --target T --data D --out runs/flow
    python -m training.train_drafter --stage distill --teacher runs/flow --target T --data D --out runs/map
    python -m training.train_drafter --stage dflash --target T --data D --out runs/dflash
    (add --small for a CPU-sized run; --resume continues from OUT/train_state.pt)

OUT holds the drafter checkpoint (config.json + model.safetensors, via save_drafter),
train_state.pt (model, optimizer, scheduler, EMA, step), loss.csv and loss.png.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import sys
import time
from collections import OrderedDict
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drafter_service.checkpoint import init_drafter, load_drafter, save_drafter
from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import CrossContext, FlashMapDiT, jump
from drafter_service.flow_time import map_t_of_tau
from training.drafter_data import Shard, list_shards, read_meta, shard_index

STAGES = ("flow", "distill", "dflash")
STATE_FILE = "train_state.pt"
CSV_FILE = "loss.csv"
PNG_FILE = "loss.png"


# ----------------------------------------------------------------------------- config


class ConfigDict:
    """JSON dict form of a training-config dataclass (TrainConfig, train_eagle.EagleTrainConfig):
    betas as a list; unknown keys (older / newer runs) are dropped on the way back."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


@dataclass
class TrainConfig(ConfigDict):
    """One training run. Defaults: the paper's Qwen3-8B recipe for the flow stage
    (block 16, ~39K steps at peak LR 6e-4); `for_stage` / `small` give the others.
    Batch size, warmup, betas, weight decay, clipping, EMA and max length are not given
    by the paper: these are common DiT / drafter choices."""

    stage: str = "flow"
    steps: int = 39_000
    lr: float = 6e-4  # peak; linear warmup then cosine decay to min_lr_ratio * lr
    warmup_steps: int = 1_000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_size: int = 256  # blocks (anchors) per step
    anchors_per_seq: int = 8  # anchors drawn from one sequence (they share its encoded context)
    max_len: int = 2048  # sequences are cut to this many tokens
    ema_decay: float = 0.999  # distill: EMA of the student for the semigroup side (0: the student)
    seed: int = 0
    log_every: int = 10
    save_every: int = 1_000
    amp: bool = True  # bf16 autocast on CUDA
    # flow: start from a trained DFlash-style drafter of the same backbone (warm_start_from_dflash);
    # dflash: continue one. "" = the DiT init. Not in the paper: a CPU-budget choice, reported.
    init_from: str = ""
    # Flow stage's check (flow_check): batches of blocks it runs on at every save (0 = off), the
    # data they come from ("" = the training data, another seed) and an optional DFlash-style
    # drafter whose per-slot accuracy is shown beside the denoiser's.
    check_batches: int = 4
    check_data: str = ""
    check_prior: str = ""
    # Drafter architecture for flow / dflash (distill copies the teacher's): DrafterConfig fields.
    arch: dict = field(
        default_factory=lambda: dict(dim=2048, n_blocks=6, n_heads=16, block_size=16)
    )

    @classmethod
    def for_stage(cls, stage: str, small: bool = False) -> TrainConfig:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if small:
            cfg = cls(
                stage=stage,
                steps=300,
                lr=1e-3,
                warmup_steps=20,
                batch_size=32,
                anchors_per_seq=4,
                max_len=256,
                ema_decay=0.99,
                log_every=5,
                save_every=100,
                amp=False,
                arch=dict(dim=64, n_blocks=2, n_heads=4, block_size=16, time_freq_dim=32),
            )
            if stage == "distill":
                cfg = replace(cfg, steps=200, lr=3e-4)
            return cfg
        if stage == "distill":
            return cls(stage=stage, steps=23_000, lr=5e-5, warmup_steps=500)
        return cls(stage=stage)  # flow, and dflash with the same budget (same data, retrained)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak LR at `step` (0-based): linear warmup, then cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    p = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


# ----------------------------------------------------------------------------- data


@dataclass
class Batch:
    features: Tensor  # [S, T, F] context features of S sequences, zero-padded
    seq_index: Tensor  # [N] int64: the sequence of each block
    lengths: Tensor  # [N] int64: context length = anchor position
    anchor: Tensor  # [N] int64 anchor token ids
    target: Tensor  # [N, K] int64 next K tokens (0 where masked)
    mask: Tensor  # [N, K] bool: slot k has a target token

    def to(self, device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def context(self, model: FlashMapDiT) -> CrossContext:
        """The blocks' context as `model` projects it (one encoding per sequence)."""
        full = torch.full(
            (self.features.shape[0],), self.features.shape[1], device=self.features.device
        )
        return model.context(self.features, full).select(self.seq_index, self.lengths)


def make_batch(
    seqs: list, block_size: int, anchors_per_seq: int, max_len: int, gen: np.random.Generator
) -> Batch:
    """Blocks from sequences (training.drafter_data.Sequence): anchors inside each response."""
    feats, rows = [], []
    for seq in seqs:
        L = min(len(seq.tokens), max_len)
        # As when serving: the first anchor is the first response token (the target supplies it
        # at prefill), its context the whole prompt; an anchor needs one target token after it.
        lo, hi = seq.prompt_len, L - 2
        if hi < lo:
            continue
        n = min(anchors_per_seq, hi - lo + 1)
        anchors = np.sort(gen.choice(np.arange(lo, hi + 1), size=n, replace=False))
        s = len(feats)
        feats.append(seq.features[: int(anchors[-1])])  # context never reaches past the last anchor
        tok = seq.tokens[:L]
        for a in anchors.tolist():
            rows.append((s, a, tok[a], tok[a + 1 : a + 1 + block_size]))
    if not rows:
        raise ValueError(
            "no sequence in this batch has a response token to predict (prompts >= max_len?)"
        )
    T = max(f.shape[0] for f in feats)
    F_ = feats[0].shape[1]
    fbuf = torch.zeros(len(feats), T, F_, dtype=torch.float32)
    for i, f in enumerate(feats):
        fbuf[i, : f.shape[0]] = f.float()
    N = len(rows)
    target = torch.zeros(N, block_size, dtype=torch.int64)
    mask = torch.zeros(N, block_size, dtype=torch.bool)
    for i, (_, _, _, y) in enumerate(rows):
        target[i, : len(y)] = y
        mask[i, : len(y)] = True
    return Batch(
        fbuf,
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([int(r[2]) for r in rows]),
        target,
        mask,
    )


class SequenceStream:
    """A deterministic endless stream of sequences over the shards: epoch e visits the
    shards in a seeded order and each shard's sequences in a seeded order. Position p of
    the stream depends only on (seed, p), so a resumed run sees the same data.
    Only sequences with an anchor inside the response (after cutting to max_len) are used."""

    def __init__(
        self, data_dir: str | Path, seed: int = 0, max_len: int | None = None, cache_shards: int = 2
    ):
        self.shards = list_shards(data_dir)
        self.index = []  # per shard: the usable sequence numbers
        for path in self.shards:
            offsets, prompt_lens = shard_index(path)
            lengths = np.diff(offsets)
            if max_len is not None:
                lengths = np.minimum(lengths, max_len)
            self.index.append(np.nonzero(lengths - 2 >= prompt_lens)[0])
        self.counts = [len(ix) for ix in self.index]
        self.total = sum(self.counts)
        if self.total == 0:
            raise ValueError(
                f"{data_dir}: no sequence has a response of >= 2 tokens within max_len {max_len}"
            )
        self.seed = seed
        self._cache: OrderedDict[int, Shard] = OrderedDict()
        self._cache_size = cache_shards

    def _shard(self, i: int) -> Shard:
        if i in self._cache:
            self._cache.move_to_end(i)
        else:
            self._cache[i] = Shard(self.shards[i])
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return self._cache[i]

    def get(self, p: int):
        epoch, r = divmod(p, self.total)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        for i in order:
            if r < self.counts[i]:
                idx = self.index[i][
                    np.random.default_rng([self.seed, epoch, int(i)]).permutation(self.counts[i])[r]
                ]
                return self._shard(int(i))[int(idx)]
            r -= self.counts[i]
        raise AssertionError("unreachable")

    def take(self, start: int, n: int) -> list:
        return [self.get(p) for p in range(start, start + n)]


# ----------------------------------------------------------------------------- losses


def slot_weights(block_size: int, decay: float, device=None) -> Tensor:
    """[K] exp(-(k-1)/decay) for slots k = 1..K."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def _weighted_mean(per_slot: Tensor, mask: Tensor, w: Tensor) -> Tensor:
    """per_slot [N, K] -> scalar mean weighted by slot weight w [K] over unmasked slots."""
    wm = w[None] * mask.to(per_slot.dtype)
    return (per_slot * wm).sum() / wm.sum().clamp_min(1e-12)


def weighted_ce(logits: Tensor, target: Tensor, mask: Tensor, w: Tensor) -> Tensor:
    """Slot-weighted cross-entropy: logits [N, K, V], target [N, K], mask [N, K], w [K]."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none").view(
        target.shape
    )
    return _weighted_mean(ce, mask, w)


def weighted_kl(p: Tensor, logits: Tensor, mask: Tensor, w: Tensor) -> Tensor:
    """Slot-weighted KL(p || softmax(logits)): p [N, K, V] probabilities."""
    kl = F.kl_div(logits.float().log_softmax(-1), p.float(), reduction="none").sum(-1)  # [N, K]
    return _weighted_mean(kl, mask, w)


def sample_times(
    n: int, vocab_size: int, cfg: DrafterConfig, gen: torch.Generator, device
) -> Tensor:
    """[n] flow times t = t_of_tau(tau) under cfg's time map, tau ~ U(0, 1)."""
    tau = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
    if cfg.pure_noise_fraction > 0:
        pure = (
            torch.rand(n, generator=gen, device=device, dtype=torch.float64)
            < cfg.pure_noise_fraction
        )
        tau = torch.where(pure, torch.zeros_like(tau), tau)
    return map_t_of_tau(tau, cfg).float()


def noisy_state(
    target: Tensor, t: Tensor, vocab_size: int, gen: torch.Generator, shared: bool = True
) -> Tensor:
    """x_t = (1-t)*eps + t*onehot(target): [N, K, V]; eps is one [V] draw per block when shared."""
    N, K = target.shape
    eps = torch.randn(N, 1 if shared else K, vocab_size, generator=gen, device=target.device)
    t = t.float().view(N, 1, 1)
    x = ((1 - t) * eps).expand(N, K, vocab_size).contiguous()
    return x.scatter_add_(
        -1, target[..., None], t.expand(N, K, 1).contiguous()
    )  # + t * onehot, no [N, K, V] one-hot


def flow_loss(model: FlashMapDiT, batch: Batch, gen: torch.Generator) -> tuple[Tensor, dict]:
    """Flow stage: denoiser cross-entropy on the diagonal s = t."""
    cfg, V = model.cfg, model.cfg.vocab_size
    ctx = batch.context(model)
    t = sample_times(len(batch.anchor), V, cfg, gen, batch.anchor.device)
    x_t = noisy_state(batch.target, t, V, gen, cfg.shared_noise)
    logits = model(x_t, t, t, batch.anchor, ctx)
    loss = weighted_ce(
        logits,
        batch.target,
        batch.mask,
        slot_weights(cfg.block_size, cfg.slot_loss_decay, t.device),
    )
    return loss, {"loss": loss.item()}


def dflash_loss(
    model: FlashMapDiT, batch: Batch, gen: torch.Generator | None = None
) -> tuple[Tensor, dict]:
    """DFlash-style baseline: cross-entropy of one pass over the masked block."""
    cfg = model.cfg
    logits = model(None, 0.0, 1.0, batch.anchor, batch.context(model))
    loss = weighted_ce(
        logits,
        batch.target,
        batch.mask,
        slot_weights(cfg.block_size, cfg.slot_loss_decay, logits.device),
    )
    return loss, {"loss": loss.item()}


def semigroup_mix(s: Tensor, u: Tensor, t: Tensor) -> Tensor:
    """lam [N] with X_{u,t}(X_{s,u}(x)) = x + (t-s)/(1-s) (lam*pi_su + (1-lam)*pi_ut - x)."""
    lam = (u - s) * (1 - t) / ((t - s) * (1 - u)).clamp_min(1e-12)
    return torch.where(t - s > 1e-7, lam, torch.zeros_like(lam)).clamp(0.0, 1.0)


def semigroup_target(fn, x_s: Tensor, s: Tensor, u: Tensor, t: Tensor) -> Tensor:
    """pi* [N, K, V] that makes one jump s -> t land where the jumps s -> u -> t of `fn` land.

    fn(x, s, t) -> logits [N, K, V] (called under no_grad by the caller)."""
    pi_su = fn(x_s, s, u).float().softmax(-1)
    x_u = jump(x_s, pi_su, s, u)
    pi_ut = fn(x_u, u, t).float().softmax(-1)
    lam = semigroup_mix(s, u, t).view(-1, 1, 1)
    return lam * pi_su + (1 - lam) * pi_ut


def sample_jumps(n: int, vocab_size: int, cfg: DrafterConfig, gen: torch.Generator, device):
    """Per block (s, u, t, zero): zero-length jumps with probability zero_jump_fraction, full
    0 -> 1 jumps for full_jump_fraction of all blocks, otherwise tau_s < tau_t uniform;
    u is the midpoint in tau."""
    r = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
    a, b = torch.rand(2, n, generator=gen, device=device, dtype=torch.float64)
    zero = r < cfg.zero_jump_fraction
    full = ~zero & (r < cfg.zero_jump_fraction + cfg.full_jump_fraction)
    tau_s, tau_t = torch.minimum(a, b), torch.maximum(a, b)
    tau_t = torch.where(zero, tau_s, tau_t)
    tau_s = torch.where(full, torch.zeros_like(tau_s), tau_s)
    tau_t = torch.where(full, torch.ones_like(tau_t), tau_t)
    tau_u = 0.5 * (tau_s + tau_t)
    tm = lambda x: map_t_of_tau(x, cfg).float()  # noqa: E731
    s, u, t = tm(tau_s), tm(tau_u), tm(tau_t)
    t = torch.where(zero, s, t)  # exactly s = t
    return s, u, t, zero


def bind(model: FlashMapDiT, batch: Batch, rows: Tensor | None = None):
    """fn(x, s, t) -> logits of `model` on the batch's blocks (or a subset `rows`)."""
    ctx = batch.context(model)
    anchor = batch.anchor
    if rows is not None:
        ctx, anchor = ctx.select(rows), anchor[rows]
    return lambda x, s, t: model(x, s, t, anchor, ctx)


def distill_loss_terms(
    student_fn,
    teacher_fn,
    ema_fn,
    x_s: Tensor,
    s: Tensor,
    u: Tensor,
    t: Tensor,
    zero: Tensor,
    mask: Tensor,
    w: Tensor,
) -> tuple[Tensor, dict]:
    """Flow-map distillation on one set of blocks.

    student_fn(x, s, t) -> logits of all N blocks (with grad); teacher_fn / ema_fn(x, s, t,
    rows) -> logits of the blocks `rows` (called under no_grad). Zero-length rows (zero)
    match the teacher denoiser, the others the semigroup target of the EMA side."""
    logits = student_fn(x_s, s, t)
    target = torch.empty_like(logits, dtype=torch.float32)
    zi, si = zero.nonzero()[:, 0], (~zero).nonzero()[:, 0]
    with torch.no_grad():
        if len(zi):
            target[zi] = teacher_fn(x_s[zi], s[zi], t[zi], zi).float().softmax(-1)
        if len(si):
            target[si] = semigroup_target(
                lambda x, a, b: ema_fn(x, a, b, si), x_s[si], s[si], u[si], t[si]
            )
    kl = F.kl_div(logits.float().log_softmax(-1), target, reduction="none").sum(-1)  # [N, K]
    loss = _weighted_mean(kl, mask, w)
    stats = {"loss": loss.item()}
    with torch.no_grad():
        for name, rows in (("zero", zero), ("semigroup", ~zero)):
            m = mask & rows[:, None]
            stats[name] = _weighted_mean(kl, m, w).item() if m.any() else float("nan")
    return loss, stats


def distill_loss(
    student: FlashMapDiT, teacher: FlashMapDiT, ema: FlashMapDiT, batch: Batch, gen: torch.Generator
) -> tuple[Tensor, dict]:
    cfg, V = student.cfg, student.cfg.vocab_size
    s, u, t, zero = sample_jumps(len(batch.anchor), V, cfg, gen, batch.anchor.device)
    x_s = noisy_state(batch.target, s, V, gen, cfg.shared_noise)
    with torch.no_grad():
        t_ctx, e_ctx = batch.context(teacher), batch.context(ema)
    teacher_fn = lambda x, a, b, rows: teacher(x, a, b, batch.anchor[rows], t_ctx.select(rows))  # noqa: E731
    ema_fn = lambda x, a, b, rows: ema(x, a, b, batch.anchor[rows], e_ctx.select(rows))  # noqa: E731
    return distill_loss_terms(
        bind(student, batch),
        teacher_fn,
        ema_fn,
        x_s,
        s,
        u,
        t,
        zero,
        batch.mask,
        slot_weights(cfg.block_size, cfg.slot_loss_decay, x_s.device),
    )


# ----------------------------------------------------------------------------- trainer

ARCH_FIELDS = ("dim", "n_blocks", "n_heads", "block_size", "mlp_ratio", "time_freq_dim", "qk_norm")


def _field_default(cls, name: str):
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is MISSING else f.default


def warm_start_from_dflash(src: FlashMapDiT, **config_overrides) -> FlashMapDiT:
    """A flashmap drafter that computes exactly what the DFlash-style `src` computes at the
    1-jump conditioning (s, t) = (0, 1), whatever its input state.

    Both kinds share every module but the slot input: dflash feeds a learned mask vector,
    flashmap a projection of the state. The projection starts at zero and the mask vector
    moves into the slots' position embeddings, so the flow stage starts from the baseline's
    per-slot marginals and only has to learn what the state adds (joint structure).
    config_overrides: non-architecture DrafterConfig fields (pure_noise_fraction, ...)."""
    if src.cfg.kind != "dflash":
        raise ValueError(f"--init-from needs a dflash drafter, got kind {src.cfg.kind!r}")
    bad = sorted(set(config_overrides) & set(ARCH_FIELDS))
    if bad:
        raise ValueError(f"the architecture comes from the --init-from drafter; do not set {bad}")
    # A new flow drafter reads its state and keeps time as new drafters do, whatever the source
    # checkpoint's config says (a dflash config from before these fields carries the legacy values).
    new = {
        f: _field_default(DrafterConfig, f)
        for f in ("time_map", "state_input", "shared_noise", "time_map_candidates")
    }
    cfg = replace(
        src.cfg, kind="flashmap", time_table_t=[], time_table_tau=[], **{**new, **config_overrides}
    )
    model = FlashMapDiT(cfg).to(src.pos_embed.device, src.pos_embed.dtype)
    model.set_target(src.embed, src.lm_head)
    state = {k: v for k, v in src.state_dict().items() if k != "mask_embed"}
    with torch.no_grad():
        state["pos_embed"] = state["pos_embed"].clone()
        state["pos_embed"][1:] += src.mask_embed  # [K, D] slots; row 0 is the anchor
        state["state_in.weight"] = torch.zeros_like(model.state_in.weight)
    model.load_state_dict(state)
    return model


def _check_data(meta: dict, model_cfg: DrafterConfig) -> None:
    if meta["target_vocab_size"] != model_cfg.vocab_size:
        raise ValueError(
            f"data vocab {meta['target_vocab_size']} != drafter vocab {model_cfg.vocab_size}"
        )
    if list(meta["feature_layers"]) != list(model_cfg.feature_layers):
        raise ValueError(
            f"data feature layers {meta['feature_layers']} != drafter's {model_cfg.feature_layers}"
        )
    if meta.get("embed_hash") and meta["embed_hash"] != model_cfg.embed_hash:
        raise ValueError("the data were made with another target (embedding hash differs)")


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and name != "pos_embed" else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _step_generator(seed: int, step: int, device) -> torch.Generator:
    s = int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0]) & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(s)


def plot_losses(csv_path: Path, png_path: Path, cols: list[str] | None = None) -> None:
    """Plot of the loss columns of csv_path (default: every column but step, lr, elapsed_s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    cols = cols or [c for c in rows[0] if c not in ("step", "lr", "elapsed_s")]
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cols:
        ys = [float(r[c]) if r[c] not in ("", "nan") else float("nan") for r in rows]
        ax.plot(steps, ys, label=c)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if all(float(r["loss"]) > 0 for r in rows):
        ax.set_yscale("log")
    ax.set_title(csv_path.parent.name)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def train(
    tcfg: TrainConfig,
    *,
    target: str | Path,
    data: str | Path,
    out: str | Path,
    teacher: str | Path | None = None,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
) -> FlashMapDiT:
    """Run one stage; returns the trained model (also saved in out)."""
    if tcfg.stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {tcfg.stage!r}")
    torch.manual_seed(tcfg.seed)

    teacher_model = None
    if tcfg.stage == "distill":
        if tcfg.init_from:
            raise ValueError(
                "--init-from is for the flow and dflash stages (distill starts from --teacher)"
            )
        if teacher is None:
            raise ValueError("--stage distill needs --teacher (a flow-stage drafter checkpoint)")
        teacher_model = load_drafter(teacher, target, device=device)
        if teacher_model.cfg.kind != "flashmap":
            raise ValueError(
                f"the teacher must be a flashmap drafter, got kind {teacher_model.cfg.kind!r}"
            )
        teacher_model.requires_grad_(False).eval()
        model = copy.deepcopy(teacher_model).requires_grad_(True).train()
    elif tcfg.init_from:
        # flow: FlashMap warm-started from the baseline, or a flow-stage drafter trained on;
        # dflash: the baseline trained on (the equal-compute comparison).
        src = load_drafter(tcfg.init_from, target, device=device)
        if tcfg.stage == "dflash" or src.cfg.kind == "flashmap":
            want = "dflash" if tcfg.stage == "dflash" else "flashmap"
            if src.cfg.kind != want:
                raise ValueError(f"--init-from needs a {want} drafter, got kind {src.cfg.kind!r}")
            model = src.train()
            model.cfg = replace(
                src.cfg, **{k: v for k, v in tcfg.arch.items() if k not in ARCH_FIELDS}
            ).validate()
        else:
            model = warm_start_from_dflash(
                src, **{k: v for k, v in tcfg.arch.items() if k not in ARCH_FIELDS}
            ).train()
    else:
        kind = "dflash" if tcfg.stage == "dflash" else "flashmap"
        model = init_drafter(target, seed=tcfg.seed, device=device, kind=kind, **tcfg.arch).train()
    _check_data(read_meta(data), model.cfg)
    stream = SequenceStream(data, seed=tcfg.seed, max_len=tcfg.max_len)
    seqs_per_step = max(1, -(-tcfg.batch_size // tcfg.anchors_per_seq))
    K = model.cfg.block_size

    def batch_fn(step: int) -> Batch:
        rng = np.random.default_rng([tcfg.seed, step, 1])
        return make_batch(
            stream.take(step * seqs_per_step, seqs_per_step),
            K,
            tcfg.anchors_per_seq,
            tcfg.max_len,
            rng,
        ).to(device)

    check_batches = prior = None
    if tcfg.stage == "flow" and tcfg.check_batches > 0:
        if tcfg.check_data:
            _check_data(read_meta(tcfg.check_data), model.cfg)
        check_batches = flow_check_batches(tcfg.check_data or data, tcfg, K, device)
        if tcfg.check_prior:
            prior = load_drafter(tcfg.check_prior, target, device=device).eval()
    return run_stage(
        model,
        tcfg,
        batch_fn,
        out=out,
        teacher=teacher_model,
        resume=resume,
        device=device,
        progress=progress,
        check_batches=check_batches,
        check_prior=prior,
    )


def flow_check_batches(data: str | Path, tcfg: TrainConfig, block_size: int, device) -> list[Batch]:
    """The fixed blocks the flow stage's check runs on: tcfg.check_batches batches of a stream
    with another seed over `data` (tcfg.check_data: held-out data; else the training data)."""
    stream = SequenceStream(data, seed=tcfg.seed + 7919, max_len=tcfg.max_len)
    n = max(1, -(-tcfg.batch_size // tcfg.anchors_per_seq))
    rng = np.random.default_rng([tcfg.seed, 7919])
    return [
        make_batch(stream.take(i * n, n), block_size, tcfg.anchors_per_seq, tcfg.max_len, rng).to(
            device
        )
        for i in range(tcfg.check_batches)
    ]


def run_stage(
    model: FlashMapDiT,
    tcfg: TrainConfig,
    batch_fn,
    *,
    out: str | Path,
    teacher: FlashMapDiT | None = None,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    check_batches: list[Batch] | None = None,
    check_prior: FlashMapDiT | None = None,
) -> FlashMapDiT:
    """Train `model` for one stage (tcfg.stage) on batch_fn(step) -> Batch; distill: `teacher`
    is the frozen flow model (model starts as its copy). Flow stage with check_batches: at
    every save the denoiser's accuracy against tau on those blocks is logged and written to
    OUT/flow_summary.json, with a warning when it does not improve with tau (`flow_check`)."""
    model.embed.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    ema = None
    if tcfg.stage == "distill":
        ema = copy.deepcopy(model).requires_grad_(False).eval() if tcfg.ema_decay > 0 else model

    cols = (
        ["step", "lr", "loss"]
        + (["zero", "semigroup"] if tcfg.stage == "distill" else [])
        + ["elapsed_s"]
    )

    def batch_gen(step: int) -> tuple[Batch, torch.Generator]:
        return batch_fn(step), _step_generator(tcfg.seed, step, device)

    def loss_fn(batch_gen: tuple[Batch, torch.Generator]) -> tuple[Tensor, dict]:
        if tcfg.stage == "flow":
            return flow_loss(model, *batch_gen)
        if tcfg.stage == "dflash":
            return dflash_loss(model, *batch_gen)
        return distill_loss(model, teacher, ema, *batch_gen)

    own_ema = ema if ema is not None and ema is not model else None

    def ema_update() -> None:
        with torch.no_grad():
            for pe, pm in zip(own_ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - tcfg.ema_decay)

    on_save = None
    if tcfg.stage == "flow" and check_batches:
        on_save = lambda step: flow_check(model, check_batches, step, Path(out), prior=check_prior)  # noqa: E731
    return run_training(
        model,
        tcfg,
        stage=tcfg.stage,
        out=out,
        resume=resume,
        device=device,
        progress=progress,
        cols=cols,
        batch_fn=batch_gen,
        loss_fn=loss_fn,
        extra_modules={"ema": own_ema},
        after_step=ema_update if own_ema is not None else None,
        on_save=on_save,
        postfix=lambda stats, lr: dict(loss=f"{stats['loss']:.4f}", lr=f"{lr:.2e}"),
    )


FLOW_SUMMARY = "flow_summary.json"


def flow_check(
    model: FlashMapDiT, batches: list[Batch], step: int, out: Path, prior: FlashMapDiT | None = None
) -> dict:
    """The flow stage's gate: the denoiser's accuracy against tau on `batches`
    (flow_diagnostics.denoiser_curve), logged, and OUT/flow_summary.json rewritten with it
    and its history; a WARNING line when the denoiser does not improve with tau."""
    from training import flow_diagnostics as fd

    was = model.training
    model.eval()
    try:
        curve = fd.denoiser_curve(model, batches, prior=prior)
    finally:
        model.train(was)
    ok = fd.reads_state(curve)
    path = out / FLOW_SUMMARY
    old = json.loads(path.read_text()) if path.is_file() else {}
    history = [h for h in old.get("history", []) if h["step"] < step]
    history.append(
        dict(
            step=step,
            acc_tau0=fd.accuracy_at(curve, 0.0),
            acc_tau09=fd.accuracy_at(curve, 0.9),
            reads_state=ok,
        )
    )
    summary = dict(
        step=step,
        reads_state=ok,
        margin=fd.READS_STATE_MARGIN,
        time_map=model.cfg.time_map,
        state_input=model.cfg.state_input,
        shared_noise=model.cfg.shared_noise,
        curve=curve,
        history=history,
    )
    if not ok:
        summary["warning"] = (
            "the denoiser does not improve with tau: it does not read its noisy state, so "
            "this is not a flow (per-slot marginals at best); do not distil it"
        )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    print(f"\nflow check, step {step}:\n{fd.format_curve(curve)}", flush=True)
    if not ok:
        print(
            f"WARNING: step {step}: {summary['warning']} (accuracy {fd.accuracy_at(curve, 0.0):.3f} at tau = 0, "
            f"{fd.accuracy_at(curve, 0.9):.3f} at tau = 0.9; {path})",
            file=sys.stderr,
            flush=True,
        )
    return summary


def run_training(
    model: torch.nn.Module,
    tcfg,
    *,
    stage: str,
    out: str | Path,
    resume: bool,
    device: str,
    progress: bool,
    cols: list[str],
    batch_fn,
    loss_fn,
    extra_modules: dict | None = None,
    after_step=None,
    postfix=None,
    plot_cols: list[str] | None = None,
    stage_name: str | None = None,
    on_save=None,
) -> torch.nn.Module:
    """The training loop every drafter shares (this module's stages, train_eagle).

    AdamW with `_param_groups` and the `lr_factor` schedule; resume from OUT/train_state.pt
    (refused when its "stage" is not `stage`; stage_name names the expected run in the
    error, default repr(stage)); loss.csv keeps exactly the rows of steps already done; per
    step batch_fn(step) (outside autocast) then loss_fn(batch) -> (loss, stats) under bf16
    autocast when tcfg.amp on CUDA, gradient clipping, after_step() after the optimizer
    step; every save_every steps the drafter checkpoint (save_drafter), train_state.pt
    (model, optimizer, scheduler, step, train config, and extra_modules' state dicts: None
    for a None module) and loss.png (plot_cols), then on_save(step). Returns the model in eval mode."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_path, csv_path = out / STATE_FILE, out / CSV_FILE
    extra_modules = extra_modules or {}
    opt = torch.optim.AdamW(_param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=tcfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, tcfg))
    start = 0
    if resume and state_path.is_file():
        st = torch.load(state_path, map_location=device, weights_only=False)
        if st.get("stage") != stage:
            raise ValueError(
                f"{state_path} is a {st.get('stage')!r} run, not {stage_name or repr(stage)}"
            )
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        for name, m in extra_modules.items():
            if m is not None and st.get(name) is not None:
                m.load_state_dict(st[name])
        start = int(st["step"])
    # The CSV keeps exactly the rows of steps already done (a crash may have logged past the last save).
    old_rows = []
    if start and csv_path.is_file():
        with open(csv_path) as f:
            old_rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows(old_rows)

    amp = tcfg.amp and torch.device(device).type == "cuda"

    def save(step: int) -> None:
        save_drafter(model, out)
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(
            {
                "stage": stage,
                "step": step,
                "train_config": tcfg.to_dict(),
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                **{
                    name: None if m is None else m.state_dict() for name, m in extra_modules.items()
                },
            },
            tmp,
        )
        tmp.replace(state_path)
        plot_losses(csv_path, out / PNG_FILE, plot_cols)
        if on_save is not None:
            on_save(step)

    t0 = time.perf_counter()
    csv_f = open(csv_path, "a", newline="")
    writer = csv.DictWriter(csv_f, cols, extrasaction="ignore")
    bar = tqdm(
        range(start, tcfg.steps), initial=start, total=tcfg.steps, desc=stage, disable=not progress
    )
    try:
        for step in bar:
            batch = batch_fn(step)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
                loss, stats = loss_fn(batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: loss is {loss.item()}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            if after_step is not None:
                after_step()
            done = step + 1
            if done % tcfg.log_every == 0 or done == tcfg.steps or step == start:
                writer.writerow(
                    {
                        "step": done,
                        "lr": f"{lr:.3e}",
                        "elapsed_s": f"{time.perf_counter() - t0:.2f}",
                        **{k: f"{v:.6f}" for k, v in stats.items()},
                    }
                )
                csv_f.flush()
                if postfix is not None:
                    bar.set_postfix(**postfix(stats, lr))
            if done % tcfg.save_every == 0 or done == tcfg.steps:
                save(done)
    finally:
        csv_f.close()
    if start >= tcfg.steps:  # nothing to do: still leave a complete checkpoint behind
        save(start)
    return model.eval()


# ----------------------------------------------------------------------------- CLI

RUN_OPTIONS = (
    "steps",
    "lr",
    "warmup_steps",
    "batch_size",
    "max_len",
    "seed",
    "save_every",
    "log_every",
)


def add_common_args(ap: argparse.ArgumentParser, *, small_help: str, batch_help: str) -> None:
    """The options of every drafter training CLI (this one, train_eagle); each adds its own
    (stage, architecture, ...). The RUN_OPTIONS ones override training-config fields."""
    ap.add_argument(
        "--target", required=True, help="target checkpoint directory (embedding / LM head, hashes)"
    )
    ap.add_argument("--data", required=True, help="directory written by training.drafter_data")
    ap.add_argument(
        "--out", required=True, help="output directory (drafter checkpoint + training state)"
    )
    ap.add_argument("--small", action="store_true", help=small_help)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float, help="peak learning rate (cosine schedule with warmup)")
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--batch-size", type=int, help=batch_help)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--save-every", type=int)
    ap.add_argument("--log-every", type=int)
    ap.add_argument(
        "--resume", action="store_true", help="continue from OUT/train_state.pt if present"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-progress", action="store_true")


def config_from_args(
    cfg,
    args: argparse.Namespace,
    run_options: tuple[str, ...] = (),
    arch_options: tuple[str, ...] = (),
):
    """cfg with the options given on the command line: RUN_OPTIONS and run_options replace
    its fields, arch_options its `arch` entries."""
    given = lambda keys: {k: getattr(args, k) for k in keys if getattr(args, k) is not None}  # noqa: E731
    return replace(
        cfg, **given(RUN_OPTIONS + run_options), arch={**cfg.arch, **given(arch_options)}
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.train_drafter", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--stage", choices=STAGES, required=True)
    add_common_args(
        ap,
        small_help="CPU-sized preset (tiny drafter, short run)",
        batch_help="blocks (anchors) per step",
    )
    ap.add_argument("--teacher", help="distill: the flow-stage drafter checkpoint")
    ap.add_argument("--anchors-per-seq", type=int)
    ap.add_argument("--ema-decay", type=float)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--n-blocks", type=int)
    ap.add_argument("--n-heads", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument(
        "--pure-noise-fraction", type=float, help="flow: share of blocks at tau = 0 (paper: 0)"
    )
    ap.add_argument(
        "--time-map",
        choices=("embedded", "vocab"),
        help="flow: tau <-> t map (default embedded: measured on what the embedded state tells)",
    )
    ap.add_argument(
        "--time-map-candidates",
        type=int,
        nargs="+",
        help="flow, embedded map: the readers tau averages over, tokens each chooses between (0 = all V)",
    )
    ap.add_argument(
        "--state-input",
        choices=("whiten", "rms"),
        help="flow: how the network reads the embedded state",
    )
    ap.add_argument(
        "--noise",
        choices=("slot", "shared"),
        help="flow: an independent noise draw per slot (default) or one draw shared by the K slots",
    )
    ap.add_argument(
        "--check-data",
        help="flow: held-out drafter data for the flow check (default: training data)",
    )
    ap.add_argument(
        "--check-prior",
        help="flow: a DFlash-style drafter shown beside the denoiser in the flow check",
    )
    ap.add_argument(
        "--check-batches", type=int, help="flow: batches of the flow check at every save (0 = off)"
    )
    ap.add_argument(
        "--init-from",
        help="flow: start from a DFlash-style drafter (warm start, not the paper's) or train "
        "a flow-stage drafter on; dflash: train a DFlash-style drafter on",
    )
    args = ap.parse_args(argv)

    if args.noise is not None:
        args.shared_noise = args.noise == "shared"
    else:
        args.shared_noise = None
    cfg = config_from_args(
        TrainConfig.for_stage(args.stage, small=args.small),
        args,
        ("anchors_per_seq", "ema_decay", "init_from", "check_data", "check_prior", "check_batches"),
        (
            "dim",
            "n_blocks",
            "n_heads",
            "block_size",
            "pure_noise_fraction",
            "time_map",
            "state_input",
            "shared_noise",
            "time_map_candidates",
        ),
    )
    try:
        train(
            cfg,
            target=args.target,
            data=args.data,
            out=args.out,
            teacher=args.teacher,
            resume=args.resume,
            device=args.device,
            progress=not args.no_progress,
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"drafter checkpoint in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
