"""The served stack against the target alone in one process, on this machine's CPUs.

For each prompt set (random token ids; test-prompt text of the demo domains) and each
concurrency, every mode of `--modes` (bench.stack_paths: the target alone and fixed-K
speculation in process, the target alone through Triton, the stack with speculation off, the
full block and the goodput controller) runs `--repeats` times. The VM's speed drifts within
minutes, so the modes alternate finely: the prompts are cut into `--chunks` parts of whole
batches and every mode runs a part before the next part starts (in the order of --modes,
then reversed); a repeat of a mode is its parts together. Each ratio is taken within a repeat
and reported as a geometric mean with a 95% interval (bench.common.ratio_ci).

One Triton and one drafter serve two orchestrators that stay up the whole run: auto (which
also serves "off" as max_draft_tokens = 0 per request) and full. The controller carries what
it measured from one cell to the next, as a server would. Greedy; every output is checked
against the target alone's.

The report: tokens/s per mode, the paired ratios (each mode over the target alone, and the
steps between them), the controller's decisions and the wall the target model did not
compute, the per-round split at the first concurrency (from the services' metrics), a plot
and each service's peak memory. Each finished cell is saved beside the report (.json): a
stopped run started again with the same settings resumes at the next cell (`--fresh`: all
cells again).

    python -m bench.stack --concurrency 1,4,16,32 --repeats 5 --chunks 16 --prompts 64
    python -m bench.stack --concurrency 1 --modes target,off,auto --no-pin-cpus --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from bench.common import RESULTS, fmt_ci, parser, ratio_ci, set_threads, write_report
from bench.stack_paths import (
    MODES,
    STACK_MODES,
    Paths,
    chunks_of,
    joined,
    prompt_sets,
    run_mode,
    stack_summary,
)
from flashmap.client import DrafterAdmin
from flashmap.cpus import format_cpu_list
from flashmap.measure import peak_rss_mb
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints

LABELS = {
    "target": "target alone (in process)",
    "spec": "fixed K (in process)",
    "triton": "target alone through Triton",
    "off": "stack, speculation off",
    "full": "stack, fixed K",
    "auto": "stack, auto",
}
# Steps between modes worth a ratio of their own: where the path from the target alone to the
# controller loses (they multiply).
STEPS = (("off", "triton"), ("auto", "off"))
# Modes whose target model runs in Triton: the wall it waited per batch of `concurrency` requests.
IDLE_MODES = ("triton", "off", "auto")
# Per-repeat means of a stack mode, and counts summed over repeats.
MEANS = (
    "gamma",
    "draft_ms",
    "verify_ms",
    "round_ms",
    "drafter_forward_ms",
    "triton_queue_ms",
    "triton_compute_ms",
    "triton_answer_ms",
    "triton_cpu_ms",
    "mean_draft_len",
)
COUNTS = (
    "off_rounds",
    "rounds",
    "fallback",
    "shadow_probes",
    "expected_accepted",
    "controller_accepted",
)


def alternated(ctx: Paths, prompts, max_new, concurrency, modes, repeats, chunks) -> dict:
    """Each mode `repeats` times, alternated chunk by chunk: mode -> [one run per repeat]."""
    parts = chunks_of(prompts, concurrency, chunks)
    runs = {m: [] for m in modes}
    order = 0
    for _ in range(repeats):
        done = {m: [] for m in modes}
        for part in parts:
            for mode in modes if order % 2 == 0 else modes[::-1]:
                done[mode].append(run_mode(mode, part, max_new, concurrency, ctx))
            order += 1
        for mode, got in done.items():
            runs[mode].append(stack_summary(got) if mode in STACK_MODES else joined(got))
    return runs


def cell_of(runs: dict, n_prompts: int, concurrency: int) -> dict:
    """What a report keeps of a cell's runs: tokens/s per repeat, the stack modes' per-round
    means and counts, and the target model's idle wall per batch."""
    waves = n_prompts / concurrency
    stack = {}
    for m in STACK_MODES:
        if m in runs:
            rs = runs[m]
            stack[m] = {k: float(np.mean([r[k] for r in rs])) for k in MEANS}
            stack[m] |= {k: float(sum(r[k] for r in rs)) for k in COUNTS}
    return {
        "tok_s_per_repeat": {m: [r["tok_s"] for r in rs] for m, rs in runs.items()},
        "stack": stack,
        "idle_ms_per_batch": {
            m: 1e3 * float(np.mean([(r["seconds"] - r["busy_s"]) / waves for r in runs[m]]))
            for m in IDLE_MODES
            if m in runs
        },
    }


