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
for greedy drafts (min(1, p/q) for sampled ones). The report: research.joint_task_report.

    python -m research.joint_task --out docs/results/joint_task.md      # the full report (minutes)
    python -m research.joint_task --small --out /tmp/joint.md          # the CI-sized run
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flashmap_proposer import FlashMapProposer
from flashmap.drafts import ProposeRequest
from research.joint_task_report import write_report
from research.joint_world import (
    ABLATIONS,
    JointTask,
    JointTaskConfig,
    in_support,
    make_task,
    new_drafter,
    prefix_probs,
    sample_batch,
    true_alpha,
    which_mode,
)
from training.denoiser_curve import denoiser_curve
from training.flow import Batch
from training.shuffle_test import acceptance, draft_variants, paired_bootstrap
from training.train_drafter import run_stage
from training.train_drafter_config import TrainConfig

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
    task: JointTask, temperature: float = 0.0, seed0: int = 0, n: int | None = None, contexts=None
) -> tuple[list[ProposeRequest], np.ndarray]:
    """n (default cfg.draws) requests per context (distinct seeds), over `contexts` (default
    all); returns them and their contexts. Sampling rows draw from the whole vocabulary."""
    C = task.features.shape[0]
    n = task.cfg.draws if n is None else n
    ctx = np.repeat(np.arange(C) if contexts is None else np.asarray(contexts), n)
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


