"""What every benchmark shares: the options they take, the statistics of paired runs, and the
report they write.

Options: each is defined once here (`add_options`); a tool picks the ones it takes and its
own defaults.

Statistics: on a shared VM the machine's speed drifts within minutes, so a tool runs the
things it compares back to back and reports ratios within each pair, never ratios of means
from different minutes. `ratio_ci` is the geometric mean of paired ratios with a Student-t
interval on their logs (a ratio and its inverse get mirrored intervals); `bootstrap_ratio` is
the ratio of two sums over paired items (prompts) with a percentile bootstrap interval.

Reports (`write_report`): markdown with the table first, then what was measured, the command
that made it, the date and the machine; a reader's notes below NOTES_MARKER in an existing
report are kept when the tool writes it again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path

import numpy as np

from flashmap.measure import machine

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"

# A report's text from this line on is the reader's: a rerun writes what is above and keeps it.
NOTES_MARKER = "<!-- notes: kept when the report is written again -->"

# name -> (flag, argparse keywords but the default): every option shared by two or more tools.
OPTIONS: dict[str, tuple[str, dict]] = {
    "target": ("--target", dict(help="target checkpoint (default: the demo target)")),
    "drafter": (
        "--drafter",
        dict(help="drafter checkpoint or 'init' (default: the demo FlashMap drafter)"),
    ),
    "max_new_tokens": ("--max-new-tokens", dict(type=int, help="new tokens per request")),
    "prompts": ("--prompts", dict(type=int, help="prompts per set")),
    "repeats": ("--repeats", dict(type=int, help="runs of each thing compared, alternated")),
    "threads": (
        "--threads",
        dict(type=int, help="torch threads of this process (0: the stack's, half the cores)"),
    ),
    "out": ("--out", dict(type=Path, help="report to write (markdown)")),
}


def parser(module: str, doc: str, **defaults) -> argparse.ArgumentParser:
    """A tool's parser (`python -m module`, its docstring as the help) with the shared options
    named in `defaults`."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(ap, **defaults)
    return ap


def add_options(ap: argparse.ArgumentParser, **defaults) -> None:
    """Add the shared options named in `defaults` (name=default) to a tool's parser."""
    for name, default in defaults.items():
        flag, kw = OPTIONS[name]
        ap.add_argument(flag, default=default, **kw)


def set_threads(n: int) -> int:
    """Torch threads of this process, and of the processes it starts (OMP_NUM_THREADS, set
    before torch starts its pool); 0: the stack's default. Returns the number."""
    if n <= 0:
        from flashmap_cli.stack import threads_per_service

        n = threads_per_service()
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)
    return n


# ----------------------------------------------------------------------------- statistics


def ratio_ci(ratios) -> tuple[float, float, float]:
    """(geometric mean, 95% interval) of paired ratios: Student's t on their logs. One ratio
    gives no interval (nan)."""
    from scipy.stats import t as student_t

    logs = np.log(np.asarray(ratios, float))
    m = float(logs.mean())
    if len(logs) < 2:
        return float(np.exp(m)), float("nan"), float("nan")
    half = float(student_t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs)))
    return float(np.exp(m)), float(np.exp(m - half)), float(np.exp(m + half))


def bootstrap_ratio(num, den, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(sum(num) / sum(den), 95% percentile interval) resampling the items in pairs: for a
    speedup, num the baseline's seconds per prompt and den the method's."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    ratio = float(num.sum() / den.sum())
    if len(num) < 2:
        return ratio, float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(num), (n, len(num)))
    draws = num[idx].sum(1) / den[idx].sum(1)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return ratio, float(lo), float(hi)


def fmt_ci(ci: tuple[float, float, float]) -> str:
    g, lo, hi = ci
    return f"{g:.2f}" if np.isnan(lo) else f"{g:.2f} [{lo:.2f}, {hi:.2f}]"


# ----------------------------------------------------------------------------- reports


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reruns a tool with these arguments (None: this process's)."""
    args = shlex.join(sys.argv[1:] if argv is None else argv)
    return f"python -m {module}{' ' + args if args else ''}"


def stamp(module: str, argv: list[str] | None) -> str:
    """The line every report carries: command, date and machine."""
    return (
        f"Command: `{command(module, argv)}`. Date: {datetime.date.today().isoformat()}. "
        f"Machine: {machine()}."
    )


def kept_notes(path: Path) -> str:
    """The reader's part of an existing report (from NOTES_MARKER on), or ''."""
    old = path.read_text() if path.exists() else ""
    return old[old.index(NOTES_MARKER) :] if NOTES_MARKER in old else ""


def write_report(
    path: Path,
    title: str,
    table: list[str],
    about: str,
    module: str,
    argv: list[str] | None,
    more: list[str] = (),
) -> str:
    """Write `path`: the title, the table, what it measured (`about`), the command with date
    and machine, then `more` (further tables, a plot) and the kept notes. Returns the text."""
    lines = [f"# {title}", "", *table, "", about, "", stamp(module, argv)]
    if more:
        lines += ["", *more]
    text = "\n".join(lines) + "\n"
    notes = kept_notes(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + (f"\n{notes}" if notes else ""))
    return text
