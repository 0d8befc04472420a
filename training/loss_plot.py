"""The loss plots of a training run: loss.csv drawn as loss.png, and the figure style the
training and research plots share.
"""

from __future__ import annotations

import csv
from pathlib import Path


def plot_losses(csv_path: Path, png_path: Path, cols: list[str] | None = None) -> None:
    """Plot of the loss columns of csv_path (default: every column but step, lr, elapsed_s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    cols = cols or [c for c in rows[0] if c not in ("step", "lr", "elapsed_s")]
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cols:
        ys = [float(r[c]) if r[c] not in ("", "nan") else float("nan") for r in rows]
        ax.plot(steps, ys, label=c)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if all(float(r["loss"]) > 0 for r in rows):
        ax.set_yscale("log")
    save_figure(fig, ax, csv_path.parent.name, png_path)


def save_figure(fig, ax, title: str, png_path: Path) -> None:
    """Title, legend and grid on ax, then fig written to png_path and closed."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
