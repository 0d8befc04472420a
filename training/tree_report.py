"""Trees at T > 0 from `flashmap eval`'s cells: each tree row beside the single draft of the same
drafter, paired prompt by prompt (docs/results/trees.md).

    python -m training.tree_report docs/results/eval_test/eval_cells.json \
        --dev runs/eval-dev-trees/eval_cells.json --out docs/results/trees.md

Several cell files of runs that differ only in `--seed` are pooled prompt by prompt: a prompt's
samples add up to one unit, so the intervals still resample prompts (docs/results/trees/seeds);
runs with the same seed and other rows (another drafter's) join first.

Per domain and tree row: gamma and speedup with 95% intervals over prompts, the paired
difference of gamma against the drafter's own single draft (the prompts resampled together),
and what a GPU verify would keep: on an H200 a verify of 17 tokens costs 1.03 target steps and
one of 272 tokens 1.81 (docs/results/gpu_h200.md, Qwen3-8B shape, bf16), so a round of a tree
of n tokens costs about a step x (1.03 + (n - 17) x 0.78 / 255) plus a draft, and the speedup
there is gamma x step / that, a projection from those kernel times, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from flashmap.measure import bootstrap_ci

# The H200 kernel times of docs/results/gpu_h200.md (Qwen3-8B shape, bf16, batch 1): a target
# step, and one jump of the paper-size drafter; a verify of 17 and of 272 tokens in batch-1 steps.
H200_STEP_MS, H200_DRAFT_MS = 5.62, 2.33
H200_VERIFY_STEPS = {17: 1.03, 272: 1.81}

# (family, its single draft's row, its rows' kind)
FAMILIES = (
    ("FlashMap (1 jump)", "flashmap-1", "flashmap"),
    ("DFlash-style", "dflash", "dflash"),
    ("DFlash-style, trained on sampled answers", "dflash-t1", "dflash-t1"),
    ("EAGLE-style chain", "eagle", "eagle"),
    ("EAGLE-3", "eagle3-chain16", "eagle3"),
)
RULES = {None: "pick", "rejection": "rejection", "siblings": "rejection + siblings"}


def tree_row(method: str) -> tuple[str, str, int, str] | None:
    """(family, its single draft's row, blocks, verified by) of a tree row of `flashmap eval`
    (training.eval_methods: `<kind>-tree<n>[-rejection]`, `<kind>-siblings[-d<D>][-m<N>]`, EAGLE-3's
    `eagle3-tree16`); None for any other row. A row with support top-N (-mN) is set against
    the single draft with that support."""
    base, m_suffix = support_of(method)
    for family, single, kind in FAMILIES:
        m = re.fullmatch(rf"{kind}-(?:tree(\d+))?-?(rejection|siblings)?(?:-d(\d+))?", base)
        if m and (m.group(1) or m.group(2)):
            rule = RULES[m.group(2)]
            if m.group(3):
                rule += f" at depths <= {m.group(3)}"
            rule += f" (top {m_suffix[2:]})" if m_suffix else ""
            return family, single + m_suffix, int(m.group(1) or 1), rule
    return None


def support_of(method: str) -> tuple[str, str]:
    """A row's name without its support suffix, and the suffix ('-m16'; '' for top-4)."""
    m = re.fullmatch(r"(.+?)(-m\d+)?", method)
    return m.group(1), m.group(2) or ""


def paired_gamma_diff(a: dict, b: dict, seed: int = 0) -> tuple[float, float, float]:
    """gamma(a) - gamma(b) over the same prompts, with a 95% interval (prompts resampled in
    pairs)."""
    acc_a, dr_a = np.asarray(a["prompt_accepted"], float), np.asarray(a["prompt_drafts"], float)
    acc_b, dr_b = np.asarray(b["prompt_accepted"], float), np.asarray(b["prompt_drafts"], float)

    def diff(i):
        if not dr_a[i].sum() or not dr_b[i].sum():
            return float("nan")
        return acc_a[i].sum() / dr_a[i].sum() - acc_b[i].sum() / dr_b[i].sum()

    lo, hi = bootstrap_ci(diff, len(acc_a), seed=seed)
    return diff(np.arange(len(acc_a))), lo, hi


POOLED = ("accepted", "drafts", "draft_tokens", "rounds", "tokens", "wall_s", "base_tokens")
POOLED += ("base_wall_s", "draft_s", "verify_s")


def cells_by_seed(runs: list[dict]) -> dict[int, dict]:
    """seed -> the cells of the `flashmap eval` runs with that seed (runs with one seed and
    other rows, e.g. another drafter's, join: the same seed decodes a prompt with the same
    draws). Runs on other settings (prompts, target, tokens, ...) or a row's other checkpoint
    are refused, and so is a row twice on one seed: the same samples twice would narrow the
    intervals without new evidence."""
    by_seed: dict[int, dict] = {}
    checkpoint: dict[str, str] = {}
    first = None
    for r in runs:
        st = r["settings"]
        rest = {k: v for k, v in st.items() if k not in ("seed", "checkpoints")}
        first = rest if first is None else first
        diff = sorted(k for k in set(rest) | set(first) if rest.get(k) != first.get(k))
        if diff:
            raise ValueError(f"runs measured on other settings cannot be pooled: {diff}")
        for row, path in st.get("checkpoints", {}).items():
            if checkpoint.setdefault(row, path) != path:
                raise ValueError(f"row {row} from two checkpoints: {checkpoint[row]}, {path}")
        cells = by_seed.setdefault(st["seed"], {})
        twice = sorted(set(cells) & set(r["cells"]))
        if twice:
            raise ValueError(f"runs with the same seed cannot be pooled: {twice[0]} twice")
        cells.update(r["cells"])
    return by_seed


def pool_seeds(runs: list[dict] | dict[int, dict]) -> dict:
    """The cells of `flashmap eval` runs that differ only in their seed (cells_by_seed),
    pooled: per prompt its samples' drafted rounds and accepted tokens summed (the prompt
    stays the unit the intervals resample), totals summed, gamma and its interval computed
    again, the speedup as the pooled ratio of tokens/s (no interval: the cells keep no
    per-prompt times). Only rows every seed holds are kept. runs: or cells_by_seed's answer."""
    by_seed = runs if isinstance(runs, dict) else cells_by_seed(runs)
    if len(by_seed) == 1:
        return next(iter(by_seed.values()))
    out = {}
    for key in set.intersection(*(set(c) for c in by_seed.values())):
        cs = [cells[key] for cells in by_seed.values()]
        c = {k: sum(x[k] for x in cs) for k in POOLED}
        c |= {
            k: np.sum([x[k] for x in cs], 0).tolist() for k in ("prompt_accepted", "prompt_drafts")
        }
        c |= {k: cs[0][k] for k in ("domain", "method", "temperature", "n_prompts") if k in cs[0]}
        c["gamma"] = 1 + c["accepted"] / c["drafts"] if c["drafts"] else float("nan")
        acc, dr = np.asarray(c["prompt_accepted"], float), np.asarray(c["prompt_drafts"], float)
        c["gamma_ci"] = list(bootstrap_ci(lambda i: 1 + acc[i].sum() / dr[i].sum(), len(acc)))
        c["speedup"] = (c["tokens"] / c["wall_s"]) / (c["base_tokens"] / c["base_wall_s"])
        c["samples"] = len(by_seed)
        out[key] = c
    return out


def pair(cells: dict, tree: str, single: str, dom: str, t: str) -> tuple | None:
    """A domain's tree and single-draft rows and the paired gamma difference with its interval
    (None: a row missing)."""
    a, b = cells.get(f"{tree}|{dom}|{t}"), cells.get(f"{single}|{dom}|{t}")
    return (a, b, *paired_gamma_diff(a, b)) if a and b else None


def gpu_projection(gamma: float, verify_tokens: float) -> float:
    """Speedup at batch 1 on an H200 of rounds that commit gamma tokens and verify
    `verify_tokens`: a verify's cost in steps read off the line through the two measured ones."""
    (n0, c0), (n1, c1) = sorted(H200_VERIFY_STEPS.items())
    steps = c0 + max(0.0, verify_tokens - n0) * (c1 - c0) / (n1 - n0)
    return gamma * H200_STEP_MS / (steps * H200_STEP_MS + H200_DRAFT_MS)


def verify_tokens(cell: dict) -> float:
    """Tokens a drafted round verifies, on average: its drafts and the bonus position."""
    return 1 + cell["draft_tokens"] / max(cell["drafts"], 1)


def rows(cells: dict, temperature: float) -> list[dict]:
    """One entry per (domain, family, tree row) with its single draft."""
    out = []
    for key, c in cells.items():
        method, domain, t = key.split("|")
        if float(t[2:]) != temperature:
            continue
        tree = tree_row(method)
        base = tree and cells.get(f"{tree[1]}|{domain}|{t}")
        if base:
            family, _, n, rule = tree
            out.append(dict(domain=domain, family=family, n=n, rule=rule, cell=c, base=base))
    return sorted(out, key=lambda r: (r["domain"], r["family"], r["n"], r["rule"]))


SINGLES = ("flashmap-1", "flashmap-2", "flashmap-trained-1", "flashmap-trained-2", "dflash")
SINGLES += ("dflash-t1",)
SINGLES += ("eagle3-chain16", "eagle", "dflash-published")  # the drafters' single drafts (the
# teacher's many steps are not one)


def dev_best(dev: dict, temperature: float) -> tuple[str, str]:
    """The tree row and the single draft with the highest gamma on the dev prompts, pooled over
    the domains: the pair the test prompts then judge (chosen on dev, never on test)."""
    t = f"T={temperature:g}"
    pooled: dict[str, list[float]] = {}
    for key, c in dev.items():
        method, _, kt = key.split("|")
        if kt == t and (tree_row(method) or support_of(method)[0] in SINGLES):
            acc, dr = pooled.get(method, [0.0, 0.0])
            pooled[method] = [acc + c["accepted"], dr + c["drafts"]]
    gamma = {m: 1 + a / d for m, (a, d) in pooled.items() if d}
    best = lambda ms: max(ms, key=gamma.get)  # noqa: E731
    trees = [m for m in gamma if tree_row(m)]
    return best(trees), best([m for m in gamma if m not in trees])


def write(
    cells: dict,
    out: Path,
    command: str,
    dev: dict | None,
    temperature: float = 1.0,
    check: dict | None = None,
    runs: dict[int, dict] | None = None,
) -> Path:
    """The report; runs: seed -> that run's cells, when `cells` pools several (each run's
    own dev-choice differences then follow the pooled ones)."""

    def ci(c: dict, f: str) -> str:
        if f + "_ci" not in c:  # pooled seeds: no per-prompt times to resample
            return f"{c[f]:.2f}"
        return f"{c[f]:.2f} [{c[f + '_ci'][0]:.2f}, {c[f + '_ci'][1]:.2f}]"

    samples = max((c.get("samples", 1) for c in cells.values()), default=1)
    lines = [
        "# Trees at T > 0",
        "",
        "| domain | drafter | blocks | verified by | gamma | against its single draft "
        "| speedup (this CPU) | tokens verified a round | speedup on an H200 (projected) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows(cells, temperature):
        d, lo, hi = paired_gamma_diff(r["cell"], r["base"])
        lines.append(
            f"| {r['domain']} | {r['family']} | {r['n']} | {r['rule']} | {ci(r['cell'], 'gamma')} | "
            f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}] | {ci(r['cell'], 'speedup')}x | "
            f"{verify_tokens(r['cell']):.0f} | {gpu_projection(r['cell']['gamma'], verify_tokens(r['cell'])):.2f}x |"
        )
    lines += ["", f"Command: `{command}`", ""]
    lines += [
        "Test prompts (`demo/data/test_prompts.jsonl`), T = 1, 64 new tokens, one request at a "
        + (
            f"time, {samples} samples a prompt (runs with other seeds, pooled prompt by prompt: "
            "a prompt's samples are one unit of the intervals; the speedup is the pooled ratio, "
            "without an interval); the cells"
            if samples > 1
            else "time; the cells"
        )
        + " are `flashmap eval`'s (its report beside them has the machine, the date "
        "and every other row). In brackets: 95% intervals over prompts; a difference's are "
        'paired (the prompts resampled together). "pick": the blocks merged into one tree, the '
        'target picks its own token at each node and follows it; "rejection": each block a '
        'chain with its proposal law, multi-draft rejection sampling; "rejection + siblings": '
        "that, with each drafted token's other top-m tokens beside it as leaves (m = 4 unless "
        'the row says; "at depths <= 1": beside the first drafted token only), so a node '
        "accepts with the target's whole mass on the drafter's top m (all exact: "
        "tests/test_lossless.py). A row with a top-m support is set against the single draft "
        "with that support. The EAGLE-3 rows are its dynamic tree of 16 (16 blocks: its nodes) "
        "and its chain of 16 with siblings, against its chain of 16.",
        "",
        f"The H200 column is gamma x {H200_STEP_MS} / (c(n) x {H200_STEP_MS} + {H200_DRAFT_MS}) ms, "
        "n the tokens verified a round and c(n) = 1.03 + (n - 17) x 0.78 / 255 (at least 1.03): "
        "the Qwen3-8B-shape step at batch 1, a verify of 17 tokens (1.03 steps) and of 272 "
        "(10.20 ms, 1.81 steps, compute-bound) and the paper-size drafter's jump of "
        "docs/results/gpu_h200.md, a batch of "
        "N blocks drafted as one (batch 1 is memory-bound). A projection from kernel times, not a "
        "measurement: the GPU proof (scripts/gpu-proof.sh) measures whole loops.",
        "",
    ]
    if dev is not None:
        tree, single = dev_best(dev, temperature)
        lines += [
            "## The dev choice on test: best tree against best single draft",
            "",
            f"Chosen on the dev prompts (gamma pooled over the domains): the tree `{tree}` and the "
            f"single draft `{single}`; on the test prompts, by domain (paired by prompt):",
            "",
            "| domain | tree | single draft | gamma difference |",
            "|---|---:|---:|---:|",
        ]
        t = f"T={temperature:g}"
        judged = []
        for dom in sorted({k.split("|")[1] for k in cells}):
            if p := pair(cells, tree, single, dom, t):
                a, b, d, lo, hi = p
                judged.append((dom, d, lo, hi))
                lines.append(
                    f"| {dom} | {a['gamma']:.2f} | {b['gamma']:.2f} | {d:+.2f} [{lo:+.2f}, {hi:+.2f}] |"
                )
        if judged:
            png = plot_choice(judged, out.with_name(out.stem + "_choice.png"), tree, single)
            lines += ["", f"![gamma difference by domain]({png.name})"]
        else:
            lines[-2:] = ["These cells do not hold both rows."]
    if dev is not None and runs:
        lines += samples_section(runs, *dev_best(dev, temperature), temperature)
    if dev is not None:
        lines += gpu_choice_section(cells, dev, temperature)
    if dev is not None:
        lines += [
            "",
            "## The choice, on dev prompts",
            "",
            "Every tree row and single draft on the dev prompts (`demo/data/dev_prompts.jsonl`; "
            "the `--dev` cells of the command above), gamma pooled over the domains:",
            "",
            "| drafter | blocks | verified by | gamma, dev (pooled) |",
            "|---|---:|---|---:|",
        ]
        for fam, n, rule, g in dev_choice(dev, temperature):
            lines.append(f"| {fam} | {n} | {rule} | {g:.2f} |")
        for m, g in dev_singles(dev, temperature):
            lines.append(f"| {m} | 1 | single draft | {g:.2f} |")
    if check is not None:
        lines += check_section(check)
    out.write_text("\n".join(lines) + "\n")
    return out


