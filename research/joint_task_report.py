"""The joint-structure task's report: its tables in markdown, its plot, and the JSON of
`research.joint_task.run` beside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _ci(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _g(d: dict) -> str:
    return f"{d['mean']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"


def _d(d: dict) -> str:
    return f"{d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"


def report_markdown(res: dict, command: str, png: str | None) -> str:
    c = res["config"]
    K = c["block_size"]
    lines = [
        "# Controlled joint-structure task",
        "",
        f"gamma = expected tokens per round against the true conditional (exact given the draft), "
        f"{c['n_contexts']} contexts x {c['draws']} draws; 95% intervals from a bootstrap over "
        "contexts, paired against DFlash-style greedy by context.",
        "",
        "| drafter | drafts | gamma | vs DFlash greedy | gamma, q = the drafter's law | "
        "law vs DFlash greedy | in support | Delta perm | Delta per-slot noise | "
        "slots a new draw changes | mode TV |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.get("truth", []):
        lines.append(
            f"| {r['drafter']} | exact | {_g(r['gamma'])} | {_d(r['vs_dflash'])} | "
            f"{K + 1 if 'sample' in r['drafter'] else '-'} | - | 1 | - | - | - | - |"
        )
    for r in res["rows"]:
        law = (
            [_g(r["gamma_law"]), _d(r["law_vs_dflash"])]
            if "gamma_law" in r
            else (["= gamma", "= gamma"] if "greedy" in r["drafts"] else ["-", "-"])
        )
        lines.append(
            f"| {r['drafter']} | {r['drafts']} | {_g(r['gamma'])} | {_d(r['vs_dflash'])} | "
            f"{law[0]} | {law[1]} | {r['in_support']:.3f} | {_ci(r['delta_perm'])} | "
            f"{_ci(r['delta_slot'])} | {r['noise_changes']:.3f} | {r['mode_tv']:.3f} |"
        )
    cov = res.get("coverage", [])
    if cov:
        lines += [
            "",
            "The bootstrap's check: DFlash-style drafts sampled per slot ignore the noise, so their "
            "permutation-shuffle Delta is 0 in truth. Over independent evaluation seeds, the 95% "
            "intervals that contain 0:",
            "",
            "| contexts | draws per context | seeds | intervals containing 0 | mean width |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {v['contexts']} | {c['draws']} | {v['repeats']} | {v['contain_zero']} / {v['repeats']} "
            f"| {v['mean_width']:.3f} |"
            for v in cov
        ]
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
        "alpha_j = min(1, p(d_j | c, d_<j) / q_j(d_j)): q = 1 for greedy drafts (deterministic given the "
        "draw), q = the proposer's softmax of the draw for sampled ones (both exact speculative sampling); "
        "'q = the drafter's law' scores a sampled block with its law over the noise, sum over draws of "
        f"prod_(j<=k) q_j / sum of prod_(j<k) q_j, estimated from {c.get('law_draws', 0)} other draws per "
        "context (what a verifier that knew the law would accept; not a serving option). Delta = gamma(shared) - "
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

    def bars(dx, key, label):
        d = [r.get(key) or dict(mean=np.nan, lo=np.nan, hi=np.nan) for r in rows]
        a.bar(
            x + dx,
            [v["mean"] for v in d],
            0.4,
            yerr=[[v["mean"] - v["lo"] for v in d], [v["hi"] - v["mean"] for v in d]],
            label=label,
        )

    bars(-0.2, "gamma", "gamma (q of the draw)")
    bars(0.2, "gamma_law", "gamma (q = the drafter's law)")
    for r, ls in zip(res.get("truth", []), ("--", ":")):
        a.axhline(r["gamma"]["mean"], color="k", ls=ls, lw=1, label=r["drafter"])
    base = next(r for r in rows if r["drafts"] == "greedy, q = 1")["gamma"]["mean"]
    a.axhline(base, color="tab:red", lw=1, label="DFlash-style greedy")
    a.set_ylabel("gamma")
    a.set_xticks(x)
    a.set_xticklabels(
        [f"{r['drafter']}\n{r.get('drafts', '')}" for r in rows],
        fontsize=5,
        rotation=30,
        ha="right",
    )
    a.legend(fontsize=7)
    a.set_title("acceptance length against the true joint")
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
