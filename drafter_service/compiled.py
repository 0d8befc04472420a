"""torch.compile of the drafter's network: on CPU, what the CUDA graphs are on a GPU.

A 1-step draft is a long chain of small ops; eagerly, on CPU, their dispatch costs about as
much as the arithmetic. Compiled (inductor, C++ kernels) the same network runs as one fused
program, and with inductor's freezing its weights become constants, pre-packed once for the
CPU GEMM library instead of on every (K+1)-row matmul. Unlike a CUDA graph it needs no
static shapes: `dynamic=True` traces batch and context length as symbols, so one compilation
serves every request (sizes 0 and 1 are specialised, which costs a second compilation the
first time a batch of 2+ or a longer extend comes).

Freezing is switched on around every call, not passed as a torch.compile option: dynamo
decides whether parameters are frozen constants while it traces (any recompilation too),
from the global inductor config; `options={"freezing": True}` reaches inductor only after
that and leaves the weights as graph inputs (torch 2.13, checked in the generated code).

Compiling needs a C++ compiler at run time. If it fails (none installed, an op inductor
cannot lower) the wrapper logs once and runs the eager function from then on: drafting
gets slower, never stops, and the numbers are the same function's.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
import torch._inductor.config  # noqa: F401 - Compiled sets its freezing flag

log = logging.getLogger("flashmap.drafter.compile")


class Compiled:
    """`fn` (a bound method of a module) through torch.compile(dynamic=True), falling back to
    `fn` itself on failure.

    freeze=True (inductor's freezing): the module's weights are folded into the compiled
    program as constants and pre-packed for the CPU GEMM library once. Worth it where the
    row count is fixed (the drafting pass: K + 1 rows per block, a packed MKL GEMM); not where
    it varies (extending the context by a few positions), where packed kernels lose to plain
    ones. Frozen weights must not change after compiling: if they do (an in-place
    update bumps a tensor's version), the wrapper says so once and runs eagerly, with the
    current weights."""

    def __init__(self, fn: Callable, name: str, freeze: bool = False):
        # Variants are kept per code object (compiled_method gives each model its own); the
        # warm-up makes several, and a mistaken fallback to eager would cost more than room.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.eager = fn
        self.name = name
        self.freeze = freeze
        self.compiled = torch.compile(fn, dynamic=True)
        self.failed: str | None = None  # why compilation was given up, once it was
        module = getattr(fn, "__self__", None)
        self._weights = (
            list(module.parameters()) + list(module.buffers())
            if isinstance(module, torch.nn.Module)
            else []
        )
        self._versions = self._weight_versions()

    def _weight_versions(self) -> list[int]:
        return [w._version for w in self._weights]

    def __call__(self, *args):
        if self.failed is None and self._weight_versions() != self._versions:
            self.failed = "the weights changed after compiling (a frozen program would still hold the old ones)"
            log.warning("%s: %s; running it eagerly", self.name, self.failed)
        if self.failed is None:
            config = torch._inductor.config
            frozen = config.freezing
            config.freezing = (
                self.freeze
            )  # read by dynamo when (re)compiling; see the module docstring
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - sorted out below
                out = self.eager(*args)  # a bad input raises here too: that error is the caller's
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning(
                    "torch.compile of %s failed, running it eagerly: %s", self.name, self.failed
                )
                return out
            finally:
                config.freezing = frozen
        return self.eager(*args)


def compiled_method(obj, name: str, freeze: bool = False) -> Compiled:
    """One Compiled per (object, method name): proposers that share a model (the eval builds
    one per table cell) share its compilations too.

    Each object compiles its own copy of the method's code. Dynamo keeps compilations per code
    object and, on every call, checks the guards of each entry until one matches: with one
    shared code object, a model in an evaluation that compiles several drafters would pay for
    the others' guards on every drafting round."""
    cache = obj.__dict__.setdefault(
        "_compiled_methods", {}
    )  # plain attribute, also on an nn.Module
    if name not in cache:
        cache[name] = Compiled(
            _own_code(getattr(obj, name)), f"{type(obj).__name__}.{name}", freeze
        )
    return cache[name]


def _own_code(method: types.MethodType) -> types.MethodType:
    """The bound method over a fresh copy of its function's code object (same behaviour)."""
    f = method.__func__
    copy = types.FunctionType(
        f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__
    )
    copy.__kwdefaults__, copy.__qualname__ = f.__kwdefaults__, f.__qualname__
    return types.MethodType(copy, method.__self__)
