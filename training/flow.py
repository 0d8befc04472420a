"""The flow pieces of drafter training: blocks, noisy states, flow times and the stages' losses.

A training row ("block") is one anchor inside a response of the drafter data
(`training.drafter_data`): the context is the target features strictly before the anchor,
the anchor token is the last committed token, and the target block is the next K tokens
after the anchor (slots past the end are masked). Many anchors of one sequence share one
encoded context (`CrossContext.select`).

Losses; slot k (1-based) is weighted
exp(-(k-1)/slot_loss_decay) in each:

- flow: tau ~ U(0, 1) mapped to t by the drafter's time map (drafter_service.flow_time);
  x_t = (1-t)*eps + t*onehot, eps one draw [V] shared by the K slots or one per slot (the
  drafter's shared_noise); the model is called on the diagonal (s = t) and trained with the
  cross-entropy of its clean-block logits.
- distill: per block a jump (s, t): a share `zero_jump_fraction` of the blocks are
  zero-length jumps (s = t) whose output distribution must match the frozen teacher
  denoiser's; `full_jump_fraction` of all jumps are the full 0 -> 1 jump; the rest have
  tau_s < tau_t uniform. Non-zero jumps follow the semigroup X_{s,t}(x_s) = X_{u,t}(X_{s,u}(x_s))
  for the midpoint u (midpoint in tau), the right-hand side computed under no_grad by
  an EMA of the student (or the student itself with ema_decay = 0).
  Because X_{s,t}(x) = x + (t-s)/(1-s) (pi - x), the composed jump is again of this form
  with pi* = lam * pi_{s,u} + (1 - lam) * pi_{u,t}, lam = (u-s)(1-t) / ((t-s)(1-u)):
  matching the maps is matching distributions, and the loss is KL(pi* || pi_student).
  It is exactly 0 when u = s or u = t for a self-consistent model and for any map whose pi
  does not depend on (x, s, t).
- dflash: the baseline (kind = "dflash": one pass over a masked block), the same
  cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drafter_service.config import DrafterConfig
from drafter_service.dit_blocks import CrossContext
from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flow_map import jump
from drafter_service.flow_time import map_t_of_tau

# ----------------------------------------------------------------------------- blocks


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
    seqs: list,
    block_size: int,
    anchors_per_seq: int,
    max_len: int,
    gen: np.random.Generator,
    device=None,
) -> Batch:
    """Blocks from sequences (training.drafter_data.Sequence): anchors inside each response.
    device: where the padded features are assembled (features computed online already sit on
    the target's device; default the CPU); the other fields stay on the CPU (Batch.to)."""
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
    # Offline features (bf16 on disk) are padded in fp32; online ones keep the dtype the target
    # computed them in (bf16 on a GPU: exact, at half the memory).
    dtype = torch.float32 if device is None else feats[0].dtype
    fbuf = torch.zeros(len(feats), T, F_, dtype=dtype, device=device)
    for i, f in enumerate(feats):
        fbuf[i, : f.shape[0]] = f.to(dtype)
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
    # + t * onehot, without an [N, K, V] one-hot
    return x.scatter_add_(-1, target[..., None], t.expand(N, K, 1).contiguous())


def flow_loss(model: FlashMapDiT, batch: Batch, gen: torch.Generator) -> tuple[Tensor, dict]:
    """Flow stage: denoiser cross-entropy on the diagonal s = t."""
    cfg, V = model.cfg, model.cfg.vocab_size
    ctx = batch.context(model)
    t = sample_times(len(batch.anchor), V, cfg, gen, batch.anchor.device)
    x_t = noisy_state(batch.target, t, V, gen, cfg.shared_noise)
    return block_ce(model(x_t, t, t, batch.anchor, ctx), batch, cfg)


def dflash_loss(
    model: FlashMapDiT, batch: Batch, gen: torch.Generator | None = None
) -> tuple[Tensor, dict]:
    """DFlash-style baseline: cross-entropy of one pass over the masked block."""
    return block_ce(model(None, 0.0, 1.0, batch.anchor, batch.context(model)), batch, model.cfg)


def block_ce(logits: Tensor, batch: Batch, cfg: DrafterConfig) -> tuple[Tensor, dict]:
    """The slot-weighted cross-entropy of logits [N, K, V] against the batch's blocks."""
    w = slot_weights(cfg.block_size, cfg.slot_loss_decay, logits.device)
    loss = weighted_ce(logits, batch.target, batch.mask, w)
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
    null: Tensor | None = None,
    data: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Flow-map distillation on one set of blocks.

    student_fn(x, s, t) -> logits of all N blocks (with grad); teacher_fn / ema_fn(x, s, t,
    rows) -> logits of the blocks `rows` (called under no_grad). Zero-length rows (zero)
    match the teacher denoiser, null rows (zero-state full jumps) the data block `data`
    [N, K] (KL to a one-hot: cross-entropy), the others the semigroup target of the EMA side."""
    logits = student_fn(x_s, s, t)
    target = torch.empty_like(logits, dtype=torch.float32)
    null = torch.zeros_like(zero) if null is None else null
    semi = ~zero & ~null
    zi, si, ni = zero.nonzero()[:, 0], semi.nonzero()[:, 0], null.nonzero()[:, 0]
    with torch.no_grad():
        if len(zi):
            target[zi] = teacher_fn(x_s[zi], s[zi], t[zi], zi).float().softmax(-1)
        if len(si):
            target[si] = semigroup_target(
                lambda x, a, b: ema_fn(x, a, b, si), x_s[si], s[si], u[si], t[si]
            )
        if len(ni):
            target[ni] = F.one_hot(data[ni], target.shape[-1]).float()
    kl = F.kl_div(logits.float().log_softmax(-1), target, reduction="none").sum(-1)  # [N, K]
    loss = _weighted_mean(kl, mask, w)
    stats = {"loss": loss.item()}
    parts = (("zero", zero), ("semigroup", semi)) + ((("null", null),) if len(ni) else ())
    with torch.no_grad():
        for name, rows in parts:
            m = mask & rows[:, None]
            stats[name] = _weighted_mean(kl, m, w).item() if m.any() else float("nan")
    return loss, stats


def distill_loss(
    student: FlashMapDiT, teacher: FlashMapDiT, ema: FlashMapDiT, batch: Batch, gen: torch.Generator
) -> tuple[Tensor, dict]:
    cfg, V = student.cfg, student.cfg.vocab_size
    s, u, t, zero = sample_jumps(len(batch.anchor), V, cfg, gen, batch.anchor.device)
    x_s = noisy_state(batch.target, s, V, gen, cfg.shared_noise)
    null, two = None, None
    if cfg.null_jump_fraction > 0:  # drawn last: the other draws are those of a map without
        null = torch.rand(len(s), generator=gen, device=s.device) < cfg.null_jump_fraction
        zero = zero & ~null
        s = torch.where(null, torch.zeros_like(s), s)
        t = torch.where(null, torch.ones_like(t), t)
        x_s = torch.where(null[:, None, None], torch.zeros_like(x_s), x_s)
        if cfg.null_two_jump_share > 0:  # these rows' first jump ends at t_1, not 1
            two = null & (
                torch.rand(len(s), generator=gen, device=s.device) < cfg.null_two_jump_share
            )
            t_1 = float(student.time_grid(2)[1])
            t = torch.where(two, torch.full_like(t, t_1), t)
    with torch.no_grad():
        t_ctx, e_ctx = batch.context(teacher), batch.context(ema)
    teacher_fn = lambda x, a, b, rows: teacher(x, a, b, batch.anchor[rows], t_ctx.select(rows))  # noqa: E731
    ema_fn = lambda x, a, b, rows: ema(x, a, b, batch.anchor[rows], e_ctx.select(rows))  # noqa: E731
    first = {}  # the student's logits, kept for the second jump

    def student_fn(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        first["logits"] = bind(student, batch)(x, a, b)
        return first["logits"]

    loss, stats = distill_loss_terms(
        student_fn,
        teacher_fn,
        ema_fn,
        x_s,
        s,
        u,
        t,
        zero,
        batch.mask,
        slot_weights(cfg.block_size, cfg.slot_loss_decay, x_s.device),
        null,
        batch.target,
    )
    if two is not None:
        stats["null2"] = float("nan")
        if bool(two.any()):
            loss, stats["null2"] = second_jump_loss(student, batch, first["logits"], two, t_1, loss)
    return loss, stats


def carried_estimate(logits: Tensor, cfg) -> Tensor:
    """The clean-block estimate [.., K, V] a first jump's logits carry to t_1 under
    cfg.two_jump_estimate: the softmax (the gradient flows into the first jump) or the one-hot
    argmax (no gradient)."""
    first = logits.float()
    if cfg.two_jump_estimate == "argmax":
        return F.one_hot(first.argmax(-1), first.shape[-1]).float()
    return first.softmax(-1)


def second_jump_loss(
    student: FlashMapDiT, batch: Batch, logits: Tensor, two: Tensor, t_1: float, loss: Tensor
) -> tuple[Tensor, float]:
    """loss plus the served second jump t_1 -> 1 of the rows `two` [N] bool, from the state the
    proposer carries there, t_1 * the first jump's estimate (the zero state plus the jump; its
    softmax, or its one-hot argmax under cfg.two_jump_estimate = "argmax"), scored by
    cross-entropy against the data; weighted by the rows' share of the blocks.
    Returns (total loss, the second jump's mean cross-entropy)."""
    rows = two.nonzero()[:, 0]
    x_1 = t_1 * carried_estimate(logits[rows], student.cfg)  # [n, K, V]
    out = bind(student, batch, rows)(x_1, t_1, 1.0)
    w = slot_weights(student.cfg.block_size, student.cfg.slot_loss_decay, out.device)
    ce = weighted_ce(out, batch.target[rows], batch.mask[rows], w)
    return loss + ce * (len(rows) / len(two)), ce.item()
