"""The controlled joint-structure task: does the FlashMap drafter keep joint structure?

A synthetic world where the answer is known exactly. Each of n_contexts contexts (random
feature vectors standing in for target hidden states, plus an anchor token) fixes a small
set of 16-token continuations ("modes"), equally likely in half of the contexts and
unequally in the other half, that share most slots but differ jointly in `diverge` of the
first `diverge_window` slots: the "new york" / "san diego" case, where sampling each slot
from its marginal mostly gives blocks that are no continuation at all ("new diego").
The frozen embedding E [V, H] is random with a spread spectrum like a trained one
(V/H = 16 as in the demo target), so the state is read through the same squeeze.

Everything else is the real pipeline: FlashMapDiT, the losses of training.flow and the
training loop (train_drafter.run_stage, fed Batches built here), drafting by
FlashMapProposer, the shuffle variants (training.shuffle_test) and the denoiser curve
(training.denoiser_curve). The expected accepted length of a drafted block d against the
true conditional is exact: 1 + sum_k prod_{j<=k} alpha_j with alpha_j = p(d_j | c, d_<j)
for greedy drafts (min(1, p/q) for sampled ones). The report: training.joint_task_report.

    python -m training.joint_task --out docs/results/joint_task.md      # the full report (minutes)
    python -m training.joint_task --small --out /tmp/joint.md          # the CI-sized run
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flashmap_proposer import FlashMapProposer
from flashmap.types import ProposeRequest
from training.denoiser_curve import denoiser_curve
from training.flow import Batch
from training.joint_task_report import write_report
from training.shuffle_test import acceptance, draft_variants, paired_bootstrap, proposal_prob
from training.train_drafter import TrainConfig, run_stage

# ----------------------------------------------------------------------------- the task


@dataclass
class JointTaskConfig:
    vocab_size: int = 256
    hidden_size: int = 16  # V/H = 16, the demo target's squeeze
    n_contexts: int = 16
    n_modes: int = 3
    diverge: int = 4  # slots in which the modes differ (jointly)
    diverge_window: int = 8  # ... chosen among the first slots, where acceptance is decided
    block_size: int = 16
    context_len: int = 4
    spectrum: float = 46.0  # largest / smallest singular value of E, about the demo target's
    seed: int = 0
    # drafter and training
    dim: int = 128
    n_blocks: int = 2
    n_heads: int = 4
    batch_size: int = 64
    flow_steps: int = 2000
    flow_lr: float = 1e-3
    distill_steps: int = 1000
    distill_lr: float = 3e-4
    # the recipe's drafter settings (DrafterConfig fields)
    time_map: str = "embedded"
    time_map_candidates: tuple[int, ...] = (0,)
    state_input: str = "whiten"
    shared_noise: bool = False
    pure_noise_fraction: float = 0.0
    # evaluation
    draws: int = 32  # noise draws (requests) per context
    teacher_steps: tuple[int, ...] = (8, 16)
    ablations: tuple[str, ...] = ("vocab-map", "mix-map", "rms-input", "shared-noise", "old-recipe")
    device: str = "cpu"

    @classmethod
    def small(cls) -> JointTaskConfig:
        """CI size: well under a minute on two CPU cores."""
        return cls(
            vocab_size=128,
            hidden_size=16,
            n_contexts=8,
            n_modes=2,
            diverge=4,
            dim=64,
            batch_size=64,
            flow_steps=400,
            flow_lr=2e-3,
            distill_steps=250,
            distill_lr=5e-4,
            draws=24,
            teacher_steps=(16,),
            ablations=(),
        )


# Teachers trained beside the recipe's, each changing it in one or more DrafterConfig fields.
ABLATIONS = {
    "vocab-map": dict(time_map="vocab"),  # tau of the state's argmax in vocabulary space
    # The embedded map, half of it for a two-candidate reader.
    "mix-map": dict(time_map_candidates=[2, 0]),
    "rms-input": dict(state_input="rms"),  # the state rms-normalised, not whitened
    "shared-noise": dict(shared_noise=True),  # one noise draw for all K slots
    "old-recipe": dict(
        time_map="vocab", state_input="rms", shared_noise=True, pure_noise_fraction=0.3
    ),
}


@dataclass
class JointTask:
    cfg: JointTaskConfig
    embed: Tensor  # [V, H] frozen embedding (= LM head)
    features: Tensor  # [C, T, H] context features
    anchors: Tensor  # [C] anchor token ids
    modes: Tensor  # [C, M, K] the continuations
    probs: Tensor  # [C, M] their probabilities


def make_task(cfg: JointTaskConfig) -> JointTask:
    g = torch.Generator().manual_seed(cfg.seed)
    V, H, C, M, K = cfg.vocab_size, cfg.hidden_size, cfg.n_contexts, cfg.n_modes, cfg.block_size
    # E = Z diag(s) Q: random directions, singular values spread log-uniformly (a trained
    # embedding's Gram matrix is far from isotropic).
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=g))
    s = torch.exp(torch.linspace(0, float(np.log(cfg.spectrum)), H))
    embed = (torch.randn(V, H, generator=g) / H**0.5 * s) @ q
    embed = embed / embed.norm(dim=1).mean()  # rows of norm ~1, as the demo target's
    features = torch.randn(C, cfg.context_len, H, generator=g)
    anchors = torch.randint(0, V, (C,), generator=g)
    modes = torch.randint(0, V, (C, 1, K), generator=g).repeat(1, M, 1)
    for c in range(C):
        slots = torch.randperm(cfg.diverge_window, generator=g)[: cfg.diverge]
        for k in slots.tolist():  # M distinct tokens, one per mode
            modes[c, :, k] = torch.randperm(V, generator=g)[:M]
    w = torch.ones(C, M)
    w[1::2] = 2.0 ** -torch.arange(M, dtype=torch.float32)  # odd contexts: 4/7, 2/7, 1/7 for M = 3
    return JointTask(cfg, embed, features, anchors, modes, w / w.sum(1, keepdim=True))


def sample_batch(task: JointTask, n: int, gen: torch.Generator) -> Batch:
    """n training blocks: contexts uniform, each block one mode drawn by its probability."""
    C, T = task.features.shape[:2]
    ctx = torch.randint(0, C, (n,), generator=gen)
    mode = torch.multinomial(task.probs[ctx], 1, generator=gen)[:, 0]
    target = task.modes[ctx, mode]  # [n, K]
    return Batch(
        task.features,
        ctx,
        torch.full((n,), T),
        task.anchors[ctx],
        target,
        torch.ones_like(target, dtype=torch.bool),
    ).to(task.cfg.device)


def drafter_config(task: JointTask, kind: str = "flashmap", **overrides) -> DrafterConfig:
    c = task.cfg
    return DrafterConfig(
        kind=kind,
        dim=c.dim,
        n_blocks=c.n_blocks,
        n_heads=c.n_heads,
        block_size=c.block_size,
        time_freq_dim=32,
        vocab_size=c.vocab_size,
        target_hidden_size=c.hidden_size,
        target_num_layers=1,
        feature_layers=[0],
        target_name="joint-task",
        **{
            **dict(
                time_map=c.time_map,
                time_map_candidates=list(c.time_map_candidates),
                state_input=c.state_input,
                shared_noise=c.shared_noise,
                pure_noise_fraction=c.pure_noise_fraction,
            ),
            **overrides,
        },
    )


def new_drafter(task: JointTask, kind: str = "flashmap", seed: int = 0, **overrides) -> FlashMapDiT:
    torch.manual_seed(seed)
    return FlashMapDiT(drafter_config(task, kind, **overrides), task.embed, task.embed).to(
        task.cfg.device
    )


# ----------------------------------------------------------------------------- exact acceptance


def prefix_probs(task: JointTask, c: int, tokens: np.ndarray) -> np.ndarray:
    """[K+1] P(the continuation starts with tokens[:k]) under context c, k = 0..K."""
    modes, probs = task.modes[c].numpy(), task.probs[c].numpy().astype(np.float64)
    agree = np.cumprod(modes == tokens[None], axis=1)  # [M, K]: mode m matches the first k+1 tokens
    return np.concatenate([[1.0], (probs[:, None] * agree).sum(0)])


def true_alpha(task: JointTask, c: int, draft) -> np.ndarray:
    """Per-slot acceptance probabilities [K] of a draft against the true conditional:
    min(1, p(d_k | c, d_<k) / q_k(d_k)) (q = 1 for greedy drafts)."""
    pre = prefix_probs(task, c, draft.tokens)
    cond = np.divide(pre[1:], pre[:-1], out=np.zeros(len(pre) - 1), where=pre[:-1] > 0)
    return np.minimum(1.0, cond / np.maximum(proposal_prob(draft), 1e-12))


def in_support(task: JointTask, c: int, tokens: np.ndarray) -> bool:
    return bool((task.modes[c].numpy() == tokens[None]).all(1).any())


def which_mode(task: JointTask, c: int, tokens: np.ndarray) -> int:
    hit = np.nonzero((task.modes[c].numpy() == tokens[None]).all(1))[0]
    return int(hit[0]) if len(hit) else -1


# ----------------------------------------------------------------------------- training


def train_config(task: JointTask, stage: str, steps: int, lr: float) -> TrainConfig:
    c = task.cfg
    return TrainConfig(
        stage=stage,
        steps=steps,
        lr=lr,
        warmup_steps=min(50, steps // 10),
        batch_size=c.batch_size,
        ema_decay=0.99,
        seed=c.seed,
        log_every=max(1, steps // 20),
        save_every=steps,
        amp=False,
        check_batches=0,
    )


def train(
    task: JointTask,
    model: FlashMapDiT,
    stage: str,
    steps: int,
    lr: float,
    out: Path,
    teacher: FlashMapDiT | None = None,
    check: bool = True,
) -> FlashMapDiT:
    """One stage of the real trainer (train_drafter.run_stage) on this task's batches."""
    tcfg = train_config(task, stage, steps, lr)

    def batch_fn(step: int) -> Batch:
        return sample_batch(
            task, tcfg.batch_size, torch.Generator().manual_seed(task.cfg.seed * 1_000_003 + step)
        )

    checks = check_batches(task) if check and stage == "flow" else None
    return run_stage(
        model,
        tcfg,
        batch_fn,
        out=out,
        teacher=teacher,
        progress=False,
        check_batches=checks,
        device=task.cfg.device,
    )


