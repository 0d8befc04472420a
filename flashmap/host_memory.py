"""Host memory: keep freed memory in the process instead of handing it back to the kernel.

A decode step on the CPU allocates the same large buffers again and again (attention gathers
each row's cache, [B, KV, S, D], one position longer every step). glibc's malloc serves an
allocation above its mmap threshold with a fresh mmap and, by default, moves that threshold up
only to the largest size freed so far, so a buffer that grows by one position per step is a new
mapping every step, and the heap's top is trimmed whenever enough is free: every step then
page-faults its buffers in again, in one process and inside Triton's model alike.
`keep_freed_memory` fixes both thresholds once per process, so the buffers stay mapped (what it
saved on the demo target: docs/experiments/2026-12-01-host-memory.md). jemalloc or tcmalloc,
which PyTorch's CPU tuning guides preload, avoid it the same way.

Numpy only (ctypes); a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("flashmap.host_memory")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts
TRIM_THRESHOLD = 512 << 20  # free memory the heap may keep at its top

_done = False


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); False where it could not."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not _done:
        log.warning(
            "mallopt refused the thresholds: host memory is returned to the kernel as freed"
        )
    return _done
