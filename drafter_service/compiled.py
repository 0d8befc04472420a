"""torch.compile of the drafter's network: on CPU, what the CUDA graphs are on a GPU.

A 1-step draft is ~150 small ops; eagerly, on CPU, their dispatch costs as much as the
arithmetic. Compiled (inductor, C++ kernels) the same network runs as one fused program:
one 1-jump evaluation of the demo drafter took 2.6 -> 1.8 ms on this project's 2-core CPU
(a whole drafting round, context update included: 3.0 ms, docs/results/eval.md). Unlike a
CUDA graph it needs no static shapes: `dynamic=True` traces batch and context length as
symbols, so one compilation serves every request (sizes 0 and 1 are specialised, which
costs a second compilation the first time a batch of 2+ or a longer extend comes).

Compiling needs a C++ compiler at run time. If it fails (none installed, an op inductor
cannot lower) the wrapper logs once and runs the eager function from then on: drafting
gets slower, never stops, and the numbers are the same function's.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("flashmap.drafter.compile")


class Compiled:
    """`fn` through torch.compile(dynamic=True), falling back to `fn` itself on failure."""

    def __init__(self, fn: Callable, name: str):
        # Variants are kept per code object: every drafter of one class (an evaluation compares
        # several) shares the limit, and torch's default of 8 would send the rest eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.eager = fn
        self.name = name
        self.compiled = torch.compile(fn, dynamic=True)
        self.failed: str | None = None  # why compilation was given up, once it was

    def __call__(self, *args):
        if self.failed is None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - sorted out below
                out = self.eager(*args)  # a bad input raises here too: that error is the caller's
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("torch.compile of %s failed, running it eagerly: %s", self.name, self.failed)
                return out
        return self.eager(*args)


def compiled_method(obj, name: str) -> Compiled:
    """One Compiled per (object, method name): proposers that share a model (the eval builds
    one per table cell) share its compilations too."""
    cache = obj.__dict__.setdefault("_compiled_methods", {})  # plain attribute, also on an nn.Module
    if name not in cache:
        cache[name] = Compiled(getattr(obj, name), f"{type(obj).__name__}.{name}")
    return cache[name]