def ratio(cell: dict, a: str, b: str) -> tuple[float, float, float] | None:
    """a / b within each repeat (b "best": the faster of off and full), or None if absent."""
    per = cell["tok_s_per_repeat"]
    if a not in per or (b not in per and b != "best"):
        return None
    if b == "best":
        if not {"off", "full"} <= set(per):
            return None
        base = [max(o, f) for o, f in zip(per["off"], per["full"])]
    else:
        base = per[b]
    return ratio_ci([x / y for x, y in zip(per[a], base)])


def run_cells(cfg, sets, todo, cells, engine, proposer, a, save) -> None:
    """Run the cells in `todo` (prompt set, concurrency) on one stack, each into `cells` and
    saved as it finishes; then the services' peak memory and what the drafter still holds."""
    with Stack(cfg) as stack:
        _, full = stack.extra_orchestrator("orchestrator-full", speculation="full")
        ctx = Paths(engine, proposer, cfg, full, stack.cpus)
        for name, prompts in sets.items():
            levels = [c for n, c in todo if n == name]
            if levels:  # a short request through every mode before anything is timed
                for m in a.modes:
                    run_mode(m, prompts[:2], 8, 1, ctx)
            for c in levels:
                runs = alternated(ctx, prompts, a.max_new_tokens, c, a.modes, a.repeats, a.chunks)
                want = runs["target"][0]["outputs"]
                for m, rs in runs.items():
                    for r in rs:
                        assert r["outputs"] == want, f"{m}: output differs ({name}, c={c})"
                cells[f"{name}|{c}"] = cell = cell_of(runs, len(prompts), c)
                save()
                print(
                    f"{name} c={c}: "
                    + ", ".join(
                        f"{m} {np.mean(v):.0f}" for m, v in cell["tok_s_per_repeat"].items()
                    )
                    + " tok/s",
                    flush=True,
                )
        with DrafterAdmin(cfg.drafter_url, token=cfg.drafter_token) as admin:
            held = admin.stats().active_sequences
        cells["run"] = {
            "memory_mb": {
                "triton (server + Python stub)": peak_rss_mb(stack.triton.process.pid),
                "drafter": peak_rss_mb(stack.drafter_proc.pid),
                "orchestrator": peak_rss_mb(stack.orch_proc.pid),
            },
            "drafter_sequences_held": held,
            "cpus": None if stack.cpus is None else [format_cpu_list(c) for c in stack.cpus],
        }
        save()


