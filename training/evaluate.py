"""`flashmap eval`: acceptance length and speedup of the drafters on the held-out prompts.

For a target and drafter checkpoints (FlashMap flow map, its flow-stage teacher,
DFlash-style, EAGLE-style), per domain of the held-out prompts (code, math, chat) and
per temperature (0 and 1), every prompt is decoded at concurrency 1 with
`flashmap.inprocess.decode`, once by the target alone (proposer=None) and once per
method, in the same process:

    flashmap-1      FlashMap, one flow-map jump 0 -> 1
    flashmap-2      FlashMap, two jumps
    flow-N          the teacher flow, N Euler steps of the ODE (--teacher, else the
                    distilled model's diagonal)
    dflash          the DFlash-style baseline (one pass over a masked block)
    eagle           the EAGLE-3-style autoregressive chain (drafter_service.eagle)
    flashmap-1-tree FlashMap 1 step, --tree-blocks blocks from independent noise verified
                    as a tree (T = 0)
    *-cut           FlashMap 1 step / DFlash-style with greedy drafts cut before the first
                    slot below --min-confidence (T = 0)
    *-indep         shuffle test: the same drafter with an independent noise draw per
                    slot (shared_noise=False); Delta = gamma_shared - gamma_independent
                    is the acceptance that comes from the joint structure of one draw.
                    DFlash ignores the noise, so its Delta must be exactly 0 (checked).

Per cell: mean acceptance length gamma (tokens committed per drafted round), speedup =
tokens/s of the method / tokens/s of the target alone measured in the same process for
the same prompts (at T = 0 both write the same tokens, so it is the wall-time ratio),
and the conditional acceptance per slot P(slot k accepted | slots < k accepted, slot k
drafted), counted from every round. At T = 0 every method's output must equal the
target's (asserted).

Timing is paired (`flashmap.measure.run_paired`): each prompt is decoded by the target alone and by every
method back to back, --repeats times in rotating order, and per prompt the fastest run of
each counts, so a slow stretch of a shared machine hits a method and its baseline alike.
Resumable: the cells of each finished (domain, temperature) are written to a JSON cache
(--cache) and skipped by the next run with the same settings; a (domain, temperature) with
missing cells re-measures the target alone, so a speedup always compares runs of one
process. Writes
docs/results/eval.md (command, date, machine, every cell) and two PNG plots.

    python -m training.evaluate --target checkpoints/demo-target --flashmap runs/map \
        --teacher runs/flow --dflash runs/dflash --eagle runs/eagle --max-prompts 8 --max-new-tokens 128

--compile runs every drafter through torch.compile (FlashMapProposer / EagleProposer
.enable_compile, the CPU counterpart of the drafter's CUDA graphs); the target runs eagerly,
alone and when verifying alike. Not done: EAGLE's tree of 16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmap.checkpoint import read_config
from flashmap.measure import machine, run_paired, run_prompts
from flashmap.prompts import HELDOUT_PROMPTS, read_domain_prompts

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "results"
DOMAIN_ORDER = ("code", "math", "chat")
CACHE_FORMAT = "flashmap-eval-cells-v1"

# (method, base method of the shuffle pair)
SHUFFLE = {
    "flashmap-1-indep": "flashmap-1",
    "flashmap-2-indep": "flashmap-2",
    "dflash-indep": "dflash",
}


@dataclass
class Method:
    name: str
    label: str
    checkpoint: str
    kind: str  # flashmap | dflash | eagle
    steps: int = 1
    shared_noise: bool | None = (
        None  # None: the noise the drafter was trained on (its config); False: a draw per slot
    )
    tree_blocks: int = (
        1  # > 1: that many blocks from independent noise verified as a tree (T = 0 only)
    )
    min_confidence: float = (
        0.0  # > 0: greedy drafts cut before the first less sure slot (T = 0 only)
    )

    def runs_at(self, temperature: float) -> bool:
        return (self.tree_blocks == 1 and self.min_confidence == 0) or temperature == 0


# ----------------------------------------------------------------------------- inputs


def build_methods(args) -> tuple[list[Method], list[str]]:
    from drafter_service.checkpoint import checkpoint_kind

    methods, notes = [], []

    def kind_of(path: str, want: str, flag: str) -> str:
        k = checkpoint_kind(path)
        if k != want:
            raise ValueError(f"{flag} {path}: a {k!r} drafter, expected {want!r}")
        return k

    if args.flashmap:
        kind_of(args.flashmap, "flashmap", "--flashmap")
        methods += [
            Method("flashmap-1", "FlashMap, 1 step", args.flashmap, "flashmap", 1),
            Method("flashmap-2", "FlashMap, 2 steps", args.flashmap, "flashmap", 2),
        ]
        if args.tree_blocks > 1:
            methods.append(
                Method(
                    "flashmap-1-tree",
                    f"FlashMap, 1 step, tree of {args.tree_blocks} blocks (T = 0)",
                    args.flashmap,
                    "flashmap",
                    1,
                    tree_blocks=args.tree_blocks,
                )
            )
    if args.teacher or args.flashmap:
        src = args.teacher or args.flashmap
        kind_of(src, "flashmap", "--teacher" if args.teacher else "--flashmap")
        if not args.teacher:
            notes.append(
                "no --teacher: the teacher-flow rows integrate the distilled model's diagonal (s = t)"
            )
        methods.append(
            Method(
                f"flow-{args.teacher_steps}",
                f"teacher flow, {args.teacher_steps} Euler steps",
                src,
                "flashmap",
                args.teacher_steps,
            )
        )
    else:
        notes.append("no --flashmap / --teacher checkpoint: FlashMap rows skipped")
    if args.dflash:
        kind_of(args.dflash, "dflash", "--dflash")
        methods.append(Method("dflash", "DFlash-style", args.dflash, "dflash", 1))
    else:
        notes.append("no --dflash checkpoint: DFlash rows skipped")
    if (
        args.min_confidence > 0
    ):  # the draft cut of FlashMapProposer(min_confidence=...), greedy rows only
        for base in [m for m in methods if m.name in ("flashmap-1", "dflash")]:
            methods.append(
                Method(
                    f"{base.name}-cut",
                    f"{base.label}, drafts cut below {args.min_confidence:g} (T = 0)",
                    base.checkpoint,
                    base.kind,
                    base.steps,
                    min_confidence=args.min_confidence,
                )
            )
    if args.dflash_start:
        kind_of(args.dflash_start, "dflash", "--dflash-start")
        methods.append(
            Method(
                "dflash-start",
                "DFlash-style, FlashMap's warm start",
                args.dflash_start,
                "dflash",
                1,
            )
        )
    if args.eagle:
        kind_of(args.eagle, "eagle", "--eagle")
        methods.append(Method("eagle", "EAGLE-style chain", args.eagle, "eagle", 1))
    else:
        notes.append("no --eagle checkpoint: EAGLE rows skipped")
    if not args.no_shuffle:
        by_name = {m.name: m for m in methods}
        for indep, base in SHUFFLE.items():
            if base in by_name:
                b = by_name[base]
                if b.kind == "flashmap" and not _trained_shared(b.checkpoint):
                    # Its own draws are per slot already: the pair would be the same run twice.
                    notes.append(
                        f"{b.label}: no per-slot shuffle row, its noise is a draw per slot already "
                        "(config shared_noise = false); its joint structure is the permutation-shuffle "
                        "Delta of `python -m training.flow_diagnostics` (K shared-noise runs, slot k "
                        "from run k)"
                    )
                    continue
                methods.append(
                    Method(
                        indep,
                        f"{b.label}, independent noise per slot",
                        b.checkpoint,
                        b.kind,
                        b.steps,
                        shared_noise=False,
                    )
                )
    if not methods:
        raise ValueError(
            "give at least one drafter checkpoint (--flashmap, --teacher, --dflash, --eagle)"
        )
    return methods, notes


def _trained_shared(checkpoint: str) -> bool:
    """Whether a FlashMap checkpoint was trained (and drafts) with one noise draw shared by its K slots."""
    return bool(read_config(checkpoint).get("shared_noise", False))


# ----------------------------------------------------------------------------- measuring


def make_proposer(m: Method, target: str, engine, device: str, cache: dict, compile: bool = False):
    """A fresh proposer for the method (the loaded model is shared between methods, and so are
    its compilations: SlotCacheProposer.enable_compile)."""
    from drafter_service import factory

    if m.checkpoint not in cache:
        cache[m.checkpoint] = factory.load_model(m.checkpoint, target, device=device)
    return factory.make_proposer(
        cache[m.checkpoint],
        device=device,
        n_slots=1,
        max_context=engine.max_seq_len,
        steps=m.steps,
        min_confidence=m.min_confidence,
        shared_noise=m.shared_noise,
        compile=compile,
    )


def params_of(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- cache


def load_cache(path: Path, settings: dict, fresh: bool) -> dict:
    if path.is_file() and not fresh:
        data = json.loads(path.read_text())
        if data.get("format") != CACHE_FORMAT:
            raise ValueError(f"{path}: not an eval cell cache (use --fresh or another --cache)")
        if data.get("settings") != settings:
            diff = sorted(
                k
                for k in set(settings) | set(data.get("settings", {}))
                if settings.get(k) != data.get("settings", {}).get(k)
            )
            raise ValueError(
                f"{path} holds cells of other settings ({', '.join(diff)}); "
                f"use --fresh to start over or another --cache"
            )
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


def _show(path) -> str:
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
        f"block K = {K}, proposal support top-{info['top_m']} at T > 0, seed {info['seed']}, "
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
    lines += ["Drafters:", ""]
    for ck, desc in info["drafters"].items():
        lines.append(f"- `{ck}`: {desc}")
    lines += [""] + [f"Note: {n}" for n in info["notes"]] + ([""] if info["notes"] else [])
    lines += [
        "At T = 0 every method's output was checked to equal the target's own greedy output, token for "
        "token (the script asserts it). Speedup = tokens/s of the method / tokens/s of the target alone, "
        "measured in the same process on the same prompts; at T = 0 this is the wall-time ratio. "
        "Mean acceptance length gamma = 1 + accepted / drafted rounds (tokens committed per round).",
        "",
    ]

    main_methods = [m for m in methods if m.name not in SHUFFLE]
    for title, field, spec, suffix in (
        ("Mean acceptance length (gamma)", "gamma", ".2f", ""),
        ("Speedup over the target alone", "speedup", ".2f", "x"),
    ):
        lines += [f"## {title}", ""]
        head = "| method | " + " | ".join(f"{d} T={t:g}" for t in temps for d in domains) + " |"
        lines += [head, "|---|" + "---:|" * (len(temps) * len(domains))]
        for m in main_methods:
            vals = []
            for t in temps:
                for d in domains:
                    c = get(m.name, d, t)
                    vals.append(_fmt(c[field] if c else None, spec) + (suffix if c else ""))
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
        "Not measured: EAGLE-3's draft tree of 16 (the EAGLE row is a single chain of K tokens); the "
        "FlashMap tree row is greedy-only (T = 0): exact multi-draft sampling at T > 0 is not implemented.",
        "",
    ]
    path = out_dir / "eval.md"
    path.write_text("\n".join(lines))
    return path


def pooled_conditional(
    cells: dict, method: str, domains: list[str], t: float, K: int
) -> list[float] | None:
    den, num, seen = np.zeros(K), np.zeros(K), False
    for d in domains:
        c = cells.get(cell_key(method, d, t))
        if c is not None:
            seen = True
            den += np.asarray(c["cond_den"][:K])
            num += np.asarray(c["cond_num"][:K])
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


# ----------------------------------------------------------------------------- main


def evaluate(args, command: str) -> Path:
    from tqdm import tqdm

    from drafter_service.checkpoint import checkpoint_kind
    from target_service.engine import TargetEngine

    methods, notes = build_methods(args)
    temps = [float(x) for x in args.temperatures.split(",") if x.strip()]
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"--temperatures must be >= 0, got {args.temperatures!r}")
    prompts = read_domain_prompts(args.prompts, args.target)
    present = list(dict.fromkeys(p["domain"] for p in prompts))
    domains = (
        [d for d in args.domains.split(",") if d]
        if args.domains
        else [d for d in DOMAIN_ORDER if d in present]
        + [d for d in present if d not in DOMAIN_ORDER]
    )
    missing = [d for d in domains if d not in present]
    if missing:
        raise ValueError(f"{args.prompts}: no prompts of domain(s) {missing} (has {present})")
    by_domain = {d: [p for p in prompts if p["domain"] == d] for d in domains}
    if args.max_prompts:
        by_domain = {d: ps[: args.max_prompts] for d, ps in by_domain.items()}

    tcfg = read_config(args.target)
    max_pos = int(tcfg.get("max_position_embeddings", 4096))
    K = max(
        json.loads((Path(m.checkpoint) / "config.json").read_text()).get("block_size", 16)
        for m in methods
    )
    longest = max(len(p["ids"]) for ps in by_domain.values() for p in ps)
    max_seq_len = min(
        max_pos, longest + args.max_new_tokens + K * max(m.tree_blocks for m in methods) + 2
    )
    keep = max_seq_len - args.max_new_tokens - 1
    if keep < 1:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} does not fit the target's {max_pos} positions"
        )
    truncated = 0
    for ps in by_domain.values():
        for p in ps:
            if len(p["ids"]) > keep:
                p["ids"], truncated = p["ids"][-keep:], truncated + 1

    engine = TargetEngine(args.target, n_slots=1, max_seq_len=max_seq_len, device=args.device)
    settings = {
        "target": str(Path(args.target).resolve()),
        "prompts": str(Path(args.prompts).resolve()),
        "max_prompts": args.max_prompts,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "repeats": args.repeats,
        "timing": "paired: per prompt every method and the target alone back to back, fastest of the repeats",
        "drafter_compile": args.compile,
        "min_confidence": args.min_confidence,
        "device": args.device,
        "checkpoints": {m.name: str(Path(m.checkpoint).resolve()) for m in methods},
        "prompt_ids": {d: [p["id"] for p in ps] for d, ps in by_domain.items()},
    }
    cache_path = Path(args.cache) if args.cache else Path(args.out_dir) / "eval_cells.json"
    data = load_cache(cache_path, settings, args.fresh)
    cells = data["cells"]
    run_id = datetime.datetime.now().isoformat(timespec="seconds")

    wanted = lambda m, d, t: m.runs_at(t) and cell_key(m.name, d, t) not in cells  # noqa: E731
    todo = [(d, t) for t in temps for d in domains if any(wanted(m, d, t) for m in methods)]
    n_units = args.repeats * sum(
        len(by_domain[d]) * (1 + sum(wanted(m, d, t) for m in methods)) for d, t in todo
    )
    models: dict = {}
    bar = tqdm(total=n_units, desc="eval", unit="prompt", disable=args.no_progress)
    warmed: set[str] = set()
    try:
        for d, t in todo:
            ps = by_domain[d]
            todo_methods = [m for m in methods if wanted(m, d, t)]
            runners = {"target alone": (None, 1, 1)}
            for m in todo_methods:
                runners[m.name] = (
                    make_proposer(m, args.target, engine, args.device, models, args.compile),
                    m.steps,
                    m.tree_blocks,
                )
            for name, (proposer, steps, tree_blocks) in runners.items():
                if (
                    name not in warmed
                ):  # first-call costs (allocations, kernels) stay out of the timings
                    run_prompts(
                        engine,
                        ps[:1],
                        t,
                        min(4, args.max_new_tokens),
                        args.seed,
                        proposer,
                        steps,
                        tree_blocks=tree_blocks,
                    )
                    warmed.add(name)
            bar.set_description(f"{d} | T={t:g} | {len(runners)} runs per prompt")
            runs = run_paired(
                engine, ps, t, args.max_new_tokens, args.seed, runners, args.repeats, bar
            )
            base = runs["target alone"]
            for m in todo_methods:
                r = runs[m.name]
                if t == 0:
                    bad = [p["id"] for p, a, b in zip(ps, r["outputs"], base["outputs"]) if a != b]
                    assert not bad, (
                        f"{m.name}: greedy output differs from the target's on prompts {bad} ({d})"
                    )
                den, num = r["cond_den"], r["cond_num"]
                cells[cell_key(m.name, d, t)] = {
                    "method": m.name,
                    "domain": d,
                    "temperature": t,
                    "n_prompts": len(ps),
                    "tokens": r["tokens"],
                    "rounds": r["rounds"],
                    "drafts": r["drafts"],
                    "accepted": r["accepted"],
                    "draft_tokens": r["draft_tokens"],
                    "gamma": r["gamma"],
                    "wall_s": r["wall_s"],
                    "tok_s": r["tok_s"],
                    "draft_s": r["draft_s"],
                    "verify_s": r["verify_s"],
                    "base_tok_s": base["tok_s"],
                    "base_wall_s": base["wall_s"],
                    "base_tokens": base["tokens"],
                    "speedup": r["tok_s"] / base["tok_s"],
                    "cond_den": den,
                    "cond_num": num,
                    "greedy_equal": True if t == 0 else None,
                    "run": run_id,
                }
            save_cache(cache_path, data)
    finally:
        bar.close()

    # DFlash ignores the noise: the shuffle pair must be identical.
    for d in domains:
        for t in temps:
            a, b = cells.get(cell_key("dflash", d, t)), cells.get(cell_key("dflash-indep", d, t))
            if a and b:
                assert (a["accepted"], a["drafts"]) == (b["accepted"], b["drafts"]), (
                    f"DFlash shuffle Delta is not 0 ({d}, T={t:g}): the baseline must ignore the noise"
                )

    drafters = {}
    for m in methods:
        if _show(m.checkpoint) in drafters:
            continue
        model = models.get(m.checkpoint)
        if model is None:
            from drafter_service.factory import load_model

            model = load_model(m.checkpoint, args.target)
        c = model.cfg
        arch = (
            f"{c.n_layers} layer(s)" if m.kind == "eagle" else f"{c.n_blocks} blocks"
        ) + f", width {c.dim}, {c.n_heads} heads"
        drafters[_show(m.checkpoint)] = (
            f"kind {checkpoint_kind(m.checkpoint)}, {arch}, {params_of(model) / 1e6:.2f}M "
            f"trainable parameters, feature layers {list(c.feature_layers)}"
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": command,
        "target": _show(args.target),
        "target_desc": f"{engine.num_layers} layers, hidden {engine.hidden_size}, vocab {engine.vocab_size}",
        "device": args.device,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "block_size": K,
        "repeats": args.repeats,
        "compile": args.compile,
        "top_m": 4,
        "prompts": _show(args.prompts),
        "counts": {d: len(ps) for d, ps in by_domain.items()},
        "truncated": truncated,
        "drafters": drafters,
        "notes": notes,
    }
    report = write_report(out_dir, data, methods, domains, temps, info)
    write_plots(out_dir, data, methods, domains, temps, K)
    return report


def main(argv: list[str] | None = None, prog: str = "python -m training.evaluate") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint directory")
    ap.add_argument(
        "--flashmap", help="FlashMap (flow-map distilled) drafter checkpoint: 1- and 2-step rows"
    )
    ap.add_argument(
        "--teacher",
        help="flow-stage FlashMap checkpoint: N-step teacher rows (default: --flashmap)",
    )
    ap.add_argument("--dflash", help="DFlash-style drafter checkpoint")
    ap.add_argument(
        "--dflash-start",
        help="the DFlash-style checkpoint FlashMap was warm-started from (one more row)",
    )
    ap.add_argument("--eagle", help="EAGLE-style drafter checkpoint")
    ap.add_argument(
        "--teacher-steps", type=int, default=8, help="Euler steps of the teacher flow rows (>= 3)"
    )
    ap.add_argument(
        "--tree-blocks",
        type=int,
        default=4,
        help="FlashMap 1 step with this many blocks from independent noise verified as a tree, "
        "at T = 0 (0 or 1: no tree row)",
    )
    ap.add_argument(
        "--prompts", default=str(HELDOUT_PROMPTS), help="JSONL: domain + prompt (or prompt_ids)"
    )
    ap.add_argument(
        "--domains", default="", help="comma-separated (default: every domain in the prompts)"
    )
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument(
        "--max-prompts", type=int, default=0, help="first N prompts per domain (0 = all)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="decode every prompt N times with every method (rotating order), keep the fastest",
    )
    ap.add_argument(
        "--no-shuffle", action="store_true", help="skip the shuffle test (independent-noise rows)"
    )
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT), help="where eval.md and the plots go")
    ap.add_argument(
        "--cache",
        help="JSON cell cache (default OUT_DIR/eval_cells.json); finished cells are skipped",
    )
    ap.add_argument("--fresh", action="store_true", help="ignore (and overwrite) the cell cache")
    ap.add_argument(
        "--min-confidence",
        type=float,
        default=0.0,
        help="> 0: also FlashMap 1-step and DFlash-style rows with greedy drafts cut before the first "
        "slot below this probability (T = 0)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every drafter (the CPU counterpart of the drafter's CUDA graphs)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)"
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--flow-data",
        help="training.drafter_data output of held-out prompts (the target's answers at "
        "--flow-temperature): also write the flow diagnostics of the FlashMap checkpoints "
        "(training.flow_diagnostics: denoiser against tau, shuffle Deltas with K draws averaged, "
        "how often a new draw changes the block, agreement with --dflash) to OUT_DIR/flow_diagnostics.md",
    )
    ap.add_argument("--flow-temperature", type=float, default=0.0)
    ap.add_argument(
        "--flow-anchors",
        type=int,
        default=12,
        help="flow diagnostics: anchors per held-out sequence",
    )
    args = ap.parse_args(argv)
    if args.teacher_steps < 3:
        ap.error("--teacher-steps must be >= 3 (1 and 2 are the flow-map rows)")
    if args.max_new_tokens < 1 or args.max_prompts < 0 or args.repeats < 1:
        ap.error("--max-new-tokens and --repeats must be >= 1, --max-prompts >= 0")
    if args.flow_data and not (args.flashmap or args.teacher):
        ap.error("--flow-data needs --flashmap or --teacher")
    command = " ".join([prog, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = evaluate(args, command)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    print(f"report: {report}")
    if args.flow_data:
        return flow_diagnostics_of(args, Path(report))
    return 0


def flow_diagnostics_of(args, report: Path) -> int:
    """The eval's FlashMap checkpoints through training.flow_diagnostics on --flow-data; the
    result goes beside eval.md, which links it."""
    from training import flow_diagnostics

    argv = [
        "--target",
        args.target,
        "--data",
        args.flow_data,
        "--prompts",
        args.prompts,
        "--temperature",
        f"{args.flow_temperature:g}",
        "--max-anchors",
        str(args.flow_anchors),
        "--averaged",
        "--threads",
        str(args.threads or torch.get_num_threads()),
        "--device",
        args.device,
        "--out",
        str(report.parent / "flow_diagnostics.json"),
    ]
    argv += [
        "--drafter",
        f"teacher={args.teacher or args.flashmap}:{args.teacher_steps}",
    ]  # main checked one is given
    if args.flashmap:
        argv += ["--drafter", f"map={args.flashmap}:1,2"]
    if args.dflash:
        argv += ["--dflash", args.dflash]
    rc = flow_diagnostics.main(argv)
    if rc == 0:
        with report.open("a") as f:
            f.write(
                "\nFlow diagnostics of the FlashMap checkpoints (denoiser against tau, shuffle Deltas, how often a "
                "new draw changes the block, agreement with the DFlash-style drafter): `flow_diagnostics.md`.\n"
            )
    return rc


if __name__ == "__main__":
    sys.exit(main())
