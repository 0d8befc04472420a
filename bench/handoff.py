"""What one hand-off between two processes costs on this machine, the floor under every
message between the stack's services.

    python -m bench.handoff [--pings 400] [--gaps 0,5] [--repeats 3]

Two processes on two CPUs (0 and 1) pass a byte back and forth over pipes; a ping's
one-way time is half its round trip. A drafted round at concurrency 1 crosses a process
boundary several times (orchestrator -> drafter -> orchestrator -> Triton's server -> the
model's stub and back), each while the other side's CPU has nothing else to run. `--gaps`
puts that many ms of sleep between pings, so both CPUs go idle between them as the
services' do between rounds (0: back to back). Each case runs with the CPUs idle and with
an idle-class busy loop (SCHED_IDLE, runs only when nothing else does) on each CPU, which
keeps a CPU from halting: the difference is what waking a halted CPU adds to a hand-off.
The cases alternate, `--repeats` times; medians and 90th percentiles in microseconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import numpy as np

from flashmap.measure import machine


def _echo(r: int, w: int, cpu: int) -> None:
    """Child: on `cpu`, send back every byte that arrives until the pipe closes."""
    os.sched_setaffinity(0, {cpu})
    while b := os.read(r, 1):
        os.write(w, b)
    os._exit(0)


def pings(n: int, gap_s: float, cpus: tuple[int, int] = (0, 1)) -> np.ndarray:
    """[n] one-way times in microseconds: this process on cpus[0], an echo on cpus[1]."""
    child_r, parent_w = os.pipe()  # parent -> child
    parent_r, child_w = os.pipe()  # child -> parent
    pid = os.fork()
    if pid == 0:
        os.close(parent_w)
        os.close(parent_r)
        _echo(child_r, child_w, cpus[1])
    os.close(child_r)
    os.close(child_w)
    orig = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    out = np.empty(n)
    try:
        for i in range(n):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            os.write(parent_w, b"x")
            os.read(parent_r, 1)
            out[i] = (time.perf_counter() - t0) / 2 * 1e6
    finally:
        os.close(parent_w)
        os.waitpid(pid, 0)
        os.close(parent_r)
        os.sched_setaffinity(0, orig)
    return out


def spinners(cpus: tuple[int, ...]) -> list[subprocess.Popen]:
    """An idle-class busy loop on each CPU (chrt -i 0)."""
    return [
        subprocess.Popen(
            ["chrt", "-i", "0", "taskset", "-c", str(c), sys.executable, "-c", "while True: pass"]
        )
        for c in cpus
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pings", type=int, default=400)
    ap.add_argument("--gaps", default="0,5", help="ms of sleep between pings, comma list")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two CPUs")
    cases = [(float(g), awake) for g in a.gaps.split(",") for awake in (False, True)]
    got: dict[tuple[float, bool], list[np.ndarray]] = {c: [] for c in cases}
    for rep in range(a.repeats):
        for gap, awake in cases if rep % 2 == 0 else cases[::-1]:
            spin = spinners((0, 1)) if awake else []
            try:
                time.sleep(0.2)
                got[(gap, awake)].append(pings(a.pings, gap / 1e3))
            finally:
                for p in spin:
                    p.kill()
                    p.wait()
            print(
                f"repeat {rep} gap {gap:g} ms {'awake' if awake else 'idle'}: "
                f"median {np.median(got[(gap, awake)][-1]):.0f} us",
                flush=True,
            )
    lines = [
        "| gap between pings (ms) | CPUs | one-way median (us) | 90th percentile (us) | pings |",
        "|---:|---|---:|---:|---:|",
    ]
    for gap, awake in cases:
        x = np.concatenate(got[(gap, awake)])
        lines.append(
            f"| {gap:g} | {'kept awake (idle-class loop)' if awake else 'idle'} | {np.median(x):.0f} | "
            f"{np.percentile(x, 90):.0f} | {len(x)} |"
        )
    lines += [
        "",
        f"Command: `python -m bench.handoff --pings {a.pings} --gaps {a.gaps} --repeats {a.repeats}`. "
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine()}.",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
