"""What a measurement records beside its numbers: the machine it ran on, the CPU time and peak
memory of processes (from /proc), and paired timing of decoding methods in one process.

Numpy only; torch is described when the caller has imported it.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from flashmap.drafts import TOP_M


def machine() -> str:
    """One line: host, CPU, cores, GPU, OS, Python and (when imported) torch and its threads."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch = sys.modules.get("torch")
    gpu = torch_info = ""
    if torch is not None:
        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
        torch_info = f", torch {torch.__version__}, {torch.get_num_threads()} torch threads"
    return (
        f"{platform.node() or 'host'}: {cpu}, {os.cpu_count()} CPU cores{gpu}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}{torch_info}"
    )


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU ticks so far (user + system) of each thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[11]) + int(fields[12])
    return out


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process and all its descendants, summed, in MiB."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def make_requests(prompts: list[dict], temperature: float, max_new: int, seed: int, eos: list[int]):
    from flashmap.types import GenerationRequest, SamplingParams

    return [
        GenerationRequest(
            list(p["ids"]),
            max_new,
            SamplingParams(temperature=float(temperature), seed=seed * 1_000_003 + i),
            stop_token_ids=tuple(eos),
            request_id=p["id"],
        )
        for i, p in enumerate(prompts)
    ]


class Runner(NamedTuple):
    """How `run_paired` decodes with one method (flashmap.inprocess.decode's options)."""

    proposer: object = None  # None: the target alone
    steps: int = 1
    tree_blocks: int = 1
    tree_sampling: str = "pick"
    top_m: int = TOP_M
    sibling_depth: int = 0


def run_prompts(
    engine,
    prompts,
    temperature,
    max_new,
    seed,
    proposer=None,
    steps=1,
    bar=None,
    tree_blocks=1,
    tree_sampling="pick",
    top_m=TOP_M,
) -> dict:
    """Decode every prompt alone (concurrency 1) once with one method; see `run_paired`."""
    runner = {"run": Runner(proposer, steps, tree_blocks, tree_sampling, top_m)}
    return run_paired(engine, prompts, temperature, max_new, seed, runner, 1, bar)["run"]


def run_paired(
    engine, prompts, temperature, max_new, seed, runners: dict, repeats: int, bar=None
) -> dict:
    """Decode every prompt alone (concurrency 1) with every runner, name -> Runner (or the
    tuple of its first fields), back to back, `repeats` times with the runners' order rotated.

    Per runner and prompt the fastest run counts (its wall, draft and verify seconds): on a
    shared machine the least disturbed run is the best estimate of the cost, and since a
    prompt's runs by all runners lie within seconds of each other, a slow stretch of the
    machine hits the baseline and the methods alike instead of one table cell. Counts and
    outputs are the first repeat's (decoding is seeded: every repeat is the same).
    Returns name -> totals, per prompt (outputs, walls, drafted rounds, accepted tokens: what
    intervals over sequences resample), per-slot counts (cond_den: rounds that reached slot k,
    cond_num: of those, rounds that accepted it)."""
    from flashmap.inprocess import decode

    names = list(runners)
    requests = make_requests(
        prompts, temperature, max_new, seed, engine.eos_token_ids
    )  # read-only in decode
    best: dict[str, list] = {m: [None] * len(prompts) for m in names}  # (wall, draft_s, verify_s)
    first: dict[str, list] = {m: [None] * len(prompts) for m in names}  # (result, rounds)
    for rep in range(max(1, repeats)):
        for i, req in enumerate(requests):
            for m in names[rep % len(names) :] + names[: rep % len(names)]:
                r = Runner(*runners[m])
                t0 = time.perf_counter()
                (res,) = decode(
                    engine,
                    [req],
                    r.proposer,
                    r.steps,
                    r.tree_blocks,
                    tree_sampling=r.tree_sampling,
                    top_m=r.top_m,
                    sibling_depth=r.sibling_depth,
                )
                wall = time.perf_counter() - t0
                if best[m][i] is None or wall < best[m][i][0]:
                    best[m][i] = (wall, res.stats.draft_s, res.stats.verify_s)
                if first[m][i] is None:
                    first[m][i] = res
                if bar is not None:
                    bar.update(1)
    out = {}
    for m in names:
        outs = first[m]
        walls = [b[0] for b in best[m]]
        wall, drafts = sum(walls), sum(r.stats.drafts for r in outs)
        accepted, tokens = sum(r.stats.accepted for r in outs), sum(len(r.token_ids) for r in outs)
        out[m] = {
            "outputs": [r.token_ids for r in outs],
            "tokens": tokens,
            "wall_s": wall,
            "prompt_walls": walls,
            "prompt_tokens": [len(r.token_ids) for r in outs],
            "prompt_drafts": [r.stats.drafts for r in outs],
            "prompt_accepted": [r.stats.accepted for r in outs],
            "tok_s": tokens / max(wall, 1e-12),
            "drafts": drafts,
            "accepted": accepted,
            "draft_tokens": sum(r.stats.draft_tokens for r in outs),
            "rounds": sum(r.stats.rounds for r in outs),
            "gamma": 1.0 + accepted / drafts if drafts else float("nan"),
            "draft_s": sum(b[1] for b in best[m]),
            "verify_s": sum(b[2] for b in best[m]),
            "cond_den": np.sum([r.stats.verified_per_slot for r in outs], 0).tolist(),
            "cond_num": np.sum([r.stats.accepted_per_slot for r in outs], 0).tolist(),
        }
    return out


def bootstrap_ci(
    stat, n: int, reps: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """A percentile bootstrap interval of stat(index) over n sequences (prompts) resampled with
    replacement: the unit of the intervals of every report (docs/ARCHITECTURE.md, "Judging a
    drafter"). stat takes an index array [n] and returns a number (NaN draws are left out)."""
    rng = np.random.default_rng(seed)
    draws = np.array([stat(rng.integers(0, n, n)) for _ in range(reps)], np.float64)
    draws = draws[np.isfinite(draws)]
    if not len(draws):
        return float("nan"), float("nan")
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def gamma_and_speedup_ci(r: dict, base: dict, seed: int = 0) -> dict:
    """95% intervals over prompts of a method's gamma (1 + accepted / drafted rounds) and of its
    speedup over the target alone (tokens/s over tokens/s, the prompts resampled in pairs), from
    run_paired's per-prompt lists."""
    acc, drafts = np.asarray(r["prompt_accepted"], float), np.asarray(r["prompt_drafts"], float)
    tok, wall = np.asarray(r["prompt_tokens"], float), np.asarray(r["prompt_walls"], float)
    btok, bwall = np.asarray(base["prompt_tokens"], float), np.asarray(base["prompt_walls"], float)

    def gamma(i):
        d = drafts[i].sum()
        return 1.0 + acc[i].sum() / d if d else float("nan")

    def speedup(i):
        return (tok[i].sum() / wall[i].sum()) / (btok[i].sum() / bwall[i].sum())

    n = len(acc)
    return {
        "gamma_ci": bootstrap_ci(gamma, n, seed=seed),
        "speedup_ci": bootstrap_ci(speedup, n, seed=seed),
    }
