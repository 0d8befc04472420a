"""`flashmap eval`'s results: the cell cache (one JSON of the finished measurements, so a run
resumes where the last one stopped, or adds methods to it) and what is made of it, eval.md and
two plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from training.eval_methods import SHUFFLE, Method

REPO = Path(__file__).resolve().parent.parent
CACHE_FORMAT = "flashmap-eval-cells-v1"


# ----------------------------------------------------------------------------- cache


def load_cache(path: Path, settings: dict, fresh: bool) -> dict:
    """The cells measured so far with these settings. A run may add methods (checkpoints the
    cache does not name yet); a method whose checkpoint differs, or any other setting that
    differs, refuses the cache."""
    if path.is_file() and not fresh:
        data = json.loads(path.read_text())
        if data.get("format") != CACHE_FORMAT:
            raise ValueError(f"{path}: not an eval cell cache (use --fresh or another --cache)")
        old = data.get("settings", {})
        diff = sorted(
            k for k in (set(settings) | set(old)) - {"checkpoints"} if settings.get(k) != old.get(k)
        )
        ck, old_ck = settings.get("checkpoints", {}), old.get("checkpoints", {})
        diff += [f"checkpoints.{m}" for m in sorted(set(ck) & set(old_ck)) if ck[m] != old_ck[m]]
        if diff:
            raise ValueError(
                f"{path} holds cells of other settings ({', '.join(diff)}); "
                f"use --fresh to start over or another --cache"
            )
        data["settings"] = {**settings, "checkpoints": {**old_ck, **ck}}
        return data
    return {"format": CACHE_FORMAT, "settings": settings, "cells": {}}


def save_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def cell_key(method: str, domain: str, temperature: float) -> str:
    return f"{method}|{domain}|T={temperature:g}"


# ----------------------------------------------------------------------------- report


def show_path(path) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def _fmt(x, spec=".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def write_report(
    out_dir: Path,
    data: dict,
    methods: list[Method],
    domains: list[str],
    temps: list[float],
    info: dict,
) -> Path:
    cells = data["cells"]
    K = info["block_size"]
    get = lambda m, d, t: cells.get(cell_key(m, d, t))  # noqa: E731
    lines = [
        "# Drafter evaluation",
        "",
        f"Date: {info['date']}. Machine: {info['machine']}.",
        "",
        f"Command: `{info['command']}`",
        "",
        f"Target: `{info['target']}` ({info['target_desc']}); device {info['device']}, fp32, "
        + ("drafters compiled (torch.compile), the target eager, " if info.get("compile") else "")
        + "concurrency 1 "
        f"(one request at a time), max {info['max_new_tokens']} new tokens, stop at the target's EOS ids, "
        f"block K = {K}, proposal support top-{info['top_m']} at T > 0 (a row named -mN: top-N), seed {info['seed']}, "
        f"timings paired: every prompt decoded by the target alone and by every method back to back, "
        f"{info['repeats']} time(s) in rotating order, per prompt the fastest run of each.",
        f"Prompts: `{info['prompts']}`, "
        + ", ".join(f"{d}: {info['counts'][d]}" for d in domains)
        + (
            f" ({info['truncated']} prompts cut to their last tokens to fit the context)"
            if info["truncated"]
            else ""
        )
        + ".",
        "",
    ]
    lines += _runs_lines(data, methods)
    lines += ["Drafters:", ""]
    for ck, desc in info["drafters"].items():
        lines.append(f"- `{ck}`: {desc}")
    lines += [""] + [f"Note: {n}" for n in info["notes"]] + ([""] if info["notes"] else [])
    lines += [
        "At T = 0 every method's output was checked to equal the target's own greedy output, token for "
        "token (the script asserts it). Speedup = tokens/s of the method / tokens/s of the target alone, "
        "measured in the same process on the same prompts; at T = 0 this is the wall-time ratio. "
        "Mean acceptance length gamma = 1 + accepted / drafted rounds (tokens committed per round). "
        "In brackets: 95% intervals over prompts (bootstrap, the prompts resampled; a speedup's "
        "prompts in pairs with the target alone's).",
        "",
    ]

    main_methods = [m for m in methods if m.name not in SHUFFLE]
    for title, field, spec, suffix in (
        ("Mean acceptance length (gamma)", "gamma", ".2f", ""),
        ("Speedup over the target alone", "speedup", ".2f", "x"),
    ):
        ci = f"{field}_ci"
        lines += [f"## {title}", ""]
        head = "| method | " + " | ".join(f"{d} T={t:g}" for t in temps for d in domains) + " |"
        lines += [head, "|---|" + "---:|" * (len(temps) * len(domains))]
        for m in main_methods:
            vals = []
            for t in temps:
                for d in domains:
                    c = get(m.name, d, t)
                    cell = _fmt(c[field] if c else None, spec) + (suffix if c else "")
                    if c and c.get(ci) and np.isfinite(c[ci][0]):
                        cell += f" [{c[ci][0]:{spec}}, {c[ci][1]:{spec}}]"
                    vals.append(cell)
            lines.append(f"| {m.label} | " + " | ".join(vals) + " |")
        if field == "speedup":
            vals = []
            for t in temps:
                for d in domains:
                    c = next((get(m.name, d, t) for m in main_methods if get(m.name, d, t)), None)
                    vals.append(_fmt(c["base_tok_s"] if c else None, ".1f"))
            lines.append("| (target alone, tokens/s) | " + " | ".join(vals) + " |")
        lines.append("")

    pairs = [(i, b) for i, b in SHUFFLE.items() if any(m.name == i for m in methods)]
    if pairs:
        lines += [
            "## Shuffle test",
            "",
            "Delta = gamma with one noise draw shared by the K slots - gamma with an independent draw per "
            "slot, same drafter, prompts and seeds. DFlash ignores the noise: its Delta must be 0 "
            "(checked).",
            "",
            "| drafter | " + " | ".join(f"{d} T={t:g}" for t in temps for d in domains) + " |",
            "|---|" + "---:|" * (len(temps) * len(domains)),
        ]
        for indep, base in pairs:
            vals = []
            for t in temps:
                for d in domains:
                    a, b = get(base, d, t), get(indep, d, t)
                    vals.append(
                        f"{a['gamma'] - b['gamma']:+.3f} ({a['gamma']:.2f} vs {b['gamma']:.2f})"
                        if a and b
                        else "n/a"
                    )
            label = next(m.label for m in methods if m.name == base)
            lines.append(f"| {label} | " + " | ".join(vals) + " |")
        lines.append("")

    lines += [
        "## Conditional acceptance per slot",
        "",
        "P(slot k accepted | slots 1..k-1 accepted, slot k drafted), pooled over the domains; counted from "
        "every drafted round (rounds cut short by the token budget count only for the slots they drafted).",
        "",
    ]
    for t in temps:
        lines += [
            f"T = {t:g}:",
            "",
            "| method | " + " | ".join(str(k) for k in range(1, K + 1)) + " |",
            "|---|" + "---:|" * K,
        ]
        for m in methods:
            p = pooled_conditional(cells, m.name, domains, t, K)
            if p is not None:
                lines.append(f"| {m.label} | " + " | ".join(_fmt(x) for x in p) + " |")
        lines.append("")

    lines += [
        "## Every cell",
        "",
        "| method | domain | T | prompts | tokens | rounds | drafted rounds | accepted | gamma | tok/s | "
        "target tok/s | speedup | draft s | verify s | wall s | run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in methods:
        for t in temps:
            for d in domains:
                c = get(m.name, d, t)
                if c is None:
                    lines.append(f"| {m.name} | {d} | {t:g} | not run | | | | | | | | | | | | |")
                    continue
                lines.append(
                    f"| {m.name} | {d} | {t:g} | {c['n_prompts']} | {c['tokens']} | {c['rounds']} | "
                    f"{c['drafts']} | {c['accepted']} | {_fmt(c['gamma'])} | {c['tok_s']:.1f} | "
                    f"{c['base_tok_s']:.1f} | {_fmt(c['speedup'])}x | {c['draft_s']:.2f} | "
                    f"{c['verify_s']:.2f} | {c['wall_s']:.2f} | {c['run']} |"
                )
    lines += [
        "",
        "Plots: `eval_acceptance.png` (gamma per method and domain), `eval_conditional.png` "
        "(conditional acceptance per slot).",
        "",
        "Trees: N blocks from independent noise (each with its own seed) in one verify pass; "
        '"tree of N" rows are verified by the target picking its own token at each node '
        '(target_service.tree), "multi-draft rejection sampling" rows by rejection sampling '
        "with each block's proposal law (each block a chain of its own).",
        "",
    ]
    path = out_dir / "eval.md"
    path.write_text("\n".join(lines))
    return path


def _runs_lines(data: dict, methods: list[Method]) -> list[str]:
    """Where the cells come from more than one run of the cache: each run's date, machine,
    command and methods (speedups are against the target alone of the method's own run)."""
    names = {m.name for m in methods}
    by_run: dict[str, list[str]] = {}
    for c in data["cells"].values():
        if c["method"] in names and c["method"] not in by_run.setdefault(c["run"], []):
            by_run[c["run"]].append(c["method"])
    if len(by_run) < 2:
        return []
    lines = [
        f"The cells come from {len(by_run)} runs of this cell cache (the `run` column of the last "
        "table); a method's speedup is against the target alone timed in the same run, in pairs "
        "with it:",
        "",
    ]
    for run, ms in sorted(by_run.items()):
        r = data.get("runs", {}).get(run)
        where = f"{r['date']}, {r['machine']}; command `{r['command']}`" if r else "not recorded"
        lines.append(f"- run {run} ({where}): {', '.join(ms)}")
    return lines + [""]


def pooled_conditional(
    cells: dict, method: str, domains: list[str], t: float, K: int
) -> list[float] | None:
    """Per slot 1..K (slots past a drafter's block count 0)."""
    den, num, seen = np.zeros(K), np.zeros(K), False
    for d in domains:
        c = cells.get(cell_key(method, d, t))
        if c is not None:
            seen = True
            n = min(K, len(c["cond_den"]))
            den[:n] += np.asarray(c["cond_den"][:n])
            num[:n] += np.asarray(c["cond_num"][:n])
    if not seen:
        return None
    return [float(n / dd) if dd else float("nan") for n, dd in zip(num, den)]


def _legend_below(fig, ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=min(4, max(len(labels), 1)),
        fontsize=8,
        frameon=False,
    )
    rows = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 1))


