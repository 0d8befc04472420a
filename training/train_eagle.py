"""Training of the EAGLE-3-style autoregressive baseline drafter (drafter_service.eagle).

Same data as the FlashMap / DFlash drafters: the shards of `training.drafter_data` (the
target's own responses + target features). A training row is a whole sequence (cut to
max_len): step 0 of the rollout predicts t_{p+2} from the target features of position p
and the token t_{p+1}; steps s = 1..train_depth-1 ("training-time test", EAGLE-3) redo
every position with the drafter's own hidden state from the previous step in place of
the features, as when it drafts slot s+1 (EagleDrafter.rollout). Loss: cross-entropy of
every response token, rollout step s weighted exp(-s/step_loss_decay) (the same decay
as FlashMap's slot weights: step s drafts slot s+1).

    python -m training.train_eagle --target T --data D --out runs/eagle [--small] [--resume]

OUT holds the drafter checkpoint (config.json with kind "eagle" + model.safetensors, via
save_eagle), train_state.pt (model, optimizer, scheduler, step), loss.csv and loss.png.
The optimiser, schedule, data stream, loop, resume, logging and CLI options are those of
the FlashMap drafter's training (training.trainer).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drafter_service.eagle import EagleDrafter, init_eagle
from training.drafter_data import read_meta
from training.sequence_stream import SequenceStream, check_data
from training.train_options import ConfigDict, add_common_args, config_from_args, run_cli
from training.trainer import run_training

STAGE = "eagle"


@dataclass
class EagleTrainConfig(ConfigDict):
    """Defaults: the same budget as the FlashMap flow stage (~39K steps); batch in sequences.
    LR, batch, warmup, clipping and depth are common EAGLE-3 choices, not from the paper."""

    steps: int = 39_000
    lr: float = 3e-4
    warmup_steps: int = 1_000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_size: int = 16  # sequences per step (every response position is a training row)
    max_len: int = 2048
    seed: int = 0
    log_every: int = 10
    save_every: int = 1_000
    amp: bool = True  # bf16 autocast on CUDA
    # EagleConfig fields; dim None = the target's hidden size.
    arch: dict = field(
        default_factory=lambda: dict(dim=None, n_layers=1, n_heads=32, block_size=16, train_depth=7)
    )

    @classmethod
    def small(cls) -> EagleTrainConfig:
        return cls(
            steps=300,
            lr=1e-3,
            warmup_steps=20,
            batch_size=8,
            max_len=256,
            log_every=5,
            save_every=100,
            amp=False,
            arch=dict(dim=None, n_layers=1, n_heads=4, block_size=16, train_depth=4),
        )


@dataclass
class SeqBatch:
    tokens: Tensor  # [B, T] int64, zero-padded
    features: Tensor  # [B, T, F] float32, zero-padded
    lengths: Tensor  # [B] int64
    prompt_lens: Tensor  # [B] int64

    def to(self, device) -> SeqBatch:
        return SeqBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def make_seq_batch(seqs: list, max_len: int) -> SeqBatch:
    """Whole sequences (training.drafter_data.Sequence), cut to max_len and zero-padded."""
    seqs = [s for s in seqs if min(len(s.tokens), max_len) > s.prompt_len]
    if not seqs:
        raise ValueError("no sequence in this batch has a response token inside max_len")
    lens = [min(len(s.tokens), max_len) for s in seqs]
    T, F_ = max(lens), seqs[0].features.shape[1]
    tokens = torch.zeros(len(seqs), T, dtype=torch.int64)
    feats = torch.zeros(len(seqs), T, F_, dtype=torch.float32)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        tokens[i, :n] = s.tokens[:n]
        feats[i, :n] = s.features[:n].float()
    return SeqBatch(tokens, feats, torch.tensor(lens), torch.tensor([s.prompt_len for s in seqs]))


def eagle_loss(
    model: EagleDrafter, batch: SeqBatch, depth: int | None = None
) -> tuple[Tensor, dict]:
    """Step-weighted cross-entropy over the rollout; stats: loss, per-step loss and top-1 accuracy."""
    cfg = model.cfg
    depth = cfg.train_depth if depth is None else depth
    outs = model.rollout(batch.features, batch.tokens, depth)
    B, T = batch.tokens.shape
    p = torch.arange(T - 1, device=batch.tokens.device)[None]  # positions; target index p + 2
    target = torch.cat([batch.tokens[:, 2:], torch.zeros_like(batch.tokens[:, :1])], 1)  # [B, T-1]
    inside = (p + 2 < batch.lengths[:, None]) & (p + 2 >= batch.prompt_lens[:, None])
    total, norm, stats = 0.0, 0.0, {}
    for s, h in enumerate(outs):
        valid = inside & (p >= s)  # step s needs real context ending at p - s >= 0
        n = int(valid.sum())
        if n == 0:
            stats[f"ce{s}"], stats[f"acc{s}"] = float("nan"), float("nan")
            continue
        logits = model.logits(h[valid])  # [n, V]: only the rows that count
        y = target[valid]
        ce = F.cross_entropy(logits, y, reduction="sum")
        w = float(np.exp(-s / cfg.step_loss_decay))
        total = total + w * ce
        norm += w * n
        stats[f"ce{s}"] = ce.item() / n
        stats[f"acc{s}"] = (logits.argmax(-1) == y).float().mean().item()
    if norm == 0:
        raise ValueError("no response token to predict in this batch")
    loss = total / norm
    stats["loss"] = loss.item()
    return loss, stats


def train(
    tcfg: EagleTrainConfig,
    *,
    target: str | Path,
    data: str | Path,
    out: str | Path,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
) -> EagleDrafter:
    """Train (or continue); returns the model (also saved in out)."""
    torch.manual_seed(tcfg.seed)
    model = init_eagle(target, seed=tcfg.seed, device=device, **tcfg.arch).train()
    check_data(read_meta(data), model.cfg)
    cols = (
        ["step", "lr", "loss"] + [f"acc{s}" for s in range(model.cfg.train_depth)] + ["elapsed_s"]
    )
    stream = SequenceStream(data, seed=tcfg.seed)
    return run_training(
        model,
        tcfg,
        stage=STAGE,
        stage_name="an eagle run",
        out=out,
        resume=resume,
        device=device,
        progress=progress,
        cols=cols,
        batch_fn=lambda step: make_seq_batch(
            stream.take(step * tcfg.batch_size, tcfg.batch_size), tcfg.max_len
        ).to(device),
        loss_fn=lambda batch: eagle_loss(model, batch),
        postfix=lambda stats, lr: dict(
            loss=f"{stats['loss']:.4f}", acc0=f"{stats.get('acc0', float('nan')):.3f}"
        ),
        plot_cols=["loss"],
    )  # loss.png: the loss column only (per-step accuracies stay in the CSV)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.train_eagle", description=__doc__.split("\n\n")[0]
    )
    add_common_args(
        ap,
        small_help="CPU-sized preset (short run, depth-4 rollout)",
        batch_help="sequences per step",
    )
    ap.add_argument("--dim", type=int, help="drafter width (default: the target's hidden size)")
    ap.add_argument("--n-layers", type=int)
    ap.add_argument("--n-heads", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--train-depth", type=int, help="training-time-test rollout steps")
    args = ap.parse_args(argv)

    cfg = config_from_args(
        EagleTrainConfig.small() if args.small else EagleTrainConfig(),
        args,
        arch_options=("dim", "n_layers", "n_heads", "block_size", "train_depth"),
    )
    return run_cli(train, cfg, args, f"eagle drafter checkpoint in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
