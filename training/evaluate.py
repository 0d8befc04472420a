"""`flashmap eval`: acceptance length and speedup of the drafters on the held-out prompts.

For a target and drafter checkpoints (FlashMap flow map, its flow-stage teacher,
DFlash-style, EAGLE-style), per domain of the held-out prompts (code, math, chat) and
per temperature (0 and 1), every prompt is decoded at concurrency 1 with
`flashmap.inprocess.decode`, once by the target alone (proposer=None) and once per
method, in the same process (a method whose drafter reads other target layers than the rest
runs on an engine computing those, with its own target-alone runs in the same rotation):

    flashmap-1      FlashMap, one flow-map jump 0 -> 1
    flashmap-2      FlashMap, two jumps
    flow-N          the teacher flow, N Euler steps of the ODE (--teacher, else the
                    distilled model's diagonal)
    dflash          the DFlash-style baseline (one pass over a masked block)
    eagle           the EAGLE-3-style autoregressive chain (drafter_service.eagle)
    dflash-published  DFlash as published (z-lab's architecture and layout, --dflash-published)
    eagle3-tree16   EAGLE-3 as published (--eagle3): a tree of 16 tokens at T = 0 (EAGLE-2's
                    dynamic tree, depth 6, top 4), a chain of 16 when sampling
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

Timing is paired (`flashmap.measure.run_paired`): each prompt is decoded by the target
alone and by every method back to back, --repeats times in rotating order, and per prompt
the fastest run of each counts, so a slow stretch of a shared machine hits a method and its
baseline alike. Resumable: the cells of each finished (domain, temperature) are written to
a JSON cache (--cache) and skipped by the next run with the same settings; a (domain,
temperature) with missing cells re-measures the target alone, so a speedup always compares
runs of one process. Writes docs/results/eval.md (command, date, machine, every cell) and
two PNG plots (training.eval_report); the methods are built in training.eval_methods.

    python -m training.evaluate --target checkpoints/demo-target --flashmap runs/map \
        --teacher runs/flow --dflash runs/dflash --eagle runs/eagle --max-prompts 8 --max-new-tokens 128

--compile runs every drafter through torch.compile (FlashMapProposer / EagleProposer
.enable_compile, the CPU counterpart of the drafter's CUDA graphs; the published layouts
have no compiled path and run eagerly); the target runs eagerly, alone and when verifying alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

from flashmap.checkpoint import read_config
from flashmap.measure import machine, run_paired, run_prompts
from flashmap.prompts import HELDOUT_PROMPTS, read_domain_prompts
from training.eval_methods import (
    Method,
    build_methods,
    describe,
    feature_layers_of,
    make_proposer,
)
from training.eval_report import (
    REPO,
    cell_key,
    load_cache,
    save_cache,
    show_path,
    write_plots,
    write_report,
)

DEFAULT_OUT = REPO / "docs" / "results"
DOMAIN_ORDER = ("code", "math", "chat")


# ----------------------------------------------------------------------------- inputs


def read_prompts(args) -> tuple[dict[str, list[dict]], list[str]]:
    """The prompts of --prompts by domain (--domains, default every domain in DOMAIN_ORDER
    first), the first --max-prompts of each; and the domains."""
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
    return by_domain, domains


def fit_prompts(args, methods: list[Method], by_domain: dict) -> tuple[int, int, int]:
    """The context the engine needs (the longest prompt, the new tokens, the largest draft
    tree), within the target's positions; prompts that do not fit are cut to their last
    tokens, in place. Returns (block size K, max_seq_len, prompts cut)."""
    max_pos = int(read_config(args.target).get("max_position_embeddings", 4096))
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
    return K, max_seq_len, truncated


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


# ----------------------------------------------------------------------------- measuring


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
                runners = {"target alone": (None, 1, 1)}
                for m in todo_methods:
                    runners[m.name] = (
                        make_proposer(m, args.target, engine, args.device, models, args.compile),
                        m.steps,
                        m.tree_blocks,
                    )
                for name, (p, steps, tree) in runners.items():
                    if (key, name) not in warmed:  # first-call costs stay out of the timings
                        warmed.add((key, name))
                        run_prompts(engine, ps[:1], t, n_warm, args.seed, p, steps, None, tree)
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


def describe_drafters(methods: list[Method], models: dict, target: str) -> dict[str, str]:
    """Per checkpoint (as the report shows its path): kind, architecture, parameters."""
    drafters = {}
    for m in methods:
        if show_path(m.checkpoint) not in drafters:
            model = models.get(m.checkpoint)
            if model is None:
                from drafter_service.factory import load_model

                model = load_model(m.checkpoint, target)
            drafters[show_path(m.checkpoint)] = describe(m, model, target)
    return drafters


# ----------------------------------------------------------------------------- main


def evaluate(args, command: str) -> Path:
    """Measure what the cache lacks, then write eval.md and the plots; returns eval.md."""
    from target_service.engine import TargetEngine

    methods, notes = build_methods(args)
    temps = [float(x) for x in args.temperatures.split(",") if x.strip()]
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"--temperatures must be >= 0, got {args.temperatures!r}")
    by_domain, domains = read_prompts(args)
    K, max_seq_len, truncated = fit_prompts(args, methods, by_domain)
    engines: dict[tuple, TargetEngine] = {}  # by the target layers the drafters read

    def engine_for(layers: tuple) -> TargetEngine:
        if layers not in engines:
            engines[layers] = TargetEngine(
                args.target, 1, max_seq_len, device=args.device, feature_layers=list(layers)
            )
        return engines[layers]

    engine = engine_for(feature_layers_of(methods[0], args.target))
    cache_path = Path(args.cache) if args.cache else Path(args.out_dir) / "eval_cells.json"
    data = load_cache(cache_path, cache_settings(args, methods, by_domain), args.fresh)
    run = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command}
    models = measure(args, engine_for, methods, by_domain, temps, data, cache_path, run)
    check_dflash_shuffle(data["cells"], domains, temps)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {
        **run,
        "target": show_path(args.target),
        "target_desc": f"{engine.num_layers} layers, hidden {engine.hidden_size}, "
        f"vocab {engine.vocab_size}",
        "device": args.device,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "block_size": K,
        "repeats": args.repeats,
        "compile": args.compile,
        "top_m": 4,
        "prompts": show_path(args.prompts),
        "counts": {d: len(ps) for d, ps in by_domain.items()},
        "truncated": truncated,
        "drafters": describe_drafters(methods, models, args.target),
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
        "--dflash-published",
        help="a DFlash checkpoint in the published layout (z-lab's DFlashDraftModel)",
    )
    ap.add_argument(
        "--eagle3",
        help="an EAGLE-3 checkpoint in the published layout (LlamaForCausalLMEagle3): a tree of "
        "16 at T = 0, a chain when sampling",
    )
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
