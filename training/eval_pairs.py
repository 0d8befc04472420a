"""Paired gamma differences between two methods of `flashmap eval` cell caches, by domain and
pooled over the domains, with 95% intervals over prompts (resampled in pairs).

    python -m training.eval_pairs runs/eval-test-s60/eval_cells.json \
        --pair flashmap-1:dflash --pair flashmap-2:flashmap-1 --temperatures 0,1

A method may come from another cache of the same prompts (`NAME@CELLS`), e.g. the served
checkpoint's row beside a new one: `flashmap-1@docs/results/eval_test/eval_cells.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from flashmap.measure import bootstrap_ci


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())["cells"]


def paired(cells_a: list[dict], cells_b: list[dict], seed: int = 0) -> dict:
    """gamma(a) - gamma(b) over the prompts of the given cells (one per domain, in the same
    order for a and b): the difference of the pooled gammas, and its interval."""
    acc_a = np.concatenate([np.asarray(c["prompt_accepted"], float) for c in cells_a])
    dr_a = np.concatenate([np.asarray(c["prompt_drafts"], float) for c in cells_a])
    acc_b = np.concatenate([np.asarray(c["prompt_accepted"], float) for c in cells_b])
    dr_b = np.concatenate([np.asarray(c["prompt_drafts"], float) for c in cells_b])
    if len(acc_a) != len(acc_b):
        raise ValueError("the two methods were measured on different prompts")

    def gamma(acc, dr, i):
        return 1 + acc[i].sum() / dr[i].sum() if dr[i].sum() else float("nan")

    def diff(i):
        return gamma(acc_a, dr_a, i) - gamma(acc_b, dr_b, i)

    every = np.arange(len(acc_a))
    lo, hi = bootstrap_ci(diff, len(acc_a), seed=seed)
    return dict(
        a=gamma(acc_a, dr_a, every), b=gamma(acc_b, dr_b, every), diff=diff(every), ci=(lo, hi)
    )


def method_cells(spec: str, default: dict) -> tuple[str, str, dict]:
    """(method, its label, its cells): NAME, or NAME@CELLS labelled by the cache's folder."""
    name, _, path = spec.partition("@")
    if not path:
        return name, name, default
    return name, f"{name} ({Path(path).parent.name})", load(path)


def table(cells: dict, pairs: list[str], temperatures: list[float]) -> list[str]:
    domains = sorted({k.split("|")[1] for k in cells})
    lines = [
        "| a | b | T | " + " | ".join(domains) + " | pooled |",
        "|---|---|---:|" + "---:|" * (len(domains) + 1),
    ]
    for pair in pairs:
        (a, la, ca), (b, lb, cb) = (method_cells(s, cells) for s in pair.split(":"))
        for t in temperatures:
            key = lambda m, d: f"{m}|{d}|T={t:g}"  # noqa: E731
            doms = [d for d in domains if key(a, d) in ca and key(b, d) in cb]
            if not doms:
                continue
            out = []
            for d in domains:
                if d in doms:
                    r = paired([ca[key(a, d)]], [cb[key(b, d)]])
                    out.append(f"{r['diff']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]")
                else:
                    out.append("n/a")
            r = paired([ca[key(a, d)] for d in doms], [cb[key(b, d)] for d in doms])
            pooled = f"{r['a']:.2f} - {r['b']:.2f} = {r['diff']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]"
            lines.append(f"| {la} | {lb} | {t:g} | " + " | ".join(out) + f" | {pooled} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.eval_pairs", description=__doc__)
    ap.add_argument("cells", help="eval_cells.json of `flashmap eval`")
    ap.add_argument("--pair", action="append", required=True, help="A:B, each NAME or NAME@CELLS")
    ap.add_argument("--temperatures", default="0,1")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    temps = [float(t) for t in a.temperatures.split(",")]
    print("\n".join(table(load(a.cells), a.pair, temps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
