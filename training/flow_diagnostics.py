"""Diagnostics that tell whether a FlashMap drafter is a flow, and its offline acceptance.

`diagnose` runs, on the held-out anchors of a drafter data directory (training.heldout), per
FlashMap drafter its denoiser curve (training.denoiser_curve, with the DFlash-style drafter
as the prior), and per drafter, step count and temperature the offline acceptance
(training.offline_acceptance) of the shared-noise block and its shuffles (training.shuffle_test),
with paired bootstrap intervals; `report_markdown` makes its tables. `flashmap eval
--flow-data` runs it on the evaluated FlashMap checkpoints.

    python -m training.flow_diagnostics --target checkpoints/demo-target \
        --data runs/test-greedy --drafter flow=runs/flow --dflash checkpoints/demo-dflash-eq --out runs/diag.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.denoiser_curve import denoiser_curve, format_curve, time_map_table
from training.heldout import heldout_batches, heldout_sequences
from training.offline_acceptance import agreement, offline_acceptance
from training.shuffle_test import paired_bootstrap


@dataclass
class DrafterSpec:
    name: str
    path: str
    steps: tuple[int, ...] = (1,)
    # FlashMapProposer's drafting of T = 0 rows ("argmax": mode-seeking, a departure; None: soft)
    greedy_estimate: str | None = None
    greedy_noise_scale: float | None = None  # None: the paper's 1 (0: the zero state)


def diagnose(
    target: str | Path,
    data: str | Path,
    prompts: str | Path,
    drafters: list[DrafterSpec],
    dflash: str | Path | None = None,
    temperatures: tuple[float, ...] = (0.0,),
    *,
    max_anchors: int | None = None,
    domains: tuple[str, ...] | None = None,
    curve: bool = True,
    device: str = "cpu",
    progress: bool = False,
    seed: int = 0,
    averaged: bool = False,
) -> dict:
    """Everything this module measures, on the held-out anchors of `data` (training.drafter_data
    run on `prompts` with the target: dev prompts to choose, test to report): per FlashMap
    drafter its denoiser curve (with the DFlash-style drafter as the prior), and per drafter,
    step count and temperature the offline acceptance (shared noise, permutation and per-slot
    shuffles, by domain), the share of slots a second draw changes, agreement with the
    DFlash-style drafter and paired bootstrap differences against it. averaged: Delta
    also from all K runs and their K cyclic shuffles (offline_acceptance)."""
    from drafter_service.checkpoint import load_drafter
    from drafter_service.flashmap_proposer import FlashMapProposer
    from target_service.engine import TargetEngine

    seqs = heldout_sequences(data, prompts, target, domains=domains)
    engine = TargetEngine(target, n_slots=16, device=device)
    K = None
    base = load_drafter(dflash, target, device=device) if dflash else None
    models = {d.name: load_drafter(d.path, target, device=device) for d in drafters}
    res: dict = dict(n_sequences=len(seqs), curves={}, acceptance=[])
    runs: dict = {}
    for name, m in [("dflash", base)] * (base is not None) + list(models.items()):
        K = m.cfg.block_size
        spec = next((d for d in drafters if d.name == name), DrafterSpec(name, ""))
        steps = (1,) if m.cfg.kind == "dflash" else spec.steps
        prop = FlashMapProposer(
            m,
            n_slots=16,
            max_context=engine.max_seq_len,
            device=device,
            greedy_estimate=spec.greedy_estimate,
            greedy_noise_scale=spec.greedy_noise_scale,
        )
        for T in temperatures:
            for n in steps:
                runs[(name, n, T)] = offline_acceptance(
                    engine,
                    prop,
                    seqs,
                    temperature=T,
                    steps=n,
                    max_anchors=max_anchors,
                    seed=seed,
                    progress=progress,
                    averaged=averaged,
                )
        if curve and m.cfg.kind == "flashmap":
            res["curves"][name] = denoiser_curve(m, heldout_batches(seqs, K, seed=seed), prior=base)
    for (name, n, T), a in runs.items():
        row = dict(
            drafter=name,
            steps=n,
            temperature=T,
            anchors=len(a.seq),
            noise_changes=float(a.changed.mean()),
        )
        doms = sorted(set(a.domain))
        dom = np.array(a.domain)
        for d in doms + ["all"]:
            sel = np.ones(len(dom), bool) if d == "all" else dom == d
            row[f"gamma_{d}"] = paired_bootstrap(
                a.gamma["shared"][sel], clusters=a.seq[sel], seed=seed
            )
            for v in ("perm", "slot_noise"):
                if v in a.gamma:
                    row[f"delta_{v}_{d}"] = paired_bootstrap(
                        a.gamma["shared"][sel], a.gamma[v][sel], a.seq[sel], seed=seed
                    )
            if "perm_avg" in a.gamma:
                row[f"avg_gamma_{d}"] = paired_bootstrap(
                    a.gamma["shared_avg"][sel], clusters=a.seq[sel], seed=seed
                )
                row[f"delta_perm_avg_{d}"] = paired_bootstrap(
                    a.gamma["shared_avg"][sel], a.gamma["perm_avg"][sel], a.seq[sel], seed=seed
                )
            ref = runs.get(("dflash", 1, T))
            if ref is not None and name != "dflash":
                row[f"vs_dflash_{d}"] = paired_bootstrap(
                    a.gamma["shared"][sel], ref.gamma["shared"][sel], a.seq[sel], seed=seed
                )
        if ("dflash", 1, T) in runs and name != "dflash":
            row["agree_dflash"] = agreement(a, runs[("dflash", 1, T)])
        res["acceptance"].append(row)
    return res


def _ci(d: dict) -> str:
    return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"


def report_markdown(res: dict) -> str:
    """Tables of a `diagnose` result."""
    lines = []
    for name, curve in res["curves"].items():
        lines += [
            f"Denoiser of `{name}` against tau (its own time map), per-slot accuracy:",
            "",
            "```",
            format_curve(curve),
            "```",
            "",
        ]
    rows = res["acceptance"]
    if rows:
        doms = sorted(
            {k[len("gamma_") :] for r in rows for k in r if k.startswith("gamma_")} - {"all"}
        ) + ["all"]
        lines += [
            "| drafter | steps | T | "
            + " | ".join(f"gamma {d}" for d in doms)
            + " | Delta perm (all) | Delta perm, K draws averaged (all) | Delta per-slot noise (all) "
            "| vs DFlash (all) | slots a new draw changes | agrees with DFlash |",
            "|---|---:|---:|" + "---:|" * (len(doms) + 6),
        ]
        for r in rows:
            cell = lambda k: _ci(r[k]) if k in r else "-"  # noqa: E731
            lines.append(
                f"| {r['drafter']} | {r['steps']} | {r['temperature']:g} | "
                + " | ".join(cell(f"gamma_{d}") for d in doms)
                + f" | {cell('delta_perm_all')} | {cell('delta_perm_avg_all')} | {cell('delta_slot_noise_all')} "
                f"| {cell('vs_dflash_all')} "
                f"| {r['noise_changes']:.3f} | {r.get('agree_dflash', float('nan')):.3f} |"
            )
        avg = [r for r in rows if "delta_perm_avg_all" in r]
        if avg:
            lines += [
                "",
                "Delta perm per domain (K draws averaged):",
                "",
                "| drafter | steps | T | " + " | ".join(doms) + " |",
                "|---|---:|---:|" + "---:|" * len(doms),
            ]
            lines += [
                f"| {r['drafter']} | {r['steps']} | {r['temperature']:g} | "
                + " | ".join(_ci(r[f"delta_perm_avg_{d}"]) for d in doms)
                + " |"
                for r in avg
            ]
        lines += [
            "",
            f"{rows[0]['anchors']} held-out anchors per row ({res['n_sequences']} sequences); 95% "
            "intervals from a bootstrap over sequences, paired where two rows are compared.",
            "",
        ]
    return "\n".join(lines)


def _spec(text: str) -> DrafterSpec:
    """NAME=DIR[:STEPS,...[:ESTIMATE[:NOISE_SCALE]]] -> DrafterSpec (ESTIMATE, NOISE_SCALE: the
    proposer's greedy_estimate / greedy_noise_scale for T = 0 drafts)."""
    name, _, rest = text.partition("=")
    path, *more = rest.split(":")
    if not name or not path or len(more) > 3:
        raise argparse.ArgumentTypeError(
            f"expected NAME=DIR[:STEPS,...[:ESTIMATE[:NOISE_SCALE]]], got {text!r}"
        )
    steps = tuple(int(x) for x in more[0].split(",")) if more and more[0] else (1,)
    return DrafterSpec(name, path, steps, *(more[1:2] or [None]), *[float(x) for x in more[2:3]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.flow_diagnostics", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", help="training.drafter_data output for --prompts (held-out answers)")
    ap.add_argument("--prompts", default="demo/data/test_prompts.jsonl")
    ap.add_argument(
        "--drafter",
        type=_spec,
        action="append",
        default=[],
        help="NAME=DIR[:STEPS,...[:ESTIMATE[:NOISE_SCALE]]] (repeatable; ESTIMATE soft|argmax and "
        "NOISE_SCALE: how T = 0 blocks are drafted, FlashMapProposer greedy_estimate / "
        "greedy_noise_scale)",
    )
    ap.add_argument(
        "--dflash", help="DFlash-style checkpoint: the baseline, prior and agreement reference"
    )
    ap.add_argument("--temperature", type=float, action="append", help="repeatable (default 0)")
    ap.add_argument("--max-anchors", type=int, help="at most this many anchors per sequence")
    ap.add_argument("--domain", action="append", help="only these domains (repeatable)")
    ap.add_argument("--no-curve", action="store_true")
    ap.add_argument(
        "--time-maps",
        action="store_true",
        help="only print where the vocabulary map puts tau and what the embedded state tells there",
    )
    ap.add_argument(
        "--averaged",
        action="store_true",
        help="Delta also averaged over all K shared-noise runs and their K cyclic shuffles "
        "(2K - 2 more target verifies per anchor)",
    )
    ap.add_argument("--out", help="JSON result (a .md table beside it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.time_maps:
        from flashmap.checkpoint import load_embeddings

        print(
            f"{'tau':>5} {'t (vocab map)':>14} {'P argmax x_t':>13} {'P Bayes y_t':>12} {'t (embedded map)':>17}"
        )
        for r in time_map_table(load_embeddings(args.target)[0].float()):
            print(
                f"{r['tau']:5.2f} {r['t_vocab']:14.4f} {r['p_vocab']:13.3f} {r['p_embedded']:12.3f} "
                f"{r['t_embedded']:17.4f}"
            )
        return 0
    if not args.out or not args.data:
        ap.error("--data and --out are required (but for --time-maps)")
    try:
        res = diagnose(
            args.target,
            args.data,
            args.prompts,
            args.drafter,
            args.dflash,
            tuple(args.temperature or [0.0]),
            max_anchors=args.max_anchors,
            domains=tuple(args.domain) if args.domain else None,
            curve=not args.no_curve,
            device=args.device,
            progress=True,
            averaged=args.averaged,
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = report_markdown(res)
    out.with_suffix(".md").write_text(
        md
        + "\n```\npython -m training.flow_diagnostics "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "\n```\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