def write_plot(path: Path, rows: list[tuple[str, int, dict]], modes: list[str]) -> Path:
    """Per prompt set, every mode over the target alone per concurrency, with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r[0] for r in rows))
    others = [m for m in modes if m != "target"]
    fig, axes = plt.subplots(
        1, len(names), figsize=(5.5 * len(names), 4), squeeze=False, sharey=True
    )
    for ax, name in zip(axes[0], names):
        cells = [(c, cell) for n, c, cell in rows if n == name]
        x = np.arange(len(cells))
        for j, m in enumerate(others):
            cis = [ratio(cell, m, "target") for _, cell in cells]
            g = np.array([ci[0] for ci in cis])
            err = np.nan_to_num(np.array([[ci[0] - ci[1], ci[2] - ci[0]] for ci in cis]).T)
            dx = (j - (len(others) - 1) / 2) * 0.12
            ax.errorbar(x + dx, g, yerr=err, fmt="o", capsize=3, label=LABELS[m])
        for y, style in ((1.0, "-"), (0.9, ":")):
            ax.axhline(y, color="gray", lw=0.8, ls=style)
        ax.set_xticks(x, [str(c) for c, _ in cells])
        ax.set_xlim(-0.5, len(cells) - 0.5)
        ax.set_xlabel("concurrency")
        ax.set_ylim(0, 1.6)  # an interval past the frame is cut there
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("tokens/s over the target alone (95% CI)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tables(rows, modes: list[str], first_level: int) -> list[str]:
    """The report's tables: tokens/s, paired ratios, the controller, the per-round split."""
    lines = [
        "| prompts | concurrency | " + " | ".join(LABELS[m] for m in modes) + " |",
        "|---|---:|" + "---:|" * len(modes),
    ]
    for name, c, cell in rows:
        per = cell["tok_s_per_repeat"]
        lines.append(
            f"| {name} | {c} | " + " | ".join(f"{np.mean(per[m]):.0f}" for m in modes) + " |"
        )
    pairs = [(m, "target") for m in modes if m != "target"]
    pairs += [p for p in (*STEPS, ("auto", "best")) if ratio(rows[0][2], *p) is not None]
    name_of = lambda m: "max(off, full)" if m == "best" else m  # noqa: E731
    lines += [
        "",
        "Paired ratios of tokens/s, geometric mean over the repeats [95% CI]:",
        "",
        "| prompts | concurrency | " + " | ".join(f"{a} / {name_of(b)}" for a, b in pairs) + " |",
        "|---|---:|" + "---:|" * len(pairs),
    ]
    for name, c, cell in rows:
        lines.append(
            f"| {name} | {c} | " + " | ".join(fmt_ci(ratio(cell, a, b)) for a, b in pairs) + " |"
        )
    idle = [m for m in IDLE_MODES if m in modes]
    if "auto" in modes or idle:
        lines += [
            "",
            "The controller (auto, counts over the repeats) and the wall the target model did not "
            "compute per batch of `concurrency` requests (ms, " + " / ".join(idle) + "):",
            "",
            "| prompts | concurrency | mean draft length | rounds without speculation | gamma | "
            "shadow probes | accepted / expected | target idle per batch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, c, cell in rows:
            r = cell["stack"].get("auto")
            ctl = (
                [
                    f"{r['mean_draft_len']:.1f}",
                    f"{r['off_rounds']:.0f} / {r['rounds']:.0f}",
                    f"{r['gamma']:.2f}",
                    f"{r['shadow_probes']:.0f}",
                    f"{r['controller_accepted'] / r['expected_accepted']:.2f}"
                    if r["expected_accepted"]
                    else "-",
                ]
                if r
                else ["-"] * 5
            )
            ms = " / ".join(f"{cell['idle_ms_per_batch'][m]:.1f}" for m in idle) or "-"
            lines.append(f"| {name} | {c} | " + " | ".join(ctl) + f" | {ms} |")
    stack_modes = [m for m in STACK_MODES if m in modes]
    if stack_modes:
        lines += [
            "",
            f"Per round at concurrency {first_level} (ms, stack): the orchestrator's draft and "
            "verify calls and whole round; inside them the drafter's forward and, per batch the "
            "target model ran, its wait behind the batch before it, its run and, of the run, the "
            "answers handed to Triton and the worker on a CPU:",
            "",
            "| prompts | mode | draft call | drafter forward | verify call | target model wait | "
            "target model run | of which answers | of which on CPU | whole round |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        keys = (
            "draft_ms",
            "drafter_forward_ms",
            "verify_ms",
            "triton_queue_ms",
            "triton_compute_ms",
            "triton_answer_ms",
            "triton_cpu_ms",
            "round_ms",
        )
        for name, c, cell in rows:
            if c == first_level:
                for m in stack_modes:
                    r = cell["stack"][m]
                    lines.append(
                        f"| {name} | {m} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |"
                    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = parser(
        "bench.stack",
        __doc__,
        target=None,
        drafter=None,
        max_new_tokens=48,
        prompts=0,
        repeats=2,
        threads=0,
        out=RESULTS / "bench_stack.md",
    )
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma list")
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma list of {', '.join(MODES)}; must include target (the baseline)",
    )
    ap.add_argument("--chunks", type=int, default=4, help="parts of the prompts (see above)")
    ap.add_argument(
        "--plain-tokens",
        type=int,
        default=StackConfig.plain_tokens,
        help="tokens per request of a round without drafts, in process and in the stack alike",
    )
    ap.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=StackConfig.pipeline,
        help="the orchestrator queues the next round without drafts while one runs",
    )
    ap.add_argument(
        "--pin-cpus",
        action=argparse.BooleanOptionalAction,
        default=StackConfig.pin_cpus,
        help="the target model's worker (and the in-process runs) on CPUs of their own",
    )
    ap.add_argument(
        "--queue-delay-us",
        type=int,
        default=None,
        help="Triton's sequence-batcher wait for a fuller batch (default: config.pbtxt's)",
    )
    ap.add_argument("--fresh", action="store_true", help="ignore the cells saved beside --out")
    a = ap.parse_args(argv)
    a.modes = a.modes.split(",")
    if "target" not in a.modes or not set(a.modes) <= set(MODES):
        ap.error(f"--modes: a comma list of {', '.join(MODES)} including target")
    levels = [int(x) for x in a.concurrency.split(",")]
    threads = set_threads(a.threads)
    target, drafter, notes = default_checkpoints(a.target, a.drafter)
    n = a.prompts or 2 * max(levels)

    from drafter_service.factory import load_proposer
    from target_service.engine import TargetEngine

    engine = TargetEngine(target, n_slots=max(levels), max_seq_len=512)
    proposer = load_proposer(drafter, target, n_slots=max(levels), max_context=engine.max_seq_len)
    sets = prompt_sets(target, engine.vocab_size, n)
    cfg = StackConfig.on_free_ports(
        target_dir=target,
        drafter=drafter,
        n_slots=max(levels),
        max_seq_len=512,
        speculation="auto",
        plain_tokens=a.plain_tokens,
        pipeline=a.pipeline,
        pin_cpus=a.pin_cpus,
        max_queue_delay_us=a.queue_delay_us,
    )
    settings = {
        k: v for k, v in vars(a).items() if k not in ("out", "fresh", "concurrency", "threads")
    } | {"target": str(target), "drafter": str(drafter), "prompts": n, "threads": threads}
    cells_path = a.out.with_suffix(".json")
    saved = json.loads(cells_path.read_text()) if cells_path.exists() and not a.fresh else {}
    cells = saved.get("cells", {}) if saved.get("settings") == settings else {}
    todo = [(name, c) for name in sets for c in levels if f"{name}|{c}" not in cells]
    print(f"{len(sets) * len(levels) - len(todo)} cells from {cells_path}, {len(todo)} to run")
    cells_path.parent.mkdir(parents=True, exist_ok=True)
    if todo:

        def save():
            cells_path.write_text(json.dumps({"settings": settings, "cells": cells}, indent=1))

        run_cells(cfg, sets, todo, cells, engine, proposer, a, save)
    rows = [(name, c, cells[f"{name}|{c}"]) for name in sets for c in levels]
    plot = write_plot(a.out.with_suffix(".png"), rows, a.modes)
    run = cells.get("run", {"memory_mb": {}, "drafter_sequences_held": "?", "cpus": None})
    cpus = run["cpus"]
    about = (
        f"Tokens/s, greedy, {a.max_new_tokens} new tokens per request, {n} prompts per set, the "
        f"mean of {a.repeats} repeats; every output equals the target alone's (checked). The "
        f"prompts are cut into {a.chunks} parts of whole batches and every mode runs a part "
        f"before the next part starts ({', '.join(a.modes)}, then reversed); a ratio is taken "
        "within each repeat ('max(off, full)': the faster of the two in that repeat). Two "
        "orchestrators over one Triton and one drafter stay up the whole run (auto, which also "
        "serves off as max_draft_tokens = 0 per request, and full). Shadow probes: the "
        "controller's probes drafted beside the rounds and checked against the text the target "
        "commits; accepted / expected: the draft tokens accepted in the rounds the controller let "
        f"draft, over the number it expected. Rounds without drafts decode {a.plain_tokens} tokens "
        "per request in one call, in process and through the stack alike; the orchestrator "
        + (
            "queues the next such round while one runs. "
            if a.pipeline
            else "waits for each answer. "
        )
        + f"{threads} torch thread(s) per process; "
        + (
            f"the target model's worker and the in-process runs on CPU {cpus[0]}, every other "
            f"process and thread on CPU {cpus[1]} (flashmap.cpus). "
            if cpus
            else "not pinned to CPUs. "
        )
        + f"Target `{os.path.relpath(target)}`, drafter `{os.path.relpath(drafter) if drafter != 'init' else drafter}`."
        + "".join(f" Note: {x}" for x in notes)
    )
    more = [
        f"![each mode over the target alone]({plot.name}); the cells: [{cells_path.name}]({cells_path.name}).",
        "",
        "Peak resident memory (VmHWM, MB): "
        + ", ".join(f"{k} {v:.0f}" for k, v in run["memory_mb"].items())
        + f". Target KV cache {engine.kv_bytes_per_token} bytes per context token; drafter "
        f"cross-attention cache {proposer.bytes_per_context_token}; drafter after the run: "
        f"{run['drafter_sequences_held']} sequences held.",
    ]
    table = tables(rows, a.modes, levels[0])
    print(
        write_report(
            a.out,
            "The stack against the target alone (CPU)",
            table,
            about,
            "bench.stack",
            argv,
            more,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
