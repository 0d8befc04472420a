"""Training of the FlashMap drafter (flow stage, flow-map distillation) and the DFlash-style baseline.

Data: shards from `training.drafter_data` (the target's own responses + target features),
cut into blocks after anchors inside the responses (`training.flow`, which also holds the
three stages' losses).

Stages (DESIGN.md, "The method in one page"):

- flow: the denoiser on the diagonal s = t (`flow.flow_loss`). At every save the flow check
  (`denoiser_curve.flow_check`) logs the denoiser's accuracy against tau and writes
  OUT/flow_summary.json; it warns when the denoiser does not improve with tau (a model that
  ignores its state is no flow).
- distill: the student starts from the trained flow model, which stays frozen as the
  teacher; zero-length jumps match the teacher denoiser, the others the semigroup of an
  EMA of the student (`flow.distill_loss`).
- dflash: the baseline (kind = "dflash": one pass over a masked block), same data, the
  same slot-weighted cross-entropy (`flow.dflash_loss`).

    python -m training.train_drafter --stage flow --target T --data D --out runs/flow
    python -m training.train_drafter --stage distill --teacher runs/flow --target T --data D --out runs/map
    python -m training.train_drafter --stage dflash --target T --data D --out runs/dflash
    (add --small for a CPU-sized run; --resume continues from OUT/train_state.pt)

OUT holds what `training.trainer.run_training` writes: the drafter checkpoint, train_state.pt
(with the EMA when distilling), loss.csv and loss.png.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from drafter_service.checkpoint import init_drafter, load_drafter
from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from training.denoiser_curve import flow_check
from training.drafter_data import read_meta
from training.flow import Batch, dflash_loss, distill_loss, flow_loss, make_batch
from training.trainer import (
    ConfigDict,
    SequenceStream,
    add_common_args,
    check_data,
    config_from_args,
    run_training,
)

STAGES = ("flow", "distill", "dflash")


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


def _step_generator(seed: int, step: int, device) -> torch.Generator:
    s = int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0]) & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(s)


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
    check_data(read_meta(data), model.cfg)
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
            check_data(read_meta(tcfg.check_data), model.cfg)
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


# ----------------------------------------------------------------------------- CLI


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
