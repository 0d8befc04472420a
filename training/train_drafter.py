"""Training of the FlashMap drafter (flow stage, flow-map distillation) and the DFlash-style baseline.

Data: shards from `training.drafter_data` (the target's own responses + target features),
cut into blocks after anchors inside the responses (`training.flow`, which also holds the
three stages' losses).

Stages:

- flow: the denoiser on the diagonal s = t (`flow.flow_loss`). At every save the flow check
  (`denoiser_curve.flow_check`) logs the denoiser's accuracy against tau and writes
  OUT/flow_summary.json; it warns when the denoiser does not improve with tau (a model that
  ignores its state is no flow). Noise: one draw per slot by default (`--noise slot`,
  DrafterConfig.shared_noise says why); `--noise shared` draws one for the whole block.
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
(with the EMA when distilling), loss.csv and loss.png. A run's settings are a TrainConfig
(training.train_drafter_config).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from drafter_service.checkpoint import init_drafter, load_drafter
from drafter_service.flashmap_dit import FlashMapDiT
from flashmap.prompts import for_choosing
from flashmap.types import ESTIMATES
from training import distributed
from training.acceptance_check import AcceptanceCheck, heldout_from
from training.denoiser_curve import flow_check
from training.distributed import full_tensor
from training.drafter_data import TOKEN_FORMAT, read_meta
from training.flow import Batch, dflash_loss, distill_loss, flow_loss
from training.online_features import OnlineTarget, check_fits, copy_sharing_frozen
from training.sequence_stream import SequenceStream, check_data
from training.step_batches import StepBatches, flow_check_batches, step_generator
from training.train_drafter_config import DISTILL_FIELDS, STAGES, ZERO_STATE, TrainConfig
from training.train_options import add_common_args, config_from_args
from training.trainer import run_training, train_only
from training.warm_start import ARCH_FIELDS, warm_start_from_dflash

# ----------------------------------------------------------------------------- trainer


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
    dist=None,
    periodic=None,
    replica_digests: bool = False,
) -> FlashMapDiT:
    """Train `model` for one stage (tcfg.stage) on batch_fn(step) -> Batch (or a StepBatches,
    which gives each step's parts with their noise generators); distill: `teacher`
    is the frozen flow model (model starts as its copy). Flow stage with check_batches: at
    every save the denoiser's accuracy against tau on those blocks is logged and written to
    OUT/flow_summary.json, with a warning when it does not improve with tau (`flow_check`).
    dist / periodic / replica_digests: training.trainer.run_training's (several ranks, the
    held-out acceptance check, the replicas' digests)."""
    model.embed.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    train_only(model, tcfg.train_only)
    ema = None
    if tcfg.stage == "distill":
        ema = (
            copy_sharing_frozen(model).requires_grad_(False).eval() if tcfg.ema_decay > 0 else model
        )

    distill = tcfg.stage == "distill"
    cols = (
        ["step", "lr", "loss"]
        + (["zero", "semigroup"] if distill else [])
        + [c for f, c in ZERO_STATE.items() if distill and tcfg.arch.get(f)]
        + ["elapsed_s"]
    )

    def batch_gen(step: int) -> tuple[Batch, torch.Generator]:
        return batch_fn(step), step_generator(tcfg.seed, step, device)

    parts = isinstance(batch_fn, StepBatches)

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
                pe.lerp_(full_tensor(pm), 1 - tcfg.ema_decay)

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
        batch_fn=batch_fn if parts else batch_gen,
        loss_fn=loss_fn,
        extra_modules={"ema": own_ema, **({"data": batch_fn.data} if parts else {})},
        after_step=ema_update if own_ema is not None else None,
        on_save=on_save,
        postfix=lambda stats, lr: dict(loss=f"{stats['loss']:.4f}", lr=f"{lr:.2e}"),
        dist=dist,
        accum_steps=batch_fn.accum if parts else 1,
        fsdp=tcfg.fsdp,
        periodic=periodic,
        replica_digests=replica_digests,
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
    dist=None,
    replica_digests: bool = False,
) -> FlashMapDiT:
    """Run one stage; returns the trained model (also saved in out). Token data (training.
    generate_data): the target runs in the step and gives each batch's features online, the
    drafter's frozen embedding / LM head are its tensors. dist: this rank of a torchrun run
    (training.distributed.init): its share of every step on its device, gradients averaged."""
    if tcfg.stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {tcfg.stage!r}")
    device = str(dist.device) if dist is not None else device
    torch.manual_seed(tcfg.seed)
    meta = read_meta(data, tokens_ok=True)
    token_data = meta["format"] == TOKEN_FORMAT

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
        model = copy_sharing_frozen(teacher_model).requires_grad_(True).train()
        model.cfg = replace(  # the distillation's own settings, recorded in the map's config
            teacher_model.cfg, **{k: v for k, v in tcfg.arch.items() if k in DISTILL_FIELDS}
        ).validate()
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
                src,
                constant_time=tcfg.warm_constant_time,
                **{k: v for k, v in tcfg.arch.items() if k not in ARCH_FIELDS},
            ).train()
    else:
        kind = "dflash" if tcfg.stage == "dflash" else "flashmap"
        model = init_drafter(target, seed=tcfg.seed, device=device, kind=kind, **tcfg.arch).train()
    # Refused here, before the target is loaded and before any step.
    check_fits(model.cfg, target, max_len=tcfg.max_len, meta=meta)
    if not token_data:
        check_data(meta, model.cfg)
    stream = SequenceStream(data, seed=tcfg.seed, max_len=tcfg.max_len)
    K = model.cfg.block_size
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    batches = StepBatches(
        stream, tcfg, K, device=device, rank=rank, world=world, accum=tcfg.accum_steps
    )
    online = None
    if token_data or tcfg.accept_every:
        online = OnlineTarget(target, n_slots=batches.per_part, max_len=tcfg.max_len, device=device)
        if token_data:
            batches.online = online
        online.host(
            [m for m in (model, teacher_model) if m is not None],
            amp=tcfg.amp,
            shards=world if tcfg.fsdp else 1,
        )

    check_batches = prior = None
    sharded = tcfg.fsdp and world > 1
    if sharded and rank == 0 and (tcfg.check_batches or tcfg.accept_every):
        print(
            "note: under --fsdp no rank holds the whole drafter: the flow check and the "
            "acceptance check are off (run training.flow_diagnostics on a saved checkpoint)"
        )
    if tcfg.stage == "flow" and tcfg.check_batches > 0 and not sharded:
        if tcfg.check_data:
            cmeta = read_meta(tcfg.check_data, tokens_ok=True)
            for_choosing(cmeta.get("split", ""), "the flow check (--check-data)")
            check_fits(model.cfg, target, max_len=tcfg.max_len, meta=cmeta)
            if cmeta["format"] != TOKEN_FORMAT:
                check_data(cmeta, model.cfg)
        if rank == 0:
            check_batches = flow_check_batches(tcfg.check_data or data, tcfg, K, device, online)
        if tcfg.check_prior:
            prior = load_drafter(tcfg.check_prior, target, device=device).eval()
    periodic = None
    if tcfg.accept_every and not sharded:  # rank 0 checks, the others wait
        check = None
        if rank == 0:
            seqs = heldout_from(tcfg.accept_data or data, online, tcfg.accept_sequences, K)
            check = AcceptanceCheck(model, online, seqs, out, max_anchors=tcfg.accept_max_anchors)
        periodic = (tcfg.accept_every, check)
    return run_stage(
        model,
        tcfg,
        batches,
        out=out,
        teacher=teacher_model,
        resume=resume,
        device=device,
        progress=progress,
        check_batches=check_batches,
        check_prior=prior,
        dist=dist,
        periodic=periodic,
        replica_digests=replica_digests,
    )


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
    ap.add_argument("--full-jump-fraction", type=float, help="distill: share of full 0 -> 1 jumps")
    for name in ZERO_STATE:
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, help="distill: DrafterConfig")
    ap.add_argument(
        "--two-jump-estimate",
        choices=ESTIMATES,
        help="distill: what the two-jump blocks carry to t_1 (DrafterConfig)",
    )
    ap.add_argument("--state-gate-tau", type=float, help="flow: state input x min(1, tau_t / it)")
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
        "--accum-steps", type=int, help="micro-batches per optimizer step (gradient accumulation)"
    )
    ap.add_argument(
        "--fsdp",
        action="store_true",
        default=None,
        help="several ranks: shard the drafter's training state with FSDP2 (default DDP)",
    )
    ap.add_argument(
        "--accept-every", type=int, help="held-out acceptance check every N steps (0 = off)"
    )
    ap.add_argument("--accept-data", help="held-out token or drafter data for the acceptance check")
    ap.add_argument(
        "--replica-digests",
        action="store_true",
        help="every rank logs its parameters' sha256 after each step to OUT/replicas/ (tests)",
    )
    ap.add_argument(
        "--warm-constant-time", action="store_true", default=None, help="flow: see TrainConfig"
    )
    ap.add_argument("--train-only", nargs="+", help="parameter name prefixes: see TrainConfig")
    ap.add_argument(
        "--init-from",
        help="flow: start from a DFlash-style drafter (warm start, not the paper's) or train "
        "a flow-stage drafter on; dflash: train a DFlash-style drafter on",
    )
    args = ap.parse_args(argv)

    args.shared_noise = None if args.noise is None else args.noise == "shared"
    cfg = config_from_args(
        TrainConfig.for_stage(args.stage, small=args.small),
        args,
        (
            "anchors_per_seq",
            "ema_decay",
            "init_from",
            "warm_constant_time",
            "train_only",
            "check_data",
            "check_prior",
            "check_batches",
            "accum_steps",
            "fsdp",
            "accept_every",
            "accept_data",
        ),
        (
            "dim",
            "n_blocks",
            "n_heads",
            "block_size",
            "pure_noise_fraction",
            "state_gate_tau",
            "full_jump_fraction",
            *ZERO_STATE,
            "two_jump_estimate",
            "time_map",
            "state_input",
            "shared_noise",
            "time_map_candidates",
        ),
    )
    d = distributed.init(args.device)  # torchrun: this rank (a single process: rank 0 of 1)
    finished = False
    try:
        train(
            cfg,
            target=args.target,
            data=args.data,
            out=args.out,
            teacher=args.teacher,
            resume=args.resume,
            progress=not args.no_progress,
            dist=d,
            replica_digests=args.replica_digests,
        )
        finished = True
    except (OSError, ValueError) as e:
        print(f"error{f' (rank {d.rank})' if d.enabled else ''}: {e}", file=sys.stderr)
        return 2
    finally:
        distributed.shutdown(d, finished)
    if d.main:
        print(f"drafter checkpoint in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
