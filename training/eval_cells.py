"""The cells of `flashmap eval` (training.evaluate): per (domain, temperature) the target alone
and every method decoded in pairs on the engine computing the method's target layers, one cell
per method (acceptance, speedup, the conditional acceptance per slot), cached as they are
measured, and the checks on them (at T = 0 every method's output equals the target's; the
DFlash-style drafter's shuffle Delta is 0).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from flashmap.measure import Runner, gamma_and_speedup_ci, run_paired
from training.eval_methods import Method, feature_layers_of, make_proposer
from training.eval_report import cell_key, save_cache


def cache_settings(args, methods: list[Method], by_domain: dict) -> dict:
    """What a cached cell was measured with: a cache of other settings is refused (a run may add
    methods: eval_report.load_cache)."""
    return {
        "target": str(Path(args.target).resolve()),
        "prompts": str(Path(args.prompts).resolve()),
        "max_prompts": args.max_prompts,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "repeats": args.repeats,
        "timing": "paired: per prompt every method and the target alone back to back, "
        "fastest of the repeats",
        "drafter_compile": args.compile,
        "min_confidence": args.min_confidence,
        "device": args.device,
        "checkpoints": {m.name: str(Path(m.checkpoint).resolve()) for m in methods},
        "prompt_ids": {d: [p["id"] for p in ps] for d, ps in by_domain.items()},
    }


def measure(args, engine_for, methods, by_domain, temps, data: dict, cache_path: Path, run: dict):
    """Every (domain, temperature) with a missing cell: the target alone and each method
    without its cell, timed in pairs (`run_paired`) on the engine computing the method's target
    layers (engine_for(layers)), with the target alone on that engine; the cells go into
    data["cells"] and the cache after each (domain, temperature), this run's date, machine and
    command into data["runs"]. At T = 0 every method's output must equal the target's.
    Returns the loaded drafter models by checkpoint."""
    from tqdm import tqdm

    cells = data["cells"]
    run_id = datetime.datetime.now().isoformat(timespec="seconds")
    wanted = lambda m, d, t: m.runs_at(t) and cell_key(m.name, d, t) not in cells  # noqa: E731
    layers = {m.name: feature_layers_of(m, args.target) for m in methods}
    todo = [(d, t) for t in temps for d in by_domain if any(wanted(m, d, t) for m in methods)]

    def groups(d, t) -> dict[tuple, list[Method]]:
        out: dict[tuple, list[Method]] = {}
        for m in methods:
            if wanted(m, d, t):
                out.setdefault(layers[m.name], []).append(m)
        return out

    n_units = args.repeats * sum(
        len(by_domain[d]) * sum(1 + len(g) for g in groups(d, t).values()) for d, t in todo
    )
    models: dict = {}
    bar = tqdm(total=n_units, desc="eval", unit="prompt", disable=args.no_progress)
    warmed: set = set()
    n_warm = min(4, args.max_new_tokens)
    try:
        for d, t in todo:
            ps = by_domain[d]
            for key, todo_methods in groups(d, t).items():
                engine = engine_for(key)
                runners = {"target alone": Runner()}
                for m in todo_methods:
                    runners[m.name] = Runner(
                        make_proposer(m, args.target, engine, args.device, models, args.compile),
                        m.steps,
                        m.tree_blocks,
                        m.tree_sampling,
                        m.top_m,
                        m.sibling_depth,
                    )
                for name, r in runners.items():
                    if (key, name) not in warmed:  # first-call costs stay out of the timings
                        warmed.add((key, name))
                        run_paired(engine, ps[:1], t, n_warm, args.seed, {name: r}, 1)
                bar.set_description(f"{d} | T={t:g} | {len(runners)} runs per prompt")
                runs = run_paired(
                    engine, ps, t, args.max_new_tokens, args.seed, runners, args.repeats, bar
                )
                base = runs["target alone"]
                for m in todo_methods:
                    r = runs[m.name]
                    if t == 0:
                        bad = [
                            p["id"] for p, a, b in zip(ps, r["outputs"], base["outputs"]) if a != b
                        ]
                        assert not bad, (
                            f"{m.name}: greedy output differs from the target's on prompts {bad} ({d})"
                        )
                    cells[cell_key(m.name, d, t)] = make_cell(
                        m.name, d, t, len(ps), r, base, run_id
                    )
                data.setdefault("runs", {})[run_id] = run
                save_cache(cache_path, data)
    finally:
        bar.close()
    return models


def make_cell(method: str, domain: str, t: float, n_prompts: int, r, base, run_id: str) -> dict:
    """One cell from the paired runs of a method (r) and of the target alone (base)."""
    return {
        "method": method,
        "domain": domain,
        "temperature": t,
        "n_prompts": n_prompts,
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
        "cond_den": r["cond_den"],
        "cond_num": r["cond_num"],
        "prompt_drafts": r["prompt_drafts"],
        "prompt_accepted": r["prompt_accepted"],
        **gamma_and_speedup_ci(r, base),
        "greedy_equal": True if t == 0 else None,
        "run": run_id,
    }


def check_dflash_shuffle(cells: dict, domains: list[str], temps: list[float]) -> None:
    """DFlash ignores the noise: its shuffle pair must be identical."""
    for d in domains:
        for t in temps:
            a, b = cells.get(cell_key("dflash", d, t)), cells.get(cell_key("dflash-indep", d, t))
            if a and b:
                assert (a["accepted"], a["drafts"]) == (b["accepted"], b["drafts"]), (
                    f"DFlash shuffle Delta is not 0 ({d}, T={t:g}): "
                    "the baseline must ignore the noise"
                )
