"""CPU sets for the stack's processes: the target's compute thread alone on its own cores.

On a CPU host the target model's worker thread (target_service's Triton model) does most of
the stack's work, and it shares the cores with Triton's server threads, the stub's request
thread, the orchestrator, the drafter and the clients. Each of them that the scheduler runs on
the worker's core preempts it or moves it to the other core, and the worker's caches are then
someone else's; with the worker alone on its core and everything else on the other, the stack
runs faster under load (measured in docs/experiments/2026-12-02-cpus.md; `python -m bench.stack
--no-pin-cpus` runs the stack benchmark without the split).

`split_cpus` makes the split: the first `target_n` usable CPUs for the target's compute, the
others for every other thread. `flashmap_cli.stack.Stack` starts the services on the rest and
passes the target's set to the model (its `cpus` setting, target_service.target_config), whose
worker applies it to itself (`pin_thread`); a process started with fewer than two usable CPUs
is left alone.
The vLLM CPU backend binds its OpenMP threads to cores for the same reason
(VLLM_CPU_OMP_THREADS_BIND).

The drafter's forward thread is the exception: it gets every CPU ($FLASHMAP_DRAFTER_CPUS, the
two sets together). A round drafts and then verifies, so while it drafts the target's core
is idle and the scheduler wakes the forward there, away from the other core's gRPC threads
and the client reading the last round's tokens; a shadow probe drafted beside a verify runs
where a core is free. Only the forward moves: every other thread on every CPU as well gained
nothing more (the same page).

Standard library only; a no-op where the OS has no sched_setaffinity.
"""

from __future__ import annotations

import contextlib
import os

DRAFTER_CPUS_ENV = "FLASHMAP_DRAFTER_CPUS"  # the drafter's forward thread


def parse_cpu_list(text: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5} (the kernel's cpu-list format). Raises ValueError."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a, b = int(lo), int(hi) if sep else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"no CPU in {text!r}")
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def split_cpus(
    target_n: int, available: set[int] | None = None
) -> tuple[set[int], set[int]] | None:
    """(the target's CPUs, the rest): the first `target_n` of `available` (at least one, and
    at least one left over), or None when fewer than two are available."""
    cpus = sorted(usable_cpus() if available is None else available)
    if len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    n = min(max(1, target_n), len(cpus) - 1)
    return set(cpus[:n]), set(cpus[n:])


def pin_thread(cpus: set[int]) -> bool:
    """Run the calling thread (and the threads it starts, e.g. OpenMP's) on `cpus` only.
    False where the OS cannot."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, cpus)  # on Linux pid 0 is the calling thread, not the process
    return True


def pin_worker(cpus: set[int] | None, what: str) -> str:
    """Pin the calling thread (a service's compute thread, `what`) to `cpus` (None: leave it):
    "" when done, else why not, for the service's log. A CPU outside a container's set fails;
    the thread then runs where it was."""
    if cpus is None:
        return ""
    try:
        pin_thread(cpus)
    except OSError as e:
        return f"cannot run the {what} on CPUs {format_cpu_list(cpus)}: {e}"
    return ""


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None):
    """The calling thread on `cpus` for the block (None: unchanged), its old set restored after."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cpus is None or not pin_thread(cpus):
        yield
        return
    try:
        yield
    finally:
        pin_thread(before)