def check_section(check: dict) -> list[str]:
    """research.siblings_check's table: at each round's first node, the acceptance observed
    against the rule's p(S), and p(S) against what the drafted token alone would accept."""
    ci = lambda v: f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"  # noqa: E731
    dci = lambda v: f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"  # noqa: E731
    lines = [
        "## The siblings rule on the drafters' own contexts",
        "",
        "| drafter | domain | rounds | accepted at the first node | p(S) predicted | observed - "
        "predicted | sum min(p, q): the drafted token alone | p(S) - sum min(p, q) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for drafter, by_domain in check.items():
        if drafter == "command":
            continue
        for d, s in by_domain.items():
            lines.append(
                f"| {drafter} | {d} | {s['rounds']} | {ci(s['observed'])} | {ci(s['p_support'])} "
                f"| {dci(s['observed_minus_p_support'])} | {ci(s['single'])} | {dci(s['gain'])} |"
            )
    lines += [
        "",
        f"Command: `{check['command']}`",
        "",
        "Every test prompt decoded at T = 1 with siblings; at each round's first node the "
        "target's p and the drafter's q are read off the verify pass. p(S) is the target's mass "
        "on the drafter's top m, what the rule accepts in expectation; a walk that lost mass or "
        "leaves the target never reaches would show observed below predicted. sum min(p, q) is "
        "what the drafted token alone accepts on the same contexts. 95% intervals over prompts "
        "(a prompt's rounds resampled together).",
        "",
    ]
    return lines


def samples_section(samples: dict[int, dict], tree: str, single: str, temperature: float):
    """The dev choice's difference in each pooled run alone: one seed's trajectories should
    not carry the pooled result."""
    t = f"T={temperature:g}"
    doms = sorted({k.split("|")[1] for c in samples.values() for k in c})
    lines = [
        "",
        "Each sample alone (a run with its own seed; the same prompts):",
        "",
        "| seed | " + " | ".join(doms) + " |",
        "|---:|" + "---:|" * len(doms),
    ]
    for seed, cells in sorted(samples.items()):
        row = []
        for dom in doms:
            if p := pair(cells, tree, single, dom, t):
                row.append(f"{p[2]:+.2f} [{p[3]:+.2f}, {p[4]:+.2f}]")
            else:
                row.append("-")
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    return lines


def plot_choice(judged: list[tuple[str, float, float, float]], png: Path, tree: str, single: str):
    """The dev choice's gamma difference per domain with its interval, against 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 1.0 + 0.5 * len(judged)))
    for y, (_, d, lo, hi) in enumerate(judged):
        ax.errorbar(d, y, xerr=[[d - lo], [hi - d]], fmt="o", color="C0", capsize=4)
    ax.axvline(0, color="grey", lw=1, ls="--")
    ax.set_yticks(range(len(judged)), [j[0] for j in judged])
    ax.set_title(f"{tree} - {single}", fontsize=9)
    ax.set_xlabel("gamma difference (95% interval over prompts)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def pooled_projection(cells: dict, method: str, t: str) -> float | None:
    """The projected H200 speedup of a row from its gamma and tokens verified, pooled over the
    domains (None: a domain missing)."""
    cs = [c for k, c in cells.items() if k.startswith(f"{method}|") and k.endswith(f"|{t}")]
    if not cs:
        return None
    drafts = sum(c["drafts"] for c in cs)
    gamma = 1 + sum(c["accepted"] for c in cs) / drafts
    tokens = 1 + sum(c["draft_tokens"] for c in cs) / drafts
    return gpu_projection(gamma, tokens)


def dev_best_gpu(dev: dict, temperature: float) -> tuple[str, str]:
    """The tree row and the single draft with the highest projected H200 speedup on the dev
    prompts, pooled over the domains: the pair for a GPU, where a wider verify costs little."""
    t = f"T={temperature:g}"
    names = {k.split("|")[0] for k in dev if k.endswith(f"|{t}")}
    score = {m: pooled_projection(dev, m, t) for m in names}
    trees = [m for m in names if tree_row(m)]
    singles = [m for m in names if not tree_row(m) and support_of(m)[0] in SINGLES]
    return max(trees, key=score.get), max(singles, key=score.get)


def gpu_choice_section(cells: dict, dev: dict, temperature: float) -> list[str]:
    tree, single = dev_best_gpu(dev, temperature)
    t = f"T={temperature:g}"
    lines = [
        "",
        "## For a GPU: the dev choice by projected H200 speedup",
        "",
        f"Chosen on the dev prompts (the projection pooled over the domains): the tree `{tree}` "
        f"({pooled_projection(dev, tree, t):.3f}x on dev) and the single draft `{single}` "
        f"({pooled_projection(dev, single, t):.3f}x); on the test prompts:",
        "",
        "| domain | tree: gamma / H200 (projected) | single draft: gamma / H200 (projected) "
        "| gamma difference |",
        "|---|---:|---:|---:|",
    ]
    for dom in sorted({k.split("|")[1] for k in cells}):
        if p := pair(cells, tree, single, dom, t):
            a, b, d, lo, hi = p
            pa, pb = (gpu_projection(c["gamma"], verify_tokens(c)) for c in (a, b))
            lines.append(
                f"| {dom} | {a['gamma']:.2f} / {pa:.2f}x | {b['gamma']:.2f} / {pb:.2f}x | "
                f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}] |"
            )
    if lines[-1].startswith("|---"):  # no domain holds both rows
        lines[-2:] = ["These cells do not hold both rows."]
    return lines


def dev_choice(dev: dict, temperature: float) -> list[tuple[str, int, str, float]]:
    """Per family and tree row, gamma pooled over the domains of the dev cells."""
    pooled: dict[tuple, list[float]] = {}
    for r in rows(dev, temperature):
        c = r["cell"]
        acc, dr = pooled.setdefault((r["family"], r["n"], r["rule"]), [0.0, 0.0])
        pooled[(r["family"], r["n"], r["rule"])] = [acc + c["accepted"], dr + c["drafts"]]
    return [(f, n, rule, 1 + a / d) for (f, n, rule), (a, d) in sorted(pooled.items()) if d]


def dev_singles(dev: dict, temperature: float) -> list[tuple[str, float]]:
    t = f"T={temperature:g}"
    out = []
    names = sorted({k.split("|")[0] for k in dev}, key=lambda m: (support_of(m)[1], m))
    for m in [m for m in names if support_of(m)[0] in SINGLES and not tree_row(m)]:
        cs = [c for k, c in dev.items() if k.startswith(f"{m}|") and k.endswith(f"|{t}")]
        if cs:
            out.append((m, 1 + sum(c["accepted"] for c in cs) / sum(c["drafts"] for c in cs)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.tree_report", description=__doc__)
    ap.add_argument(
        "cells",
        nargs="+",
        help="eval_cells.json of `flashmap eval` on the test prompts; several: runs that differ "
        "only in --seed, pooled prompt by prompt",
    )
    ap.add_argument(
        "--dev",
        action="append",
        help="eval_cells.json of the run on the dev prompts (the choice); again for another "
        "run's rows (other drafters), joined",
    )
    ap.add_argument("--out", default="docs/results/trees.md")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--check", help="research.siblings_check's JSON: the siblings rule on real contexts"
    )
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    try:
        by_seed = cells_by_seed([json.loads(Path(c).read_text()) for c in a.cells])
        dev = pool_seeds([json.loads(Path(d).read_text()) for d in a.dev]) if a.dev else None
    except ValueError as e:
        ap.error(str(e))
    cells = pool_seeds(by_seed)
    command = "python -m training.tree_report " + " ".join(argv)
    check = json.loads(Path(a.check).read_text()) if a.check else None
    runs = by_seed if len(by_seed) > 1 else None  # each seed alone beside the pooled rows
    print(write(cells, Path(a.out), command, dev, a.temperature, check, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
