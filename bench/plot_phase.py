"""Plot the code cell's speedup against the VM's phase from docs/results/bench_drafters.md.

Reads the tables of its "Speed against the VM's phase" section (one per set of demo
checkpoints: the first is the current one) and writes bench_phase.png next to it: speedup of
FlashMap 1 step, plain and cut at confidence 0.2, against the target alone's milliseconds per
token in the same run.

    python -m bench.plot_phase [--md docs/results/bench_drafters.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SECTION = "## Speed against the VM's phase"
LABELS = ("round three (current checkpoints)", "round one (earlier checkpoints)")


def phase_tables(md: str) -> list[list[tuple[float, float | None, float | None]]]:
    """Per table of the section: rows (ms per token, FlashMap 1 step, cut at 0.2); '-' = None."""
    body = md.split(SECTION, 1)[1].split("\n## ", 1)[0]
    speed = lambda c: None if c == "-" else float(c.rstrip("x"))  # noqa: E731
    tables, rows, in_table = [], [], False
    for line in body.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|")
            else None
        )
        if cells and cells[0] != "run" and not set(cells[0]) <= set("-:"):
            rows.append((float(cells[1]), speed(cells[2]), speed(cells[3])))
            in_table = True
        elif not cells and in_table:
            tables.append(rows)
            rows, in_table = [], False
    if rows:
        tables.append(rows)
    return tables


def plot(tables, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    styles = [dict(fillstyle="full", alpha=1.0), dict(fillstyle="none", alpha=0.7)]
    for i, rows in enumerate(tables[:2]):
        for col, marker, color, name in (
            (2, "o", "tab:blue", "cut at 0.2"),
            (1, "s", "tab:orange", "plain"),
        ):
            pts = [(r[0], r[col]) for r in rows if r[col] is not None]
            if pts:
                ax.plot(
                    *zip(*pts),
                    linestyle="none",
                    marker=marker,
                    color=color,
                    markersize=7,
                    label=f"FlashMap 1 step, {name}: {LABELS[i]}",
                    **styles[i],
                )
    ax.axhline(1.5, color="gray", linestyle="--", linewidth=1, label="goal 1.5x")
    ax.set_xlabel("target alone, ms per token (higher = VM slower)")
    ax.set_ylabel("speedup over the target alone")
    ax.set_title("Code, T = 0: speedup against the VM's phase")
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.plot_phase", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--md", default="docs/results/bench_drafters.md")
    args = ap.parse_args(argv)
    md = Path(args.md)
    tables = phase_tables(md.read_text())
    if not tables:
        print(f"error: {md}: no tables under {SECTION!r}", file=sys.stderr)
        return 2
    out = md.with_name("bench_phase.png")
    plot(tables, out)
    print(f"{out}: {', '.join(str(len(t)) for t in tables)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
