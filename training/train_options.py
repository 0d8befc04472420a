"""A drafter training run's options: the JSON form of its config (ConfigDict) and the
command-line options every drafter training CLI shares (train_drafter, train_eagle,
train_published), given on the command line over the config's fields.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, fields, replace

import torch


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
    """The options of every drafter training CLI (train_drafter, train_eagle); each adds its own
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


def run_cli(train, cfg, args: argparse.Namespace, done: str) -> int:
    """A single-process training CLI's end: train(cfg, ...) with the common options, a clear
    error (exit 2) for a bad path or config, `done` printed after."""
    try:
        train(
            cfg,
            target=args.target,
            data=args.data,
            out=args.out,
            resume=args.resume,
            device=args.device,
            progress=not args.no_progress,
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(done)
    return 0


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
