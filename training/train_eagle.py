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
The optimiser, schedule, data stream, resume and logging are those of
training.train_drafter (shared code, not copies).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drafter_service.eagle import EagleDrafter, init_eagle, save_eagle
from training.drafter_data import read_meta
from training.train_drafter import SequenceStream, _check_data, _param_groups, lr_factor, plot_losses

STATE_FILE = "train_state.pt"
CSV_FILE = "loss.csv"
PNG_FILE = "loss.png"
STAGE = "eagle"


@dataclass
class EagleTrainConfig:
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
    arch: dict = field(default_factory=lambda: dict(dim=None, n_layers=1, n_heads=32, block_size=16, train_depth=7))

    @classmethod
    def small(cls) -> "EagleTrainConfig":
        return cls(steps=300, lr=1e-3, warmup_steps=20, batch_size=8, max_len=256, log_every=5, save_every=100,
                   amp=False, arch=dict(dim=None, n_layers=1, n_heads=4, block_size=16, train_depth=4))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleTrainConfig":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


@dataclass
class SeqBatch:
    tokens: Tensor  # [B, T] int64, zero-padded
    features: Tensor  # [B, T, F] float32, zero-padded
    lengths: Tensor  # [B] int64
    prompt_lens: Tensor  # [B] int64

    def to(self, device) -> "SeqBatch":
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


def eagle_loss(model: EagleDrafter, batch: SeqBatch, depth: int | None = None) -> tuple[Tensor, dict]:
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


def train(tcfg: EagleTrainConfig, *, target: str | Path, data: str | Path, out: str | Path, resume: bool = False,
          device: str = "cpu", progress: bool = True) -> EagleDrafter:
    """Train (or continue); returns the model (also saved in out)."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_path, csv_path = out / STATE_FILE, out / CSV_FILE
    torch.manual_seed(tcfg.seed)
    model = init_eagle(target, seed=tcfg.seed, device=device, **tcfg.arch).train()
    _check_data(read_meta(data), model.cfg)
    opt = torch.optim.AdamW(_param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=tcfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, tcfg))
    start = 0
    if resume and state_path.is_file():
        st = torch.load(state_path, map_location=device, weights_only=False)
        if st.get("stage") != STAGE:
            raise ValueError(f"{state_path} is a {st.get('stage')!r} run, not an eagle run")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        start = int(st["step"])
    depth = model.cfg.train_depth
    cols = ["step", "lr", "loss"] + [f"acc{s}" for s in range(depth)] + ["elapsed_s"]
    old_rows = []
    if start and csv_path.is_file():
        with open(csv_path) as f:
            old_rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows(old_rows)

    stream = SequenceStream(data, seed=tcfg.seed)
    amp = tcfg.amp and torch.device(device).type == "cuda"

    def save(step: int) -> None:
        save_eagle(model, out)
        tmp = out / (STATE_FILE + ".tmp")
        torch.save({"stage": STAGE, "step": step, "train_config": tcfg.to_dict(), "model": model.state_dict(),
                    "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp)
        tmp.replace(state_path)
        plot_losses_acc(csv_path, out / PNG_FILE)

    t0 = time.perf_counter()
    csv_f = open(csv_path, "a", newline="")
    writer = csv.DictWriter(csv_f, cols, extrasaction="ignore")
    bar = tqdm(range(start, tcfg.steps), initial=start, total=tcfg.steps, desc=STAGE, disable=not progress)
    try:
        for step in bar:
            batch = make_seq_batch(stream.take(step * tcfg.batch_size, tcfg.batch_size), tcfg.max_len).to(device)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
                loss, stats = eagle_loss(model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: loss is {loss.item()}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            done = step + 1
            if done % tcfg.log_every == 0 or done == tcfg.steps or step == start:
                writer.writerow({"step": done, "lr": f"{lr:.3e}", "elapsed_s": f"{time.perf_counter() - t0:.2f}",
                                 **{k: f"{v:.6f}" for k, v in stats.items()}})
                csv_f.flush()
                bar.set_postfix(loss=f"{stats['loss']:.4f}", acc0=f"{stats.get('acc0', float('nan')):.3f}")
            if done % tcfg.save_every == 0 or done == tcfg.steps:
                save(done)
    finally:
        csv_f.close()
    if start >= tcfg.steps:
        save(start)
    return model.eval()


def plot_losses_acc(csv_path: Path, png_path: Path) -> None:
    """loss.png: the loss column only (per-step accuracies stay in the CSV)."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    tmp = csv_path.with_name(".loss_only.csv")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, ["step", "lr", "loss", "elapsed_s"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    try:
        plot_losses(tmp, png_path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.train_eagle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint directory (embedding / LM head, hashes)")
    ap.add_argument("--data", required=True, help="directory written by training.drafter_data")
    ap.add_argument("--out", required=True, help="output directory (drafter checkpoint + training state)")
    ap.add_argument("--small", action="store_true", help="CPU-sized preset (short run, depth-4 rollout)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float, help="peak learning rate (cosine schedule with warmup)")
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--batch-size", type=int, help="sequences per step")
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--save-every", type=int)
    ap.add_argument("--log-every", type=int)
    ap.add_argument("--dim", type=int, help="drafter width (default: the target's hidden size)")
    ap.add_argument("--n-layers", type=int)
    ap.add_argument("--n-heads", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--train-depth", type=int, help="training-time-test rollout steps")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt if present")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    cfg = EagleTrainConfig.small() if args.small else EagleTrainConfig()
    over = {k: getattr(args, k) for k in ("steps", "lr", "warmup_steps", "batch_size", "max_len", "seed",
                                          "save_every", "log_every") if getattr(args, k) is not None}
    arch = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "block_size", "train_depth")
            if getattr(args, k) is not None}
    cfg = replace(cfg, **over, arch={**cfg.arch, **arch})
    try:
        train(cfg, target=args.target, data=args.data, out=args.out, resume=args.resume, device=args.device,
              progress=not args.no_progress)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"eagle drafter checkpoint in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