def check_batches(task: JointTask, n: int = 4) -> list[Batch]:
    """Fixed held-out draws of blocks for the flow check / denoiser curve."""
    g = torch.Generator().manual_seed(task.cfg.seed + 99)
    return [sample_batch(task, 128, g) for _ in range(n)]


def train_all(task: JointTask, workdir: Path, log=print) -> dict[str, FlashMapDiT]:
    """Teacher (flow stage), flow map (distilled from it), DFlash-style baseline (equal steps,
    same initialisation of every shared module), and with cfg.ablations teachers with the
    old time map / state input."""
    c = task.cfg
    models = {}
    t0 = time.perf_counter()
    models["teacher"] = train(
        task, new_drafter(task), "flow", c.flow_steps, c.flow_lr, workdir / "flow"
    )
    log(f"flow stage: {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    student = copy.deepcopy(models["teacher"]).train().requires_grad_(True)
    frozen = copy.deepcopy(models["teacher"]).eval().requires_grad_(False)
    models["map"] = train(
        task, student, "distill", c.distill_steps, c.distill_lr, workdir / "map", teacher=frozen
    )
    log(f"distillation: {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    models["dflash"] = train(
        task,
        new_drafter(task, "dflash"),
        "dflash",
        c.flow_steps + c.distill_steps,
        c.flow_lr,
        workdir / "dflash",
    )
    log(f"DFlash-style: {time.perf_counter() - t0:.0f} s")
    for name in c.ablations:
        t0 = time.perf_counter()
        m = new_drafter(task, **ABLATIONS[name])
        models[f"teacher, {name}"] = train(task, m, "flow", c.flow_steps, c.flow_lr, workdir / name)
        log(f"teacher, {name}: {time.perf_counter() - t0:.0f} s")
    return models


# ----------------------------------------------------------------------------- evaluation


def proposer_for(task: JointTask, model: FlashMapDiT) -> FlashMapProposer:
    """The serving proposer with every context cached (sequence id "c<i>")."""
    C, T = task.features.shape[:2]
    prop = FlashMapProposer(model, n_slots=C, max_context=T, device=task.cfg.device)
    for i in range(C):
        prop.extend(f"c{i}", np.zeros(T, np.int64), task.features[i].numpy())
    return prop


def requests(
    task: JointTask, temperature: float = 0.0, seed0: int = 0
) -> tuple[list[ProposeRequest], np.ndarray]:
    """cfg.draws requests per context (distinct seeds); returns them and their contexts."""
    C, n = task.features.shape[0], task.cfg.draws
    ctx = np.repeat(np.arange(C), n)
    reqs = [
        ProposeRequest(
            f"c{c}",
            int(task.anchors[c]),
            temperature=temperature,
            top_m=task.cfg.vocab_size,
            seed=seed0 + i,
        )
        for i, c in enumerate(ctx)
    ]
    return reqs, ctx


def evaluate_drafter(
    task: JointTask, model: FlashMapDiT, steps: int, temperature: float = 0.0, chunk: int = 256
) -> dict:
    """Drafting metrics of one drafter / step count against the true conditional: in-support
    rate, expected accepted length (shared noise, permutation shuffle, per-slot noise), the
    two Deltas with 95% intervals clustered by context, the share of slots a second noise
    draw changes, and how often each mode is drafted."""
    prop = proposer_for(task, model)
    reqs, ctx = requests(task, temperature)
    variants = []
    for i in range(0, len(reqs), chunk):
        variants += draft_variants(prop, reqs[i : i + chunk], steps)
    g = {
        k: np.array([acceptance(true_alpha(task, c, getattr(v, k))) for v, c in zip(variants, ctx)])
        for k in ("shared", "perm", "slot_noise")
    }
    support = np.array([in_support(task, c, v.shared.tokens) for v, c in zip(variants, ctx)])
    changed = np.mean([np.mean(v.shared.tokens != v.other.tokens) for v in variants])
    picked = np.array([which_mode(task, c, v.shared.tokens) for v, c in zip(variants, ctx)])
    # total variation between the drafted modes (in-support blocks) and the true probabilities, per context
    tv = []
    for c in range(task.features.shape[0]):
        p = picked[(ctx == c) & (picked >= 0)]
        if len(p):
            freq = np.bincount(p, minlength=task.cfg.n_modes) / len(p)
            tv.append(0.5 * np.abs(freq - task.probs[c].numpy()).sum())
    return dict(
        in_support=float(support.mean()),
        gamma=float(g["shared"].mean()),
        gamma_perm=float(g["perm"].mean()),
        gamma_slot=float(g["slot_noise"].mean()),
        delta_perm=paired_bootstrap(g["shared"], g["perm"], ctx),
        delta_slot=paired_bootstrap(g["shared"], g["slot_noise"], ctx),
        noise_changes=float(changed),
        mode_tv=float(np.mean(tv)) if tv else float("nan"),
    )


@torch.no_grad()
def marginal_product_support(task: JointTask, dflash: FlashMapDiT) -> float:
    """In-support probability of a block sampled slot by slot from the DFlash-style marginals,
    sum_m prod_k q_k(mode_m,k), averaged over contexts (exact)."""
    C, T = task.features.shape[:2]
    b = Batch(
        task.features,
        torch.arange(C),
        torch.full((C,), T),
        task.anchors,
        task.modes[:, 0],
        torch.ones(C, task.cfg.block_size, dtype=torch.bool),
    ).to(task.cfg.device)
    logq = dflash(None, 0.0, 1.0, b.anchor, b.context(dflash)).log_softmax(-1).cpu()  # [C, K, V]
    per_mode = logq.gather(-1, task.modes.transpose(1, 2)).sum(1).exp()  # [C, M]
    return float(per_mode.sum(1).mean())


def run(cfg: JointTaskConfig, workdir: Path | None = None, log=print) -> dict:
    """Train everything and measure; returns the report's numbers."""
    torch.manual_seed(cfg.seed)
    task = make_task(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        models = train_all(task, Path(workdir or tmp), log)
    t0 = time.perf_counter()
    rows = []
    for n in cfg.teacher_steps:
        rows.append(
            dict(
                drafter=f"teacher, {n} Euler steps", **evaluate_drafter(task, models["teacher"], n)
            )
        )
    for n in (1, 2):
        rows.append(
            dict(
                drafter=f"flow map, {n} jump{'s' if n > 1 else ''}",
                **evaluate_drafter(task, models["map"], n),
            )
        )
    rows.append(dict(drafter="DFlash-style, greedy", **evaluate_drafter(task, models["dflash"], 1)))
    rows.append(
        dict(
            drafter="DFlash-style, sampled per slot (T = 1)",
            **evaluate_drafter(task, models["dflash"], 1, temperature=1.0),
        )
    )
    for name in [k for k in models if k.startswith("teacher, ")]:
        rows.append(
            dict(
                drafter=f"{name}, {max(cfg.teacher_steps)} Euler steps",
                **evaluate_drafter(task, models[name], max(cfg.teacher_steps)),
            )
        )
    log(f"drafting metrics: {time.perf_counter() - t0:.0f} s")
    checks = check_batches(task)
    curves = {
        name: denoiser_curve(m, checks, prior=models["dflash"], time_map="embedded")
        for name, m in models.items()
        if m.cfg.kind == "flashmap" and name != "map"
    }
    curves_own = {
        name: denoiser_curve(m, checks)
        for name, m in models.items()
        if m.cfg.kind == "flashmap" and name != "map"
    }
    return dict(
        config=asdict(cfg),
        rows=rows,
        product_of_marginals=marginal_product_support(task, models["dflash"]),
        curves=curves,
        curves_own_map=curves_own,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.joint_task", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", required=True, help="markdown report (a .png and a .json beside it)")
    ap.add_argument("--small", action="store_true", help="the CI-sized task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ablations",
        nargs="*",
        choices=sorted(ABLATIONS),
        help="teachers trained beside the recipe's (default: all; none: no teachers)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--workdir", help="keep the trained drafters here (default: a temporary directory)"
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = JointTaskConfig.small() if args.small else JointTaskConfig()
    cfg = replace(
        cfg,
        seed=args.seed,
        device=args.device,
        ablations=cfg.ablations if args.ablations is None else tuple(args.ablations),
    )
    res = run(cfg, Path(args.workdir) if args.workdir else None)
    out = Path(args.out)
    command = "python -m training.joint_task " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_report(res, out, command)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
