"""The settings of a FlashMap / DFlash-style drafter's training run (training.train_drafter):
`TrainConfig`, its presets per stage (flow, distill, dflash; `small` for a CPU-sized run), and
the DrafterConfig fields the distillation sets on the map.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from training.train_options import ConfigDict

STAGES = ("flow", "distill", "dflash")
# Distillation from the zero state: DrafterConfig field -> its loss.csv column.
ZERO_STATE = {"null_jump_fraction": "null", "null_two_jump_share": "null2"}
# DrafterConfig fields the distillation sets on the map (the rest is the teacher's).
DISTILL_FIELDS = ("zero_jump_fraction", "full_jump_fraction", *ZERO_STATE, "two_jump_estimate")


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
    amp: bool = True  # bf16 autocast on CUDA (the weights stay fp32)
    accum_steps: int = 1  # micro-batches per optimizer step (each rank's share split again)
    fsdp: bool = False  # several ranks: FSDP2 shards the drafter's training state (else DDP)
    # Held-out acceptance check every accept_every steps (0 = off): gamma at T = 0 of the drafter
    # as it stands, on the first accept_sequences sequences of accept_data (token or drafter data).
    accept_every: int = 0
    accept_data: str = ""
    accept_sequences: int = 16
    accept_max_anchors: int = 8
    # flow: start from a trained DFlash-style drafter of the same backbone (warm_start_from_dflash);
    # dflash: continue one. "" = the DiT init (the paper has no warm start).
    init_from: str = ""
    # flow --init-from a dflash drafter: every (s, t) starts from its conditioning (0, 1)
    # (warm_start_from_dflash constant_time), the denoiser at tau = 0 included.
    warm_constant_time: bool = False
    # Train only the parameters named with these prefixes (empty: all; trainer.train_only). With
    # the state gate and a warm start, ("state_in",) keeps the DFlash-style network at tau = 0.
    train_only: tuple[str, ...] = ()
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