def per_context(values: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """Mean of values per context, in context order [C]."""
    ids, inv = np.unique(ctx, return_inverse=True)
    return np.bincount(inv, weights=values) / np.bincount(inv)


def law_alpha(task: JointTask, c: int, tokens: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """Per-slot acceptance [K] of a block drafted by a sampling drafter scored with its law over
    the noise: q(d_k | d_<k) = sum_m prod_{j<=k} Q_m,j(d_j) / sum_m prod_{j<k} Q_m,j(d_j), with
    Q [M, K, V] the per-slot softmaxes of M independent noise draws (an unbiased estimate of
    the prefix masses; the mixture over the noise is the block's law)."""
    K = len(tokens)
    P = Q[:, np.arange(K), tokens]  # [M, K]
    pre = np.concatenate([[1.0], np.cumprod(P, axis=1).mean(0)])
    q = np.divide(pre[1:], pre[:-1], out=np.zeros(K), where=pre[:-1] > 0)
    tp = prefix_probs(task, c, tokens)
    p = np.divide(tp[1:], tp[:-1], out=np.zeros(K), where=tp[:-1] > 0)
    return np.minimum(1.0, np.divide(p, q, out=np.ones(K), where=q > 0))


def law_tables(
    task: JointTask, prop: FlashMapProposer, steps: int, n: int, seed0: int, chunk: int = 256
) -> dict[int, np.ndarray]:
    """Per context [M = n, K, V]: the last evaluation's softmax (the sampling proposer's q given
    the noise) of n independent noise draws."""
    reqs, ctx = requests(task, 1.0, seed0, n=n)
    V, K = task.cfg.vocab_size, task.cfg.block_size
    out = {c: np.zeros((n, K, V), np.float32) for c in range(task.features.shape[0])}
    fill = dict.fromkeys(out, 0)
    for i in range(0, len(reqs), chunk):
        for d, c in zip(prop.propose(reqs[i : i + chunk], steps), ctx[i : i + chunk]):
            np.put_along_axis(out[c][fill[c]], d.support_ids, d.support_probs, axis=1)
            fill[c] += 1
    return out


def evaluate_drafter(
    task: JointTask,
    model: FlashMapDiT,
    steps: int,
    temperature: float = 0.0,
    chunk: int = 256,
    law_draws: int = 0,
    seed0: int = 0,
    contexts=None,
) -> dict:
    """Drafting metrics of one drafter / step count against the true conditional: in-support
    rate, expected accepted length gamma (shared noise, permutation shuffle, per-slot noise;
    greedy drafts scored with q = 1, sampled ones with the q the proposer reports), the two
    Deltas with 95% intervals clustered by context, the share of slots a second noise draw
    changes, and how often each mode is drafted. law_draws (sampled drafts): gamma also with
    q = the drafter's law over its noise, estimated from that many other draws per context
    (`law_alpha`). Per-context gammas (`*_ctx`) for paired comparisons."""
    prop = proposer_for(task, model)
    reqs, ctx = requests(task, temperature, seed0, contexts=contexts)
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
    for c in np.unique(ctx):
        p = picked[(ctx == c) & (picked >= 0)]
        if len(p):
            freq = np.bincount(p, minlength=task.cfg.n_modes) / len(p)
            tv.append(0.5 * np.abs(freq - task.probs[c].numpy()).sum())
    out = dict(
        steps=steps,
        temperature=temperature,
        in_support=float(support.mean()),
        gamma=paired_bootstrap(g["shared"], clusters=ctx),
        gamma_ctx=per_context(g["shared"], ctx).tolist(),
        gamma_perm=float(g["perm"].mean()),
        gamma_slot=float(g["slot_noise"].mean()),
        delta_perm=paired_bootstrap(g["shared"], g["perm"], ctx),
        delta_slot=paired_bootstrap(g["shared"], g["slot_noise"], ctx),
        noise_changes=float(changed),
        mode_tv=float(np.mean(tv)) if tv else float("nan"),
    )
    if law_draws and temperature > 0:
        Q = law_tables(task, prop, steps, law_draws, seed0 + 10_000_019, chunk)
        gl = np.array(
            [acceptance(law_alpha(task, c, v.shared.tokens, Q[c])) for v, c in zip(variants, ctx)]
        )
        out["gamma_law"] = paired_bootstrap(gl, clusters=ctx)
        out["gamma_law_ctx"] = per_context(gl, ctx).tolist()
    return out


def truth_rows(task: JointTask) -> dict[str, np.ndarray]:
    """Per context [C], exact: gamma of a block sampled from the true joint and drafted as a
    deterministic proposal (q = 1: what a perfect flow drafts from one noise draw at T = 0),
    and of the true joint's most likely block (a perfect mode-seeking drafter). A sample
    scored with its own law (q = p) is accepted whole: K + 1."""
    from flashmap.drafts import Draft

    C, M, K = task.modes.shape
    sample, mode = np.zeros(C), np.zeros(C)
    for c in range(C):
        p = task.probs[c].numpy().astype(np.float64)
        g = [
            acceptance(true_alpha(task, c, Draft.greedy(task.modes[c, m].numpy())))
            for m in range(M)
        ]
        sample[c] = float(np.dot(p, g))
        mode[c] = g[int(np.argmax(p))]
    return {"true joint, one sample (q = 1)": sample, "true joint, its most likely block": mode}


def bootstrap_coverage(
    task: JointTask, dflash: FlashMapDiT, repeats: int, contexts=None, seed0: int = 7_000_003
) -> dict:
    """The bootstrap's check: DFlash-style drafts sampled per slot ignore the noise, so their
    permutation-shuffle Delta is 0 in truth; over `repeats` evaluation seeds, how many 95%
    intervals contain 0 (about 95% if the intervals are right)."""
    iv = [
        evaluate_drafter(task, dflash, 1, 1.0, seed0=seed0 + 1_000_003 * r, contexts=contexts)[
            "delta_perm"
        ]
        for r in range(repeats)
    ]
    return dict(
        contexts=task.features.shape[0] if contexts is None else len(contexts),
        repeats=repeats,
        contain_zero=int(sum(d["lo"] <= 0 <= d["hi"] for d in iv)),
        mean_width=float(np.mean([d["hi"] - d["lo"] for d in iv])),
        intervals=iv,
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
    saved = Path(workdir) / "models.pt" if workdir else None
    if saved is not None and saved.exists():  # the drafters of an earlier run of this config
        blob = torch.load(saved, weights_only=False)
        if blob["config"] != asdict(cfg):
            raise ValueError(f"{saved} was trained with another config; use another --workdir")
        models = blob["models"]
        log(f"drafters from {saved}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            models = train_all(task, Path(workdir or tmp), log)
        if saved is not None:
            torch.save(dict(config=asdict(cfg), models=models), saved)
    t0 = time.perf_counter()
    rows = []

    def add(drafter: str, drafts: str, r: dict) -> None:
        rows.append(dict(drafter=drafter, drafts=drafts, **r))

    flows = [(f"teacher, {n} Euler steps", models["teacher"], n) for n in cfg.teacher_steps]
    flows += [("flow map, 2 jumps", models["map"], 2), ("flow map, 1 jump", models["map"], 1)]
    for name, m, n in flows:
        add(name, "greedy readout, q = 1", evaluate_drafter(task, m, n))
        add(
            name,
            "sampled readout, q of the draw",
            evaluate_drafter(task, m, n, 1.0, law_draws=cfg.law_draws),
        )
    add("DFlash-style", "greedy, q = 1", evaluate_drafter(task, models["dflash"], 1))
    add(
        "DFlash-style",
        "sampled per slot, q of the draw",
        evaluate_drafter(task, models["dflash"], 1, 1.0, law_draws=cfg.law_draws),
    )
    for name in [k for k in models if k.startswith("teacher, ")]:
        n = max(cfg.teacher_steps)
        add(
            f"{name}, {n} Euler steps",
            "greedy readout, q = 1",
            evaluate_drafter(task, models[name], n),
        )
    log(f"drafting metrics: {time.perf_counter() - t0:.0f} s")
    base = np.array(rows[[r["drafts"] for r in rows].index("greedy, q = 1")]["gamma_ctx"])
    for r in rows:
        r["vs_dflash"] = paired_bootstrap(np.array(r.pop("gamma_ctx")), base)
        if "gamma_law_ctx" in r:
            r["law_vs_dflash"] = paired_bootstrap(np.array(r.pop("gamma_law_ctx")), base)
    truth = [
        dict(drafter=k, gamma=paired_bootstrap(v), vs_dflash=paired_bootstrap(v, base))
        for k, v in truth_rows(task).items()
    ]
    t0 = time.perf_counter()
    coverage = [bootstrap_coverage(task, models["dflash"], cfg.coverage_repeats)] + [
        bootstrap_coverage(task, models["dflash"], cfg.coverage_repeats, contexts=range(n))
        for n in cfg.coverage_contexts
    ]
    log(f"coverage check: {time.perf_counter() - t0:.0f} s")
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
        truth=truth,
        coverage=coverage,
        product_of_marginals=marginal_product_support(task, models["dflash"]),
        curves=curves,
        curves_own_map=curves_own,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m research.joint_task", description=__doc__.split("\n\n")[0]
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
        "--workdir",
        help="keep the trained drafters here (default: a temporary directory); a later run with "
        "the same config and workdir measures them again without training",
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
    command = "python -m research.joint_task " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_report(res, out, command)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
