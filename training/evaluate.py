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
    eagle3-chain16  EAGLE-3's chain of 16 (T > 0)
    *-treeN         FlashMap 1 step / DFlash-style, N blocks (--tree-blocks) from independent
                    noise verified as one tree; *-treeN-rejection: each block a chain with its
                    proposal law, multi-draft rejection sampling (T > 0)
    *-siblings      one block (EAGLE-3: its chain) with each drafted token's other top-m tokens
                    beside it as leaves, multi-draft rejection sampling (T > 0; with any
                    --tree-blocks)
    *-siblings-dN   the same with leaves beside the first N depths only (--sibling-depth)
    *-mN            a single draft or *-siblings row with support top-N (--top-m; T > 0)
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
two PNG plots (training.eval_report); the methods are built in training.eval_methods, the
prompts read in training.eval_prompts and the cells measured in training.eval_cells.

    python -m training.evaluate --target checkpoints/demo-target --flashmap runs/map \
        --teacher runs/flow --dflash runs/dflash --eagle runs/eagle --max-prompts 8 --max-new-tokens 128

--compile runs every drafter through torch.compile (FlashMapProposer / EagleProposer
.enable_compile, the CPU counterpart of the drafter's CUDA graphs; the published layouts
have no compiled path and run eagerly); the target runs eagerly, alone and when verifying alike.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

from flashmap.drafts import TOP_M
from flashmap.measure import machine
from flashmap.prompts import TEST_PROMPTS
from training.eval_cells import cache_settings, check_dflash_shuffle, measure
from training.eval_methods import Method, build_methods, describe, feature_layers_of
from training.eval_prompts import fit_prompts, read_prompts
from training.eval_report import REPO, load_cache, show_path, write_plots, write_report

DEFAULT_OUT = REPO / "docs" / "results"


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
        "top_m": TOP_M,
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
        "--dflash-sampling",
        help="a DFlash-style drafter trained on the target's sampled answers (rows dflash-t1...)",
    )
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
        default="4",
        help="comma-separated N: FlashMap (and DFlash-style) 1 jump with N blocks from "
        "independent noise verified as one tree, every temperature (empty: no tree rows)",
    )
    ap.add_argument(
        "--top-m",
        default="4",
        help="comma-separated support sizes per slot at T > 0: rows other than 4 repeat each "
        "drafter's single draft and its block with siblings with that support (T > 0 only)",
    )
    ap.add_argument(
        "--sibling-depth",
        default="0",
        help="comma-separated N: rows other than 0 repeat each *-siblings row with its leaves "
        "beside the drafted tokens of the first N depths only (T > 0)",
    )
    ap.add_argument(
        "--prompts", default=str(TEST_PROMPTS), help="JSONL: domain + prompt (or prompt_ids)"
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
    try:
        args.tree_blocks = [int(x) for x in args.tree_blocks.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--tree-blocks takes comma-separated integers, got {args.tree_blocks!r}")
    try:
        args.top_m = [int(x) for x in args.top_m.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--top-m takes comma-separated integers, got {args.top_m!r}")
    if any(m < 1 for m in args.top_m):
        ap.error(f"--top-m sizes must be >= 1, got {args.top_m}")
    try:
        args.sibling_depth = [int(x) for x in args.sibling_depth.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sibling-depth takes comma-separated integers, got {args.sibling_depth!r}")
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
