"""Stack benchmark: the served stack against the target alone and fixed-length speculation.

For each prompt set (held-out text prompts of the demo domains, random token ids) and each
concurrency, in one script:

- in-process: the target alone (batched) and fixed-K speculation (flashmap.inprocess);
- the target alone through Triton: the round loop calling Triton directly, no orchestrator
  (the ceiling of the stack with speculation off);
- through the stack (Triton + drafter + orchestrator): speculation off (every request
  max_draft_tokens = 0), fixed K (orchestrator --speculation full) and the goodput
  controller (--speculation auto, the default); the full and the auto orchestrator both stay
  up the whole run over the same Triton and drafter, so the controller is measured as a
  server runs it (warm, carrying its measurements from one concurrency to the next).

The target alone (in process and through Triton) and the three stack modes run `repeats`
times each, alternated every chunk of the prompts (`--chunks`), because the VM's speed drifts
by a third within minutes and one run per mode cannot tell 5% apart.

Rounds without drafts decode `--decode-steps` tokens per request in one call everywhere (the
in-process target alone too), so every ratio compares like with like.

Tokens/s of each, the ratios the issue asks for, the controller's decisions (mean draft
length, rounds with speculation off) from the orchestrator's metrics, the per-round split at
concurrency 1, and each service's peak memory. Greedy; every output is checked against the
target alone.

Each finished cell (prompt set x concurrency) is saved beside the report (`--out` with .json):
a stopped run started again with the same settings resumes at the next cell (`--fresh`: all
cells again). The report ends with a plot of the two ratios (`--out` with .png). Text after
the line NOTES_MARKER in an existing report (a reading of it) is kept when the report is
written again.

  python -m bench.bench_stack [--target DIR] [--drafter DIR|init] [--max-new-tokens 48] \\
      [--concurrency 1,4,16,32] [--threads N] [--repeats 2] [--chunks 4] [--decode-steps 16] [--no-pipeline] \\
      [--fresh]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import uvloop

from drafter_service.factory import load_proposer
from flashmap.client import AsyncClient, DrafterAdmin
from flashmap.cpus import format_cpu_list, on_cpus
from flashmap.inprocess import decode
from flashmap.measure import machine
from flashmap.metrics import scrape, totals
from flashmap.prompts import HELDOUT_PROMPTS, read_domain_prompts
from flashmap.rounds import speculative_round
from flashmap.sequence import Sequence
from flashmap.types import GenerationRequest
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints, threads_per_service
from orchestrator.target_client import TargetClient, TritonTarget
from target_service.engine import TargetEngine

OUT = Path(__file__).resolve().parent.parent / "docs" / "results"


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a process and all its descendants (Triton's Python stub is a child)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def inprocess(
    engine, proposer, prompts, max_new, concurrency, decode_steps: int = 1
) -> tuple[list, float]:
    """(outputs, tokens/s) with `concurrency` requests batched at a time."""
    run = inprocess_run(engine, proposer, prompts, max_new, concurrency, decode_steps)
    return run["outputs"], tok_s(run)


def inprocess_run(engine, proposer, prompts, max_new, concurrency, decode_steps: int = 1) -> dict:
    """{"outputs", "seconds"} of `inprocess`."""
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += decode(
            engine,
            [GenerationRequest(p, max_new) for p in prompts[i : i + concurrency]],
            proposer,
            decode_steps=decode_steps,
        )
    return {"outputs": [o.token_ids for o in outs], "seconds": time.perf_counter() - t0}


def tok_s(run: dict) -> float:
    return sum(len(o) for o in run["outputs"]) / run["seconds"]


def joined(parts: list[dict]) -> dict:
    """Runs over consecutive chunks of the prompts as one run: {"outputs", "seconds", "tok_s"}
    and "busy_s" (the target model's forwards, engine_seconds) when every part has it."""
    run = {
        "outputs": [o for p in parts for o in p["outputs"]],
        "seconds": sum(p["seconds"] for p in parts),
    }
    if all("busy_s" in p for p in parts):
        run["busy_s"] = sum(p["busy_s"] for p in parts)
    return {**run, "tok_s": tok_s(run)}


# The target model's worker, per batch: its run and, within the run, the answers it handed to Triton.
RUN, ANSWER = (
    "flashmap_target_batch_run_seconds_total",
    "flashmap_target_batch_answer_seconds_total",
)


def engine_seconds(delta: dict[str, float]) -> float:
    """The target model's forwards over a run (metric deltas): its batches' run seconds less the
    answers' hand-over. Each forward starts after its request was sent and ends before its
    answer goes out, so it lies within the client's clock; the hand-over does not (the client
    can read the last answer before the worker's send returns), and it is part of what the
    path adds. The wall less this is what a path adds to the model."""
    return delta.get(RUN, 0.0) - delta.get(ANSWER, 0.0)


def triton_alone(cfg: StackConfig, prompts, max_new, concurrency) -> dict:
    """{"outputs", "seconds", "busy_s"} of the target alone through Triton: the round loop calls Triton
    directly (no orchestrator, no drafter, no client streams), `concurrency` sequences at a
    time, each round sent ahead as the orchestrator sends it (cfg.pipeline). The ceiling of
    the stack with speculation off."""

    async def run():
        target = TritonTarget(
            TargetClient(f"{cfg.host}:{cfg.triton_grpc_port}", key=cfg.target_key), cfg.max_seq_len
        )
        await target.client.info()  # connected before the clock starts, as the stack's client is
        outs, base = [], random.getrandbits(40) + 1
        t0 = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            seqs = [
                Sequence(base + i + j, GenerationRequest(p, max_new), handle=base + i + j)
                for j, p in enumerate(prompts[i : i + concurrency])
            ]
            ahead = None
            while live := [s for s in seqs if not s.finished]:
                ahead = (
                    await speculative_round(
                        live,
                        target,
                        decode_steps=cfg.decode_steps,
                        ahead=ahead,
                        send_ahead=cfg.pipeline,
                    )
                ).ahead
            for s in seqs:
                await target.release(s.handle)
            outs += [s.generated for s in seqs]
        seconds = time.perf_counter() - t0
        await target.client.close()
        return {"outputs": outs, "seconds": seconds}

    before = _scrape_all(cfg)
    out = asyncio.run(run())
    return {**out, "busy_s": engine_seconds(_since(before, _scrape_after_run(cfg)))}


# The controller's expected and realised accepted draft tokens, kept apart by `_scrape_all`.
CALIBRATION = "flashmap_controller_accepted_tokens_total"


def _scrape_all(cfg: StackConfig) -> dict[str, float]:
    """Totals of the orchestrator's, the drafter's and Triton's metrics (names do not collide)."""
    out: dict[str, float] = {}
    for port in (cfg.metrics_port, cfg.drafter_metrics_port, cfg.triton_metrics_port):
        samples = scrape(f"http://{cfg.host}:{port}/metrics", 10)
        out.update(totals(samples))
        for name, labels, value in samples:  # expected and accepted apart
            if name == CALIBRATION:
                out[f"{name}:{labels['kind']}"] = out.get(f"{name}:{labels['kind']}", 0.0) + value
    return out


def _scrape_after_run(cfg: StackConfig) -> dict[str, float]:
    """`_scrape_all` once a run's last batch is counted: the target model sends its metrics
    between batches, within 0.25 s of the last."""
    time.sleep(0.5)
    return _scrape_all(cfg)


def _since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The metrics' change over a run (two `_scrape_all` totals)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def through_stack(cfg: StackConfig, prompts, max_new, concurrency, spec_off: bool = False) -> dict:
    """{"outputs", "seconds", "delta" (the services' metrics over the run), "drafts", "accepted",
    "fallback"} of the prompts through the stack, `concurrency` streams at a time."""
    before = _scrape_all(cfg)

    # One asyncio client for every stream, as a load generator holds one: it sends a burst in a
    # few ms and reads the streams in one thread, where a thread per stream took 8-14 ms to
    # send 16 and competed with the services for the CPU.
    async def run():
        async with AsyncClient(cfg.url, api_key=cfg.api_key) as client:
            await client.health()
            slots = asyncio.Semaphore(concurrency)

            async def one(p):
                async with slots:
                    return await client.generate(
                        prompt_ids=p,
                        max_new_tokens=max_new,
                        ignore_eos=True,
                        max_draft_tokens=0 if spec_off else None,
                    )

            t0 = time.perf_counter()
            outs = await asyncio.gather(*map(one, prompts))
            return outs, time.perf_counter() - t0

    outs, dt = uvloop.run(run())
    return {
        "outputs": [o.token_ids for o in outs],
        "seconds": dt,
        "delta": _since(before, _scrape_after_run(cfg)),
        "drafts": sum(o.stats.drafts for o in outs),
        "accepted": sum(o.stats.accepted for o in outs),
        "fallback": sum(o.stats.fallback_rounds for o in outs),
    }


def stack_summary(parts: list[dict]) -> dict:
    """Runs of `through_stack` (the chunks of one repeat) as one: tokens/s, acceptance, the
    per-round split and the controller's decisions."""
    d: dict[str, float] = {}
    for p in parts:
        for k, v in p["delta"].items():
            d[k] = d.get(k, 0.0) + v
    drafts = sum(p["drafts"] for p in parts)
    rounds = max(d.get("flashmap_round_latency_seconds_count", 0.0), 1.0)
    batches = max(
        d.get("flashmap_target_batches_total", 0.0), 1.0
    )  # batches the model ran (one per verify forward)
    return {
        **joined(parts),
        "gamma": 1 + sum(p["accepted"] for p in parts) / drafts if drafts else 1.0,
        "draft_ms": 1e3 * d.get("flashmap_draft_latency_seconds_sum", 0.0) / rounds,
        "verify_ms": 1e3 * d.get("flashmap_verify_latency_seconds_sum", 0.0) / rounds,
        "round_ms": 1e3 * d.get("flashmap_round_latency_seconds_sum", 0.0) / rounds,
        # Inside the parts: the drafter's forward per round; per batch the target model ran, its
        # wait behind the batch before it and its run (engine and answers; flashmap_target_batch_*).
        "drafter_forward_ms": 1e3
        * d.get("flashmap_drafter_forward_latency_seconds_sum", 0.0)
        / rounds,
        "triton_queue_ms": 1e3 * d.get("flashmap_target_batch_wait_seconds_total", 0.0) / batches,
        "triton_compute_ms": 1e3 * d.get("flashmap_target_batch_run_seconds_total", 0.0) / batches,
        "triton_answer_ms": 1e3
        * d.get("flashmap_target_batch_answer_seconds_total", 0.0)
        / batches,
        "triton_cpu_ms": 1e3 * d.get("flashmap_target_batch_cpu_seconds_total", 0.0) / batches,
        "mean_draft_len": d.get("flashmap_draft_length_sum", 0.0)
        / max(d.get("flashmap_draft_length_count", 0.0), 1),
        "off_rounds": d.get("flashmap_speculation_off_rounds_total", 0.0),
        "rounds": rounds,
        "fallback": sum(p["fallback"] for p in parts),
        "busy_s": engine_seconds(d),
        "shadow_probes": d.get("flashmap_shadow_probes_total", 0.0),
        "expected_accepted": d.get(f"{CALIBRATION}:expected", 0.0),
        "controller_accepted": d.get(f"{CALIBRATION}:accepted", 0.0),
    }


MODES = ("target", "triton", "off", "full", "auto")


def chunks_of(prompts: list, concurrency: int, n: int) -> list[list]:
    """The prompts in about `n` consecutive chunks, each a whole number of batches of
    `concurrency` (fewer chunks when there are not enough batches)."""
    batches = -(-len(prompts) // concurrency)
    per = -(-batches // max(1, min(n, batches))) * concurrency
    return [prompts[i : i + per] for i in range(0, len(prompts), per)]


def warm_up(auto: StackConfig, full: StackConfig, engine, proposer, prompts) -> None:
    """A short request through both orchestrators and in process before anything is timed."""
    for c in (auto, full):
        through_stack(c, prompts[:2], 8, 1)
    decode(engine, [GenerationRequest(prompts[0], 8)], proposer)


def run_mode(
    mode: str,
    part,
    max_new: int,
    concurrency: int,
    decode_steps: int,
    engine,
    auto: StackConfig,
    full: StackConfig,
    cpus: tuple[set[int], set[int]] | None,
    proposer=None,
) -> dict:
    """One chunk of prompts through one of MODES, or "spec" (fixed-K speculation in process with
    `proposer`), `concurrency` at a time: the in-process runs on the target model's CPUs, the
    clients of Triton and of the stack on the rest (Stack.cpus), so each side computes on the
    same cores."""
    if mode in ("target", "spec"):
        with on_cpus(cpus and cpus[0]):
            return inprocess_run(
                engine,
                proposer if mode == "spec" else None,
                part,
                max_new,
                concurrency,
                decode_steps,
            )
    with on_cpus(cpus and cpus[1]):
        if mode == "triton":
            return triton_alone(auto, part, max_new, concurrency)
        return through_stack(
            full if mode == "full" else auto, part, max_new, concurrency, spec_off=mode == "off"
        )


def alternated(
    auto: StackConfig,
    full: StackConfig,
    engine,
    prompts,
    max_new,
    concurrency,
    repeats: int,
    decode_steps: int,
    chunks: int = 1,
    cpus: tuple[set[int], set[int]] | None = None,
) -> dict[str, list[dict]]:
    """Each mode `repeats` times: the in-process target alone ("target"), the target alone
    through Triton ("triton"), and the stack with speculation off, fixed K ("full") and the
    controller ("auto"). The VM's speed drifts (+-30% within minutes), so the modes alternate
    finely: the prompts are cut into `chunks` (chunks_of) and every mode runs a chunk before
    the next chunk starts, in the order of MODES and then reversed; a repeat of a mode is its
    chunks together. Two orchestrators over the same Triton and drafter, both up the whole run
    (nothing restarts, as in a server): `auto` serves "auto" and, with max_draft_tokens = 0 per
    request, "off"; `full` serves "full". cpus: the stack's split (Stack.cpus; run_mode)."""
    parts = chunks_of(prompts, concurrency, chunks)
    runs = {m: [] for m in MODES}
    order = 0
    for rep in range(repeats):
        done = {m: [] for m in MODES}
        for part in parts:
            for mode in MODES if order % 2 == 0 else MODES[::-1]:
                done[mode].append(
                    run_mode(
                        mode, part, max_new, concurrency, decode_steps, engine, auto, full, cpus
                    )
                )
            order += 1
        for mode, got in done.items():
            runs[mode].append(joined(got) if mode in ("target", "triton") else stack_summary(got))
    return runs


def _count(run: dict, key: str) -> str:
    return f"{run[key]:.0f}" if key in run else "-"


def _calibration(run: dict) -> str:
    """Accepted / expected draft tokens of the rounds the controller let draft ('-': none, or a
    run saved before the orchestrator counted them)."""
    return (
        f"{run['controller_accepted'] / run['expected_accepted']:.2f}"
        if run.get("expected_accepted")
        else "-"
    )


def merge(runs: list[dict]) -> dict:
    """Repeats of one mode as one: tokens/s and per-round times averaged, counts summed."""
    out = dict(runs[0])
    for k in (
        "tok_s",
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
    ):
        if all(
            k in r for r in runs
        ):  # triton_answer_ms / _cpu_ms: not in runs saved before the model measured them
            out[k] = float(np.mean([r[k] for r in runs]))
    for k in (
        "off_rounds",
        "rounds",
        "fallback",
        "shadow_probes",
        "expected_accepted",
        "controller_accepted",
    ):
        if all(
            k in r for r in runs
        ):  # the last three: not in runs saved before the orchestrator counted them
            out[k] = sum(r[k] for r in runs)
    return out


def paired_ratios(runs: dict[str, list[dict]], baseline: str = "best") -> list[float]:
    """auto / max(off, full) (baseline "best") or auto / another mode, within each repeat: the
    modes of one repeat ran minutes apart, so the VM's drift cancels in the ratio."""
    base = (
        [max(o["tok_s"], f["tok_s"]) for o, f in zip(runs["off"], runs["full"])]
        if baseline == "best"
        else [r["tok_s"] for r in runs[baseline]]
    )
    return [a["tok_s"] / b for a, b in zip(runs["auto"], base)]


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, 95% interval) of paired ratios: Student's t on their logs, so a
    ratio and its inverse get mirrored intervals. One ratio gives no interval (nan)."""
    from scipy.stats import t as student_t

    logs = np.log(np.asarray(ratios, float))
    m = float(logs.mean())
    if len(logs) < 2:
        return float(np.exp(m)), float("nan"), float("nan")
    half = float(student_t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs)))
    return float(np.exp(m)), float(np.exp(m - half)), float(np.exp(m + half))


def fmt_ci(ci: tuple[float, float, float]) -> str:
    g, lo, hi = ci
    return f"{g:.2f}" if np.isnan(lo) else f"{g:.2f} [{lo:.2f}, {hi:.2f}]"


# Where auto / target alone goes, each step a ratio of two modes within each repeat (the steps multiply).
STEPS = (
    ("Triton alone / target alone", "triton", "target"),
    ("off / Triton alone", "off", "triton"),
    ("auto / off", "auto", "off"),
)

# Modes whose target model runs in Triton: the wall it waited per batch of `concurrency` requests.
IDLE_MODES = ("triton", "off", "auto")

# A report's text from this line on is the reader's: a rerun writes the tables above it and keeps it.
NOTES_MARKER = "<!-- notes: kept when the report is written again -->"


def step_ratios(cell: dict) -> list[str] | None:
    """Each of STEPS for a cell, with its 95% interval; None for a cell saved without per-repeat tokens/s."""
    per = cell.get("tok_s_per_repeat")
    if per is None:
        return None
    return [fmt_ci(ratio_ci([x / y for x, y in zip(per[a], per[b])])) for _, a, b in STEPS]


def prompt_sets(target: str, vocab: int, n: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(0)
    sets = {
        "random ids": [
            rng.integers(3, vocab, size=int(rng.integers(8, 32))).tolist() for _ in range(n)
        ]
    }
    try:
        text = [p["ids"] for p in read_domain_prompts(HELDOUT_PROMPTS, target)]
        sets["held-out text"] = [text[i % len(text)] for i in range(n)]
    except (OSError, ValueError):  # a target without a tokenizer
        pass
    return sets


def cpus_text(cpus: list[str] | None) -> str:
    if not cpus:
        return "; not pinned to CPUs"
    return (
        f"; the target model's worker and the in-process target on CPU {cpus[0]}, every other process "
        f"and thread (Triton's server, drafter, orchestrator, clients) on CPU {cpus[1]} (flashmap.cpus)"
    )


def run_cells(
    cfg: StackConfig,
    sets: dict,
    todo: list[tuple[str, int]],
    cells: dict,
    engine,
    proposer,
    a,
    save,
) -> None:
    """Run the cells in `todo` (prompt set, concurrency) on one stack, each into `cells` and
    saved (`save()`) as it finishes; then the services' peak memory and what the drafter holds
    after the run into cells["run"]."""
    with Stack(cfg) as stack:
        _, full = stack.extra_orchestrator("orchestrator-full", speculation="full")
        for name, prompts in sets.items():
            levels = [c for n, c in todo if n == name]
            if levels:
                warm_up(cfg, full, engine, proposer, prompts)
            for c in levels:
                with on_cpus(stack.cpus and stack.cpus[0]):
                    ip_ids, ip = inprocess(engine, proposer, prompts, a.max_new_tokens, c)
                runs = alternated(
                    cfg,
                    full,
                    engine,
                    prompts,
                    a.max_new_tokens,
                    c,
                    a.repeats,
                    a.decode_steps,
                    a.chunks,
                    stack.cpus,
                )
                ar_ids = runs["target"][0]["outputs"]
                for what, ids in (
                    ("in-process speculation", ip_ids),
                    *((m, r["outputs"]) for m, rs in runs.items() for r in rs),
                ):
                    assert ids == ar_ids, (
                        f"{what}: output differs from the target alone ({name}, concurrency {c})"
                    )
                cell = {
                    m: float(np.mean([r["tok_s"] for r in runs[m]])) for m in ("target", "triton")
                }
                cell["auto_first"] = runs["auto"][0]["tok_s"]
                cell |= {
                    m: {k: v for k, v in merge(runs[m]).items() if k != "outputs"}
                    for m in ("off", "full", "auto")
                }
                waves = len(prompts) / c
                cell["idle_ms_per_wave"] = {
                    m: 1e3 * float(np.mean([(r["seconds"] - r["busy_s"]) / waves for r in runs[m]]))
                    for m in IDLE_MODES
                }
                cell |= {
                    "in_process_spec": ip,
                    "vs_best": paired_ratios(runs),
                    "vs_target": paired_ratios(runs, "target"),
                    "tok_s_per_repeat": {m: [r["tok_s"] for r in rs] for m, rs in runs.items()},
                }
                cells[f"{name}|{c}"] = cell
                save()
                auto = cell["auto"]
                print(
                    f"{name} c={c}: target alone {cell['target']:.0f} tok/s, in-process spec {ip:.0f}, Triton alone "
                    f"{cell['triton']:.0f}, stack off {cell['off']['tok_s']:.0f} / full {cell['full']['tok_s']:.0f} / "
                    f"auto {auto['tok_s']:.0f} (mean draft {auto['mean_draft_len']:.1f}, off rounds "
                    f"{auto['off_rounds']:.0f}; auto / best {fmt_ci(ratio_ci(cell['vs_best']))}; auto / target "
                    f"alone {fmt_ci(ratio_ci(cell['vs_target']))})",
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


def write_plot(path: Path, rows: list[tuple[str, int, dict]]) -> Path:
    """Per prompt set, auto / max(off, full) and auto / target alone per concurrency, with the
    95% intervals and the acceptance bars (0.95 and 0.9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(
        1, len(names), figsize=(5.5 * len(names), 4), squeeze=False, sharey=True
    )
    for ax, name in zip(axes[0], names):
        cs = [c for n, c, _ in rows if n == name]
        x = np.arange(len(cs))
        for j, (key, label) in enumerate(
            (("vs_best", "auto / max(off, full)"), ("vs_target", "auto / target alone"))
        ):
            cis = [ratio_ci(cell[key]) for n, _, cell in rows if n == name]
            g = np.array([ci[0] for ci in cis])
            err = np.nan_to_num(np.array([[ci[0] - ci[1], ci[2] - ci[0]] for ci in cis]).T)
            ax.errorbar(x + (j - 0.5) * 0.2, g, yerr=err, fmt="o", capsize=4, label=label)
        for y, style in ((1.0, "-"), (0.95, "--"), (0.9, ":")):
            ax.axhline(y, color="gray", lw=0.8, ls=style)
        ax.set_xticks(x, [str(c) for c in cs])
        ax.set_xlim(
            -0.5, len(cs) - 0.5
        )  # one concurrency alone: its two points stay beside its tick
        ax.set_xlabel("concurrency")
        ax.set_ylim(0.5, 1.5)  # an interval past the frame is cut there
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("tokens/s ratio (geometric mean, 95% CI)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="prompts per set (default: 2 x the largest concurrency)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per service and of the in-process runs (default: the stack's, half the cores)",
    )
    ap.add_argument(
        "--repeats", type=int, default=2, help="runs of each mode, alternated (default 2)"
    )
    ap.add_argument(
        "--chunks",
        type=int,
        default=4,
        help="cut the prompts into this many parts; every mode runs a part before the next part "
        "starts (default 4; 1: whole sets)",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=StackConfig.decode_steps,
        help="tokens per request of a round without drafts, for the target alone and the stack alike",
    )
    ap.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the orchestrator queues the next round without drafts while one runs (its --pipeline)",
    )
    ap.add_argument(
        "--pin-cpus",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the target model's worker (and the in-process target) on CPUs of their own (StackConfig.pin_cpus)",
    )
    ap.add_argument("--out", type=Path, default=OUT / "bench_stack.md")
    ap.add_argument(
        "--fresh", action="store_true", help="ignore the finished cells saved beside --out"
    )
    a = ap.parse_args(argv)
    threads = a.threads or threads_per_service()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    target, drafter, notes = default_checkpoints(a.target, a.drafter)
    levels = [int(x) for x in a.concurrency.split(",")]
    n = a.prompts or 2 * max(levels)
    engine = TargetEngine(target, n_slots=max(levels), max_seq_len=512)
    proposer = load_proposer(drafter, target, n_slots=max(levels), max_context=engine.max_seq_len)
    sets = prompt_sets(target, engine.vocab_size, n)
    cfg = StackConfig.on_free_ports(
        target_dir=target,
        drafter=drafter,
        n_slots=max(levels),
        max_seq_len=512,
        speculation="auto",
        decode_steps=a.decode_steps,
        pipeline=a.pipeline,
        pin_cpus=a.pin_cpus,
    )
    # Finished cells go to a JSON file beside the report, so a run that is stopped resumes at
    # the next cell (with the same settings; another setting starts afresh).
    settings = {
        "target": str(target),
        "drafter": str(drafter),
        "max_new_tokens": a.max_new_tokens,
        "prompts": n,
        "threads": threads,
        "repeats": a.repeats,
        "chunks": a.chunks,
        "decode_steps": a.decode_steps,
        "pipeline": a.pipeline,
        "pin_cpus": a.pin_cpus,
        "client": "asyncio",
        "burst_window_ms": cfg.burst_window_ms,
        "busy": "engine",
    }  # busy_s: the model's forwards (engine_seconds)
    cells_path = a.out.with_suffix(".json")
    saved = json.loads(cells_path.read_text()) if cells_path.exists() and not a.fresh else {}
    cells = saved.get("cells", {}) if saved.get("settings") == settings else {}
    todo = [(name, c) for name in sets for c in levels if f"{name}|{c}" not in cells]
    print(
        f"{len(sets) * len(levels) - len(todo)} cells from {cells_path}, {len(todo)} to run",
        flush=True,
    )
    cells_path.parent.mkdir(parents=True, exist_ok=True)
    if todo:
        run_cells(
            cfg,
            sets,
            todo,
            cells,
            engine,
            proposer,
            a,
            lambda: cells_path.write_text(
                json.dumps({"settings": settings, "cells": cells}, indent=1)
            ),
        )
    rows = [(name, c, cells[f"{name}|{c}"]) for name in sets for c in levels]
    plot = write_plot(a.out.with_suffix(".png"), rows)

    date = datetime.date.today().isoformat()
    lines = [
        "# Stack benchmark (CPU)",
        "",
        "| prompts | concurrency | target alone (in-process) | fixed-K spec (in-process) | target alone through "
        "Triton | stack, speculation off | stack, fixed K | stack, auto | auto, first repeat | "
        "auto / max(off, full) [95% CI] | auto / target alone [95% CI] | mean draft length (auto) | "
        "rounds without speculation (auto) | gamma (auto) | shadow probes (auto) | accepted / expected (auto) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c, cell in rows:
        off, full, auto = cell["off"], cell["full"], cell["auto"]
        lines.append(
            f"| {name} | {c} | {cell['target']:.0f} | {cell['in_process_spec']:.0f} | {cell['triton']:.0f} | "
            f"{off['tok_s']:.0f} | {full['tok_s']:.0f} | {auto['tok_s']:.0f} | {cell['auto_first']:.0f} | "
            f"{fmt_ci(ratio_ci(cell['vs_best']))} | {fmt_ci(ratio_ci(cell['vs_target']))} | "
            f"{auto['mean_draft_len']:.1f} | {auto['off_rounds']:.0f} / {auto['rounds']:.0f} | {auto['gamma']:.2f} | "
            f"{_count(auto, 'shadow_probes')} | {_calibration(auto)} |"
        )
    lines += [
        "",
        f"Tokens/s, greedy, {a.max_new_tokens} new tokens per request, {n} prompts per set; every output equals "
        f"the target alone's (checked). The target alone (in process and through Triton) and the stack modes: the "
        f"mean of {a.repeats} runs each; the prompts are cut into {a.chunks} parts of whole batches and every mode "
        f"runs a part before the next part starts (target, Triton, off, full, auto, then reversed), a run being "
        f"its parts together; the ratios are "
        f"the geometric mean of the ratio within each repeat, with a 95% interval (Student's t on the logs; "
        f"'best' is the faster of off and full in that repeat); fixed-K speculation in process: one run. Two "
        f"orchestrators over one Triton and one drafter stay up the whole run (auto, which also serves off as "
        f"max_draft_tokens = 0 per request, and full), so the controller carries what it measured from one cell "
        f"to the next as a server would; 'first repeat' is its first pass at a new concurrency. Shadow probes: "
        f"the controller's probes drafted beside the rounds and checked against the text the target commits "
        f"(never verified); accepted / expected: the draft tokens the verify accepted in the rounds the controller "
        f"let draft, over the number it expected when it chose them. The stack's "
        f"client: one asyncio channel (uvloop) per part, every stream of the part on it. "
        f"Command: `OMP_NUM_THREADS={threads} "
        f"python -m bench.bench_stack --concurrency {a.concurrency} --max-new-tokens {a.max_new_tokens} --threads "
        f"{threads} --repeats {a.repeats} --chunks {a.chunks} --decode-steps {a.decode_steps}{'' if a.pipeline else ' --no-pipeline'}{'' if a.pin_cpus else ' --no-pin-cpus'}"
        f"{f' --prompts {a.prompts}' if a.prompts else ''}{'' if a.out == OUT / 'bench_stack.md' else f' --out {os.path.relpath(a.out)}'}`; "
        f"rounds without drafts decode "
        f"{a.decode_steps} tokens per request in one call, in process and through the stack alike; the orchestrator "
        f"{'queues the next such round at Triton while one runs (--pipeline)' if a.pipeline else 'sends a round once the one before has answered (--no-pipeline)'}. Date: {date}. Machine: {machine()}; {threads} torch threads per "
        f"service{cpus_text(cells.get('run', {}).get('cpus'))}. Target `{os.path.relpath(target)}`, drafter `{drafter}`.",
        *[f"Note: {x}" for x in notes],
        "",
        f"Per round at concurrency {levels[0]} (ms, stack): the orchestrator's draft and verify calls and whole round, "
        "and inside them the drafter's forward and, per batch the target model ran, its wait behind the batch "
        "before it, its run and, of the run, the answers handed to Triton and the model's worker on a CPU (the rest "
        "of the run it waited):",
        "",
        "| prompts | mode | draft call | drafter forward | verify call | target model wait | target model run | "
        "of which answers | of which on CPU | whole round |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c, cell in rows:
        if c == levels[0]:
            for mode in ("off", "full", "auto"):
                r = cell[mode]
                answers, cpu = (
                    f"{r[k]:.2f}" if k in r else "-" for k in ("triton_answer_ms", "triton_cpu_ms")
                )
                lines.append(
                    f"| {name} | {mode} | {r['draft_ms']:.2f} | {r['drafter_forward_ms']:.2f} | "
                    f"{r['verify_ms']:.2f} | {r['triton_queue_ms']:.2f} | {r['triton_compute_ms']:.2f} | "
                    f"{answers} | {cpu} | {r['round_ms']:.2f} |"
                )
    steps = [(name, c, step_ratios(cell)) for name, c, cell in rows]
    if all(r is not None for _, _, r in steps):
        lines += [
            "",
            "The parts of auto / target alone: each step's ratio within each repeat, geometric mean [95% CI] "
            "(the steps multiply), and the wall the target model did not compute (its batches' run seconds "
            "less the answers' hand-over, from its metrics), per batch of `concurrency` requests (ms: "
            "Triton alone / off / auto; the in-process target has none):",
            "",
            "| prompts | concurrency | "
            + " | ".join(name for name, _, _ in STEPS)
            + " | target idle per batch |",
            "|---|---:|" + "---:|" * (len(STEPS) + 1),
        ]
        for (name, c, r), (_, _, cell) in zip(steps, rows):
            idle = cell.get("idle_ms_per_wave")
            lines.append(
                f"| {name} | {c} | "
                + " | ".join(r)
                + " | "
                + (" / ".join(f"{idle[m]:.1f}" for m in IDLE_MODES) if idle else "-")
                + " |"
            )
    run = cells.get(
        "run", {"memory_mb": {}, "drafter_sequences_held": "?"}
    )  # absent: stopped after the last cell
    lines += [
        "",
        f"![auto against the better fixed policy and the target alone]({plot.name})",
        "",
        "Peak resident memory (VmHWM, MB): "
        + ", ".join(f"{k} {v:.0f}" for k, v in run["memory_mb"].items())
        + ".",
        f"Target KV cache {engine.kv_bytes_per_token} bytes per context token; drafter cross-attention "
        f"cache {proposer.bytes_per_context_token}; drafter after the run: {run['drafter_sequences_held']} "
        f"sequences held.",
    ]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    old = a.out.read_text() if a.out.exists() else ""
    notes = old[old.index(NOTES_MARKER) :] if NOTES_MARKER in old else ""
    a.out.write_text("\n".join(lines) + "\n" + (f"\n{notes}" if notes else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
