"""The in-process target with its neighbour CPU idle against the same with the neighbour busy.

The stack's concurrency-1 ratio (bench.bench_stack) compares the target model's worker, alone
on the first CPU with Triton's server, the orchestrator, the drafter and the client on the
other, against the target in this process with the other CPU idle. The two CPUs share the
last-level cache, and the demo target's weights are about its size, so what runs beside the
worker can slow it without taking any of its CPU time. This measures that directly: the
in-process target at concurrency 1 on the first CPU while the other CPU (a child process
pinned there) is idle, streams through memory (sums a 64 MB array), spins without touching
memory, or sleeps and wakes every 5 ms to sum a 4 or 16 MiB array (a mostly idle neighbour
with a working set in the shared cache). The modes alternate per part of the prompts; each ratio is a geometric mean of ratios
within a part with a 95% interval (Student's t on the logs).

    OMP_NUM_THREADS=1 python -m bench.neighbour_load --parts 8 --out docs/results/neighbour_load.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LOADS = {
    "idle": None,
    "streams memory": "import numpy as np\na = np.ones(8_000_000)\nwhile True:\n    a.sum()",
    "spins": "x = 0\nwhile True:\n    x += 1",
    # A neighbour that is mostly asleep but walks a working set when it wakes, as a server
    # process does per request: what it evicts, not its CPU time, would slow the target.
    "walks 4 MiB every 5 ms": "import time\nimport numpy as np\na = np.ones(1 << 19)\nwhile True:\n    a.sum()\n    time.sleep(0.005)",
    "walks 16 MiB every 5 ms": "import time\nimport numpy as np\na = np.ones(1 << 21)\nwhile True:\n    a.sum()\n    time.sleep(0.005)",
}


def llc_bytes() -> int | None:
    """The size of the first CPU's last-level cache, from sysfs (None where it says nothing)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for d in sorted(base.glob("index*")):
        try:
            text = (d / "size").read_text().strip()
            level = int((d / "level").read_text())
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        sizes.append((level, int(text.rstrip("KM")) * mult))
    return max(sizes)[1] if sizes else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parts", type=int, default=8, help="parts of the prompts, each run under every load"
    )
    ap.add_argument("--per-part", type=int, default=8, help="prompts per part (concurrency 1)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from bench.bench_stack import NOTES_MARKER, fmt_ci, inprocess_run, prompt_sets, ratio_ci
    from flashmap.cpus import on_cpus, split_cpus
    from flashmap.measure import machine
    from flashmap_cli.stack import default_checkpoints
    from target_service.engine import TargetEngine

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cpus = split_cpus(1)
    if cpus is None:
        print("fewer than 2 usable CPUs: no neighbour to load", file=sys.stderr)
        return 1
    mine, other = cpus
    target, _, _ = default_checkpoints(None, None)
    engine = TargetEngine(target, n_slots=1, max_seq_len=512)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    prompts = prompt_sets(target, engine.vocab_size, a.parts * a.per_part)["random ids"]
    tok_s: dict[str, list[float]] = {k: [] for k in LOADS}
    with on_cpus(mine):
        inprocess_run(engine, None, prompts[:2], 8, 1, a.decode_steps)  # warm-up
        for part in range(a.parts):
            ps = prompts[part * a.per_part : (part + 1) * a.per_part]
            order = list(LOADS) if part % 2 == 0 else list(LOADS)[::-1]
            for name in order:
                child = None
                if LOADS[name] is not None:
                    with on_cpus(other):  # a child starts on its parent thread's CPUs
                        child = subprocess.Popen([sys.executable, "-c", LOADS[name]])
                    time.sleep(0.3)  # running before the clock starts
                try:
                    run = inprocess_run(engine, None, ps, a.max_new_tokens, 1, a.decode_steps)
                finally:
                    if child is not None:
                        child.kill()
                        child.wait()
                tok_s[name].append(sum(len(o) for o in run["outputs"]) / run["seconds"])
            print(
                f"part {part + 1}/{a.parts}: "
                + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in tok_s.items()),
                flush=True,
            )
    llc = llc_bytes()
    lines = ["| the other CPU | tokens/s (mean) | / idle [95% CI] |", "|---|---:|---:|"]
    for name, vals in tok_s.items():
        ratio = (
            "1"
            if name == "idle"
            else fmt_ci(ratio_ci([x / y for x, y in zip(vals, tok_s["idle"])]))
        )
        lines.append(f"| {name} | {np.mean(vals):.0f} | {ratio} |")
    lines += [
        "",
        f"The demo target (`{os.path.relpath(target)}`) in process at concurrency 1 on CPU "
        f"{min(mine)}, greedy, {a.max_new_tokens} new tokens, {a.decode_steps} per call; {a.parts} parts of "
        f"{a.per_part} random-id prompts, the loads alternated per part. Target weights "
        f"{weight_bytes / 2**20:.1f} MiB; last-level cache "
        f"{'unknown' if llc is None else f'{llc / 2**20:.0f} MiB'}. Command: `OMP_NUM_THREADS="
        f"{os.environ['OMP_NUM_THREADS']} python -m bench.neighbour_load --parts {a.parts} --per-part "
        f"{a.per_part}`. Date: {datetime.date.today().isoformat()}. Machine: {machine()}.",
    ]
    print("\n".join(lines))
    if a.out is not None:
        head = "# The target beside a busy neighbour CPU (CPU)\n\n"
        old = a.out.read_text() if a.out.exists() else ""
        notes = old[old.index(NOTES_MARKER) :] if NOTES_MARKER in old else ""
        a.out.write_text(head + "\n".join(lines) + "\n" + (f"\n{notes}" if notes else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
