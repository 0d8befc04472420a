"""The joint-structure task's report: its tables in markdown, its plot, and the JSON of
`training.joint_task.run` beside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _ci(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def report_markdown(res: dict, command: str, png: str | None) -> str:
    c = res["config"]
    lines = [
        "# Controlled joint-structure task",
        "",
        "| drafter | in support | gamma (shared noise) | Delta, permutation shuffle [95% CI] | "
        "Delta, per-slot noise [95% CI] | slots a new draw changes | mode TV |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['drafter']} | {r['in_support']:.3f} | {r['gamma']:.2f} | {_ci(r['delta_perm'])} | "
            f"{_ci(r['delta_slot'])} | {r['noise_changes']:.3f} | {r['mode_tv']:.3f} |"
        )
    lines += [
        "",
        f"Product of the DFlash-style marginals, exact in-support probability of a block sampled slot by "
        f"slot: {res['product_of_marginals']:.3f}.",
        "",
        "Denoiser accuracy per slot against tau of the embedded map (same t for every drafter), beside the "
        "state's vocabulary-space argmax, the Bayes decoder of one slot's embedded state, the DFlash-style "
        "prior and prior + embedded likelihood:",
        "",
    ]
    names = list(res["curves"])
    lines.append(
        "| tau (embedded) | t | tau (vocab) | "
        + " | ".join(names)
        + " | state argmax | embedded Bayes | DFlash prior | prior + embedded likelihood |"
    )
    lines.append("|" + "---:|" * (len(names) + 7))
    ref = res["curves"][names[0]]
    for i, r in enumerate(ref):
        lines.append(
            f"| {r['tau']:.2f} | {r['t']:.4f} | {r['tau_vocab']:.3f} | "
            + " | ".join(f"{res['curves'][n][i]['denoiser']:.3f}" for n in names)
            + f" | {r['state_argmax']:.3f} | {r['state_bayes']:.3f} | {r['prior']:.3f} | "
            f"{r['prior_state_bayes']:.3f} |"
        )
    lines += [
        "",
        "The same teachers against tau of their own time map (where they were trained):",
        "",
        "| tau (own map) | " + " | ".join(f"{n} (t / acc)" for n in res["curves_own_map"]) + " |",
        "|" + "---:|" * (len(res["curves_own_map"]) + 1),
    ]
    own = res["curves_own_map"]
    for i, r in enumerate(next(iter(own.values()))):
        lines.append(
            f"| {r['tau']:.2f} | "
            + " | ".join(f"{own[n][i]['t']:.3f} / {own[n][i]['denoiser']:.3f}" for n in own)
            + " |"
        )
    lines += ["", "```", command, "```", ""]
    if png:
        lines += [f"![joint task]({png})", ""]
    lines += [
        f"Task: {c['n_contexts']} contexts, {c['n_modes']} modes each (equally likely in even contexts, "
        f"4:2:1-like in odd ones), differing jointly in {c['diverge']} of the first {c['diverge_window']} of "
        f"{c['block_size']} slots; V = {c['vocab_size']}, H = {c['hidden_size']}, random frozen E with singular "
        f"values spread {c['spectrum']:.0f}x. Drafter: width {c['dim']}, {c['n_blocks']} DiT blocks; flow stage "
        f"{c['flow_steps']} steps at {c['flow_lr']:g}, distillation {c['distill_steps']} at {c['distill_lr']:g}, "
        f"DFlash-style {c['flow_steps'] + c['distill_steps']} steps from the same initialisation; batch "
        f"{c['batch_size']}; {c['draws']} noise draws per context. gamma = 1 + sum_k prod_(j<=k) alpha_j with "
        "alpha_j = p(d_j | c, d_<j) (exact, greedy drafts) or min(1, p/q) (sampled). Delta = gamma(shared) - "
        "gamma(shuffled): permutation shuffle = slot k from an independent shared-noise run k; per-slot noise "
        "= one pass with an independent draw per slot. Mode TV: total variation between how often each mode is "
        "drafted (in-support blocks) and its probability, mean over contexts.",
        "",
    ]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = res["rows"]
    x = np.arange(len(rows))
    a.bar(x - 0.2, [r["in_support"] for r in rows], 0.4, label="in support")
    d = [r["delta_perm"] for r in rows]
    a.bar(
        x + 0.2,
        [r["mean"] for r in d],
        0.4,
        yerr=[[r["mean"] - r["lo"] for r in d], [r["hi"] - r["mean"] for r in d]],
        label="Delta (permutation shuffle)",
    )
    a.axhline(res["product_of_marginals"], color="k", ls=":", lw=1, label="product of marginals")
    a.set_xticks(x)
    a.set_xticklabels(
        [r["drafter"].replace(", ", "\n", 1) for r in rows], fontsize=6, rotation=30, ha="right"
    )
    a.legend(fontsize=7)
    a.set_title("coherence and joint structure")
    for name, curve in res["curves"].items():
        b.plot([r["t"] for r in curve], [r["denoiser"] for r in curve], "o-", ms=3, label=name)
    ref = next(iter(res["curves"].values()))
    t = [r["t"] for r in ref]
    b.plot(t, [r["state_bayes"] for r in ref], "k--", lw=1, label="embedded Bayes decoder")
    b.plot(t, [r["state_argmax"] for r in ref], "k:", lw=1, label="state argmax (vocab space)")
    b.plot(t, [r["prior"] for r in ref], color="gray", lw=1, label="DFlash-style prior")
    b.set_xlabel("t")
    b.set_ylabel("per-slot accuracy")
    b.set_title("denoiser against flow time")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(res: dict, out: Path, command: str) -> None:
    """OUT (markdown) with OUT.png and OUT.json beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(res, png)
    out.write_text(report_markdown(res, command, png.name))
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
