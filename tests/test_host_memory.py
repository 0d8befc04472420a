"""flashmap.host_memory: with the thresholds fixed, a buffer that grows a little every step
is served from memory the process keeps, not mapped and faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashmap import host_memory

GROWING = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from flashmap.host_memory import keep_freed_memory
    assert keep_freed_memory()
n = 700_000  # 5.6 MB of float64, one page more every step: above glibc's default thresholds
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(200):
    a = np.ones(n + 512 * step)
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", GROWING, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_growing_buffers_stop_faulting():
    default, kept = _faults("default"), _faults("keep")
    assert default > 20_000  # ~1,400 pages a step, most steps
    assert kept < default / 20, (default, kept)


def test_second_call_is_a_no_op():
    first = host_memory.keep_freed_memory()
    assert host_memory.keep_freed_memory() == first
