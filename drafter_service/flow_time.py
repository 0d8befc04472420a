"""The tau <-> t time map of the one-hot flow (DESIGN.md, "Time").

The state x_t = (1-t)*eps + t*onehot(y), eps ~ N(0, I_V), decodes correctly (argmax = y)
with probability

    P(t) = E_z[ Phi(z + t/(1-t))^(V-1) ],   z ~ N(0, 1)

(the correct coordinate is (1-t)z + t, every other one (1-t)eps_j; divide by 1-t).
tau(t) = (P(t) - 1/V) / (1 - 1/V) is the fraction of the initial decoding error already
removed: 0 at pure noise, 1 at the clean block. For a large vocabulary almost nothing
happens until t ~ 0.5 and then tau rises steeply, so training samples tau ~ U(0, 1) and
drafting grids are uniform in tau, both mapped back to t here.

P is computed by Gauss-Hermite quadrature (in log space: Phi^(V-1) underflows) on a
table uniform in t, made monotone, and inverted by linear interpolation. Works on floats,
numpy arrays and torch tensors (the torch path stays on the tensor's device).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from scipy.special import log_ndtr

DEFAULT_TABLE_SIZE = 4097
DEFAULT_GH_NODES = 256  # |error| < 1e-6 in P for V = 151,936 (checked against dense quadrature)


def correct_decode_prob(t: np.ndarray, vocab_size: int, nodes: int = DEFAULT_GH_NODES) -> np.ndarray:
    """P[argmax x_t = y] for t in [0, 1] (numpy, float64)."""
    t = np.asarray(t, np.float64)
    x, w = np.polynomial.hermite.hermgauss(nodes)
    z, w = np.sqrt(2.0) * x, w / np.sqrt(np.pi)  # E_z[f(z)] = sum_i w_i f(z_i)
    inner = t < 1.0
    shift = np.where(inner, t / np.where(inner, 1.0 - t, 1.0), 0.0)  # t/(1-t), guarded at t = 1
    log_f = (vocab_size - 1) * log_ndtr(z[None, :] + shift.reshape(-1, 1))  # [n, nodes]
    p = (w * np.exp(log_f)).sum(-1).reshape(t.shape)
    return np.where(inner, p, 1.0)


@lru_cache(maxsize=16)
def _table(vocab_size: int, size: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(tau, t) lookup table, both strictly increasing, from (0, 0) to (1, 1)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    t = np.linspace(0.0, 1.0, size)
    p = correct_decode_prob(t, vocab_size, nodes)
    tau = (p - 1.0 / vocab_size) / (1.0 - 1.0 / vocab_size)
    tau = np.clip(np.maximum.accumulate(tau), 0.0, 1.0)  # quadrature noise must not break monotonicity
    tau[0] = 0.0
    # Keep strictly increasing points below 1 (tau saturates in float64 well before t = 1 for
    # small V), then pin the end point so that tau = 1 maps to exactly t = 1.
    keep = np.concatenate([[True], np.diff(tau) > 0]) & (tau < 1.0)
    tau_k = np.append(tau[keep], 1.0)
    t_k = np.append(t[keep], 1.0)
    tau_k.setflags(write=False)
    t_k.setflags(write=False)
    return tau_k, t_k


def _interp(x, xp: np.ndarray, fp: np.ndarray):
    """np.interp for floats / numpy arrays / torch tensors (clamped to the table's range)."""
    if isinstance(x, torch.Tensor):
        calc = torch.float32 if x.device.type == "mps" else torch.float64  # mps has no float64
        xp_t = torch.tensor(xp, dtype=calc, device=x.device)  # copies the read-only table
        fp_t = torch.tensor(fp, dtype=calc, device=x.device)
        return interp_torch(x, xp_t, fp_t)
    out = np.interp(np.asarray(x, np.float64), xp, fp)
    return float(out) if np.ndim(out) == 0 else out


def interp_torch(x: torch.Tensor, xp_t: torch.Tensor, fp_t: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation with tables already on x's device (no host copy, so
    it can run inside a CUDA graph)."""
    xc = x.to(xp_t.dtype).clamp(xp_t[0], xp_t[-1])
    i = torch.searchsorted(xp_t, xc, right=True).clamp(1, len(xp_t) - 1)  # xp[i-1] <= x < xp[i]
    x0, x1, f0, f1 = xp_t[i - 1], xp_t[i], fp_t[i - 1], fp_t[i]
    out = f0 + (xc - x0) / (x1 - x0) * (f1 - f0)
    return out.to(x.dtype if x.is_floating_point() else torch.float32)


def tau_tables(vocab_size: int, device, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES):
    """(t knots, tau knots) as float64 tensors on device (float32 on mps), for interp_torch."""
    tau_k, t_k = _table(vocab_size, size, nodes)
    calc = torch.float32 if torch.device(device).type == "mps" else torch.float64
    return torch.tensor(t_k, dtype=calc, device=device), torch.tensor(tau_k, dtype=calc, device=device)


def tau_of_t(t, vocab_size: int, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES):
    """Fraction of the initial decoding error removed at flow time t."""
    tau_k, t_k = _table(vocab_size, size, nodes)
    return _interp(t, t_k, tau_k)


def t_of_tau(tau, vocab_size: int, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES):
    """Flow time t at which a fraction tau of the initial decoding error is removed."""
    tau_k, t_k = _table(vocab_size, size, nodes)
    return _interp(tau, tau_k, t_k)


def time_grid(steps: int, vocab_size: int, size: int = DEFAULT_TABLE_SIZE,
              nodes: int = DEFAULT_GH_NODES) -> np.ndarray:
    """steps+1 jump / Euler times, uniform in tau, from exactly 0 to exactly 1 ([steps+1] float64)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    grid = np.asarray(t_of_tau(np.linspace(0.0, 1.0, steps + 1), vocab_size, size, nodes), np.float64)
    grid[0], grid[-1] = 0.0, 1.0
    return grid