def write_plots(
    out_dir: Path, data: dict, methods: list[Method], domains: list[str], temps: list[float], K: int
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = data["cells"]
    main_methods = [m for m in methods if m.name not in SHUFFLE]
    paths = []
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4.6), squeeze=False)
    width = 0.8 / max(len(main_methods), 1)
    for ax, t in zip(axes[0], temps):
        x = np.arange(len(domains))
        for j, m in enumerate(main_methods):
            ys = [cells.get(cell_key(m.name, d, t), {}).get("gamma", np.nan) for d in domains]
            ax.bar(x + (j - (len(main_methods) - 1) / 2) * width, ys, width, label=m.label)
        ax.set_xticks(x, domains)
        ax.set_ylabel("mean acceptance length (tokens / round)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"T = {t:g}")
        ax.grid(axis="y", alpha=0.3)
    _legend_below(fig, axes[0][0])
    p = out_dir / "eval_acceptance.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 5), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for m in methods:
            pc = pooled_conditional(cells, m.name, domains, t, K)
            if pc is not None:
                ax.plot(
                    range(1, K + 1),
                    pc,
                    "o-" if m.shared_noise is not False else "x--",
                    ms=3,
                    label=m.label,
                )
        ax.set_xlabel("slot k")
        ax.set_ylabel("P(slot k accepted | slots < k accepted)")
        ax.set_xticks(range(1, K + 1))
        ax.set_xlim(0.5, K + 0.5)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"T = {t:g}")
        ax.grid(alpha=0.3)
    _legend_below(fig, axes[0][0])
    p = out_dir / "eval_conditional.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
