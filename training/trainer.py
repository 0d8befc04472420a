"""The training loop every drafter trainer shares (train_drafter's three stages, train_eagle,
train_published): AdamW and its schedule, gradient accumulation, bf16 autocast, clipping,
checkpoints with resume, several ranks, and the log (loss.csv, TensorBoard, loss.png).

OUT (a run's output directory) holds the drafter checkpoint (config.json +
model.safetensors, via save_drafter), train_state.pt (model, optimizer, scheduler, step and
the trainer's extra modules), loss.csv and loss.png.
"""

from __future__ import annotations

import csv
import math
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from drafter_service.checkpoint import save_drafter
from training.loss_plot import plot_losses
from training.sequence_stream import SequenceStream as SequenceStream  # re-exported

STATE_FILE = "train_state.pt"
CSV_FILE = "loss.csv"
PNG_FILE = "loss.png"


def lr_factor(step: int, cfg) -> float:
    """Multiplier of the peak LR at `step` (0-based) for a training config `cfg` (warmup_steps,
    steps, min_lr_ratio): linear warmup, then cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    p = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and name != "pos_embed" else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


KILL_ENV = (
    "FLASHMAP_TRAIN_KILL_AFTER_STEP"  # fault injection (the resume tests): SIGKILL after step N
)
REPLICA_DIR = "replicas"


def _log_row(stats: list[dict]) -> dict:
    """Stats of several micro-batches / ranks, averaged per key (NaN where none has it)."""
    keys = dict.fromkeys(k for s in stats for k in s)
    out = {}
    for k in keys:
        vals = [s[k] for s in stats if k in s and not math.isnan(s[k])]
        out[k] = sum(vals) / len(vals) if vals else float("nan")
    return out


def _tensorboard(out: Path):
    """A TensorBoard writer into OUT/tb when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional: loss.csv has the same numbers
        return None
    return SummaryWriter(str(out / "tb"))


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
    dist=None,
    accum_steps: int = 1,
    fsdp: bool = False,
    periodic=None,
    replica_digests: bool = False,
) -> torch.nn.Module:
    """The training loop every drafter shares (train_drafter's stages, train_eagle).

    AdamW with `_param_groups` and the `lr_factor` schedule; resume from OUT/train_state.pt
    (refused when its "stage" is not `stage`; stage_name names the expected run in the
    error, default repr(stage)); loss.csv keeps exactly the rows of steps already done; per
    step batch_fn(step) (outside autocast) then loss_fn(batch) -> (loss, stats) under bf16
    autocast when tcfg.amp on CUDA (the weights stay fp32), gradient clipping, after_step()
    after the optimizer step; every save_every steps the drafter checkpoint (save_drafter),
    train_state.pt (model, optimizer, scheduler, step, train config, every rank's RNG, and
    extra_modules' state dicts: None for a None module; anything with state_dict /
    load_state_dict, e.g. the data position) and loss.png (plot_cols), then on_save(step).
    Returns the model in eval mode.

    Several processes (dist, a training.distributed.Dist under torchrun): the loss runs through
    DDP (FSDP2 with fsdp), so gradients are averaged across ranks and the replicas stay equal;
    rank 0 alone writes files, shows progress and runs on_save / periodic; logged stats are the
    ranks' mean. accum_steps > 1: batch_fn(step) gives an iterable of that many micro-batches
    whose gradients add up (each loss / accum_steps) before one optimizer step, synced across
    ranks once. periodic: (every, fn): fn(step) on rank 0 after every `every` steps (the
    held-out acceptance check). replica_digests: every rank appends its parameters' sha256
    after every optimizer step to OUT/replicas/rank-R.txt (the rank-equality test)."""
    from tqdm import tqdm

    from training import distributed as D

    out = Path(out)
    main = dist is None or dist.main
    if main:
        out.mkdir(parents=True, exist_ok=True)
    D.barrier(dist)
    state_path, csv_path = out / STATE_FILE, out / CSV_FILE
    extra_modules = extra_modules or {}
    wrapped = D.wrap(model, loss_fn, dist, fsdp)
    opt = torch.optim.AdamW(_param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=tcfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, tcfg))
    start = 0
    if resume and state_path.is_file():
        st = torch.load(state_path, map_location=device, weights_only=False)
        if st.get("stage") != stage:
            raise ValueError(
                f"{state_path} is a {st.get('stage')!r} run, not {stage_name or repr(stage)}"
            )
        if bool(st.get("fsdp", False)) != fsdp:
            raise ValueError(f"{state_path} was written with fsdp={not fsdp}: resume it so")
        D.load_full_state(model, opt, st["model"], st["optimizer"], fsdp)
        sched.load_state_dict(st["scheduler"])
        for name, m in extra_modules.items():
            if m is not None and st.get(name) is not None:
                m.load_state_dict(st[name])
        rngs = st.get("rng") or []
        if len(rngs) == (dist.world if dist else 1):  # the same ranks: each takes its own back
            D.set_rng_state(rngs[dist.rank if dist else 0])
        start = int(st["step"])
    # The CSV keeps exactly the rows of steps already done (a crash may have logged past the last save).
    old_rows = []
    if main and start and csv_path.is_file():
        with open(csv_path) as f:
            old_rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start]
    if main:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows(old_rows)

    amp = tcfg.amp and torch.device(device).type == "cuda"
    kill_after = int(os.environ.get(KILL_ENV, "0") or 0)
    digests = None
    if replica_digests:
        (out / REPLICA_DIR).mkdir(parents=True, exist_ok=True)
        digests = open(out / REPLICA_DIR / f"rank-{dist.rank if dist else 0}.txt", "a")

    def save(step: int) -> None:
        model_sd, opt_sd = D.full_state(model, opt, fsdp)  # collective under FSDP2
        rngs = D.gather(D.rng_state(), dist)  # collective
        if not main:
            return
        save_drafter(SimpleNamespace(state_dict=lambda: model_sd, cfg=model.cfg), out)
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(
            {
                "stage": stage,
                "step": step,
                "train_config": tcfg.to_dict(),
                "model": model_sd,
                "optimizer": opt_sd,
                "scheduler": sched.state_dict(),
                "rng": rngs,
                "world_size": dist.world if dist else 1,
                "accum_steps": accum_steps,
                "fsdp": fsdp,
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
    csv_f = open(csv_path, "a", newline="") if main else None
    writer = csv.DictWriter(csv_f, cols, extrasaction="ignore") if main else None
    tb = _tensorboard(out) if main else None
    bar = tqdm(
        range(start, tcfg.steps),
        initial=start,
        total=tcfg.steps,
        desc=stage,
        disable=not (progress and main),
    )
    try:
        for step in bar:
            micro = [batch_fn(step)] if accum_steps == 1 else batch_fn(step)
            opt.zero_grad(set_to_none=True)
            seen = []
            for i, batch in enumerate(micro):
                with D.sync_gradients(wrapped, i == accum_steps - 1):
                    with torch.autocast(
                        torch.device(device).type, dtype=torch.bfloat16, enabled=amp
                    ):
                        loss, stats = wrapped(batch)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"step {step}: loss is {loss.item()}")
                    (loss / accum_steps if accum_steps > 1 else loss).backward()
                seen.append(stats)
            if len(seen) != accum_steps:
                raise ValueError(f"step {step}: {len(seen)} micro-batches, not {accum_steps}")
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            if after_step is not None:
                after_step()
            if digests is not None:
                digests.write(f"{step + 1} {D.param_digest(model)}\n")
                digests.flush()
            done = step + 1
            if done % tcfg.log_every == 0 or done == tcfg.steps or step == start:
                stats = _log_row(D.gather(_log_row(seen), dist))  # collective
                if main:
                    writer.writerow(
                        {
                            "step": done,
                            "lr": f"{lr:.3e}",
                            "elapsed_s": f"{time.perf_counter() - t0:.2f}",
                            **{k: f"{v:.6f}" for k, v in stats.items()},
                        }
                    )
                    csv_f.flush()
                    if tb is not None:
                        for k, v in stats.items():
                            tb.add_scalar(f"{stage}/{k}", v, done)
                        tb.add_scalar(f"{stage}/lr", lr, done)
                    if postfix is not None:
                        bar.set_postfix(**postfix(stats, lr))
            if done % tcfg.save_every == 0 or done == tcfg.steps:
                save(done)
            if periodic is not None and done % periodic[0] == 0:
                if main:
                    periodic[1](done)
                D.barrier(dist)
            if kill_after and done == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        if csv_f is not None:
            csv_f.close()
        if digests is not None:
            digests.close()
        if tb is not None:
            tb.close()
    if start >= tcfg.steps:  # nothing to do: still leave a complete checkpoint behind
        save(start)
    if main:  # scripts/gpu-proof.sh reads this line
        print(f"[train] peak memory: {D.peak_memory(device)}", flush=True)
    D.barrier(dist)
    return model.eval()


def train_only(model: torch.nn.Module, prefixes) -> None:
    """Freeze every parameter of `model` whose name starts with none of `prefixes` (empty: all
    train). A prefix that names no trainable parameter is a mistake, not a frozen model."""
    if not prefixes:
        return
    kept = [
        n for n, p in model.named_parameters() if p.requires_grad and n.startswith(tuple(prefixes))
    ]
    if not kept:
        raise ValueError(f"--train-only {' '.join(prefixes)}: no trainable parameter matches")
    for n, p in model.named_parameters():
        p.requires_grad_(n in kept)
