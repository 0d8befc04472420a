"""The tau <-> t time map of the one-hot flow (docs/ARCHITECTURE.md, "Time").

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

That is the "vocab" map. The drafter never sees x_t: it reads y_t = x_t @ E through the
frozen embedding E [V, H], where the noise eps @ E ~ N(0, E^T E) is squeezed into H
dimensions. Whitened (C = E (E^T E)^{-1/2}, the codewords of a Gaussian channel with
unit noise), the tokens' codewords have mean squared norm H/V instead of 1, so y_t
stays unreadable long after x_t's argmax is right (with V/H large, the Bayes decoder of y_t
is still mostly wrong at a vocab tau close to 1). The "embedded" map
replaces P by P_E(t), the accuracy of that Bayes decoder (uniform prior over tokens,
one slot's y_t), measured by Monte Carlo on the real E (`embedded_time_knots`): tau
then counts the error removed from what the network can read. Its table is stored in
the drafter's config (`time_knots`), so drafting grids need no recomputation at load.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from scipy.special import log_ndtr

DEFAULT_TABLE_SIZE = 4097
DEFAULT_GH_NODES = 256  # |error| < 1e-6 in P for V = 151,936 (checked against dense quadrature)


def correct_decode_prob(
    t: np.ndarray, vocab_size: int, nodes: int = DEFAULT_GH_NODES
) -> np.ndarray:
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
    tau = np.clip(
        np.maximum.accumulate(tau), 0.0, 1.0
    )  # quadrature noise must not break monotonicity
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


def tau_tables(
    vocab_size: int, device, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES
):
    """(t knots, tau knots) as float64 tensors on device (float32 on mps), for interp_torch."""
    tau_k, t_k = _table(vocab_size, size, nodes)
    calc = torch.float32 if torch.device(device).type == "mps" else torch.float64
    return torch.tensor(t_k, dtype=calc, device=device), torch.tensor(
        tau_k, dtype=calc, device=device
    )


def tau_of_t(t, vocab_size: int, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES):
    """Fraction of the initial decoding error removed at flow time t."""
    tau_k, t_k = _table(vocab_size, size, nodes)
    return _interp(t, t_k, tau_k)


def t_of_tau(tau, vocab_size: int, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES):
    """Flow time t at which a fraction tau of the initial decoding error is removed."""
    tau_k, t_k = _table(vocab_size, size, nodes)
    return _interp(tau, tau_k, t_k)


def time_grid(
    steps: int, vocab_size: int, size: int = DEFAULT_TABLE_SIZE, nodes: int = DEFAULT_GH_NODES
) -> np.ndarray:
    """steps+1 jump / Euler times, uniform in tau, from exactly 0 to exactly 1 ([steps+1] float64)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    grid = np.asarray(
        t_of_tau(np.linspace(0.0, 1.0, steps + 1), vocab_size, size, nodes), np.float64
    )
    grid[0], grid[-1] = 0.0, 1.0
    return grid


# ----------------------------------------------------------------------------- embedded map

TIME_MAPS = ("vocab", "embedded")
DEFAULT_MAP_SAMPLES = 16384
DEFAULT_MAP_KNOTS = 257


def _gram_eig(E: torch.Tensor, rel_eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues [r] and eigenvectors [H, r] (float64) of E^T E on E's row space
    (eigenvalues below rel_eps * the largest dropped: r = rank of E, e.g. r = V when V < H)."""
    gram = torch.zeros(E.shape[1], E.shape[1], dtype=torch.float64, device=E.device)
    for chunk in E.split(16384):  # no float64 copy of a large E at once
        c = chunk.double()
        gram += c.T @ c
    lam, q = torch.linalg.eigh(gram)
    keep = lam > rel_eps * lam[-1].clamp_min(1e-300)
    return lam[keep], q[:, keep]


def whitening(E: torch.Tensor) -> torch.Tensor:
    """W [H, r] (float64) with W^T E^T E W = I_r: y @ W whitens the embedded noise eps @ E."""
    lam, q = _gram_eig(E)
    return q / lam.sqrt()


def zca_whitening(E: torch.Tensor) -> torch.Tensor:
    """The symmetric whitening (E^T E)^{-1/2} [H, H] (float64; pseudo-inverse on E's row
    space): the same coordinates as y, the embedded noise made isotropic."""
    lam, q = _gram_eig(E)
    return (q / lam.sqrt()) @ q.T


def critical_snr(
    E: torch.Tensor,
    samples: int = DEFAULT_MAP_SAMPLES,
    seed: int = 0,
    chunk: int | None = None,
    candidates: int = 0,
) -> np.ndarray:
    """Per Monte Carlo draw (token y uniform over V, whitened noise n ~ N(0, I_r)) the
    smallest r = t/(1-t) above which the Bayes decoder of y from y_t = (1-t) eps@E + t E_y
    is right ([samples] float64; +inf where another token has the same codeword).

    Whitened, y_t / (1-t) = n + r c_y with codewords c_j = W^T E_j; the decoder (uniform
    prior) takes argmax_j c_j.y_t - t/2 |c_j|^2, which is right iff for every j != y
    (c_y - c_j).n + r/2 |c_y - c_j|^2 > 0, i.e. iff r > -2 (c_y - c_j).n / |c_y - c_j|^2 for
    all j. So one pass over the draws gives P_E(t) = P[critical r < t/(1-t)] at every t at
    once, monotone in t by construction. candidates > 1: the decoder only chooses between y
    and candidates - 1 other tokens drawn at random (a reader whose context has already
    narrowed the choice); 0 = all V tokens.

    Every random draw comes from one CPU generator on the CPU (then moves to E's device for
    the math), so the draws are the same whatever E's device and whatever default device is
    in effect (`with torch.device("cuda")` around the drafter's construction included)."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    V = E.shape[0]
    W = whitening(E)
    dt = torch.float32  # the decisions compare O(1) numbers: float32 is ample, and twice as fast
    C = torch.cat([(c.double() @ W) for c in E.split(16384)]).to(dt)  # [V, r] codewords
    lev = (C * C).sum(-1)  # [V]
    chunk = chunk or max(1, min(1024, (1 << 26) // V))  # [chunk, V] float32 blocks of <= 256 MB
    ys = torch.randint(0, V, (samples,), generator=g, device="cpu")
    noise = torch.randn(samples, C.shape[1], generator=g, dtype=torch.float64, device="cpu")
    out = []
    for y, n in zip(ys.split(chunk), noise.split(chunk)):
        y, n = y.to(E.device), n.to(E.device, dt)
        a = n @ C.T  # [b, V]: c_j.n
        a = a.gather(1, y[:, None]) - a  # (c_y - c_j).n
        d = lev[y][:, None] + lev[None] - 2 * (C[y] @ C.T)  # |c_y - c_j|^2
        ratio = torch.where(
            d > 1e-12 * lev.max(), -2 * a / d.clamp_min(1e-300), torch.full_like(d, float("inf"))
        )
        ratio.scatter_(1, y[:, None], float("-inf"))  # j = y is no competitor
        if 1 < candidates < V:  # keep candidates - 1 random competitors per draw
            keep = torch.rand(ratio.shape, generator=g, device="cpu").to(ratio.device)
            keep.scatter_(1, y[:, None], 2.0)
            cut = keep.topk(candidates, dim=1).values[:, -1:]
            ratio = torch.where(keep >= cut, ratio, torch.full_like(ratio, float("-inf")))
        out.append(ratio.max(-1).values.double().cpu())
    return torch.cat(out).numpy()


def embedded_decode_prob(
    t,
    E: torch.Tensor | None = None,
    samples: int = DEFAULT_MAP_SAMPLES,
    seed: int = 0,
    critical: np.ndarray | None = None,
) -> np.ndarray:
    """P_E(t): accuracy of the Bayes decoder of one slot's token from its embedded state y_t
    (numpy float64, shape of t). Give E, or the `critical_snr` draws to reuse them."""
    crit = np.sort(critical_snr(E, samples, seed) if critical is None else critical)
    t = np.asarray(t, np.float64)
    r = np.where(t < 1, t / np.where(t < 1, 1 - t, 1), np.inf)
    p = np.searchsorted(crit, r, side="left") / len(crit)  # P[critical < r]
    return np.where(t <= 0, 1.0 / E.shape[0] if E is not None else p, p)


def embedded_time_knots(
    E: torch.Tensor,
    knots: int = DEFAULT_MAP_KNOTS,
    samples: int = DEFAULT_MAP_SAMPLES,
    seed: int = 0,
    candidates=(0,),
) -> tuple[list[float], list[float]]:
    """(t knots, tau knots) of the embedded map, uniform in tau, from (0, 0) to (1, 1), strictly
    increasing in both. Plain lists: they go into the drafter's config.json.

    tau(t) is the mean over `candidates` (0 = all V; m > 1 = the true token and m - 1 random
    others) of the normalised accuracy (P_m(t) - 1/m) / (1 - 1/m) of the Bayes decoder of one
    slot's embedded state. (0,): tau_E, what a reader with no context can tell; (2, 0) also
    spends half the time where a reader whose context left two candidates decides."""
    V = E.shape[0]
    cands = [candidates] if isinstance(candidates, int) else list(candidates)
    crits = [np.sort(critical_snr(E, samples, seed + i, candidates=c)) for i, c in enumerate(cands)]
    r = np.concatenate([[0.0], np.geomspace(1e-3, 1e5, 4000)])  # r = t/(1-t), dense in log r
    tau_r = np.zeros_like(r)
    for c, crit in zip(cands, crits):
        m = c if 1 < c < V else V  # chance level 1/m
        p = np.searchsorted(crit, r, side="left") / len(crit)  # P[critical < r]
        tau_r += np.clip((p - 1.0 / m) / (1.0 - 1.0 / m), 0.0, 1.0) / len(cands)
    tau_r = np.maximum.accumulate(tau_r)
    tau_r[0] = 0.0
    up = np.concatenate([[True], np.diff(tau_r) > 0])  # invertible part
    tau = np.linspace(0.0, 1.0, knots)
    rk = np.interp(tau, tau_r[up], r[up])
    t = rk / (1.0 + rk)
    t[0], t[-1] = 0.0, 1.0
    keep = np.concatenate([[True], np.diff(t) > 1e-12]) & (t < 1.0)
    t_k, tau_k = np.append(t[keep], 1.0), np.append(tau[keep], 1.0)
    return [float(x) for x in t_k], [float(x) for x in tau_k]


def time_knots(cfg) -> tuple[np.ndarray, np.ndarray]:
    """(tau knots, t knots) of a drafter config's time map (read-only float64 arrays): the
    analytic vocabulary map, or the embedded map's stored table."""
    if cfg.time_map == "vocab":
        return _table(cfg.vocab_size, cfg.time_table_size, cfg.gauss_hermite_nodes)
    if not cfg.time_table_t:
        raise ValueError(
            "the embedded time map has no table yet (it is measured when the target's embedding "
            "is attached: FlashMapDiT.set_target)"
        )
    return _frozen_knots(tuple(cfg.time_table_tau), tuple(cfg.time_table_t))


@lru_cache(maxsize=16)
def _frozen_knots(tau: tuple, t: tuple) -> tuple[np.ndarray, np.ndarray]:
    tau_k, t_k = np.array(tau, np.float64), np.array(t, np.float64)
    tau_k.setflags(write=False)
    t_k.setflags(write=False)
    return tau_k, t_k


def check_knots(t: list[float], tau: list[float]) -> None:
    """ValueError unless (t, tau) is a time-map table: same length >= 2, from (0, 0) to (1, 1),
    strictly increasing in both."""
    if len(t) != len(tau) or len(t) < 2:
        raise ValueError(
            f"time table needs equally long t / tau lists of >= 2 knots, got {len(t)} / {len(tau)}"
        )
    a, b = np.asarray(t, np.float64), np.asarray(tau, np.float64)
    if (
        a[0] != 0
        or b[0] != 0
        or a[-1] != 1
        or b[-1] != 1
        or (np.diff(a) <= 0).any()
        or (np.diff(b) <= 0).any()
    ):
        raise ValueError(
            "time table must run from (0, 0) to (1, 1), strictly increasing in t and tau"
        )


def map_t_of_tau(tau, cfg):
    """t of tau under cfg's time map (floats, numpy arrays, torch tensors)."""
    tau_k, t_k = time_knots(cfg)
    return _interp(tau, tau_k, t_k)


def map_tau_of_t(t, cfg):
    """tau of t under cfg's time map."""
    tau_k, t_k = time_knots(cfg)
    return _interp(t, t_k, tau_k)


def map_time_grid(steps: int, cfg) -> np.ndarray:
    """`time_grid` under cfg's time map: steps+1 times uniform in its tau, from exactly 0 to 1."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    grid = np.asarray(map_t_of_tau(np.linspace(0.0, 1.0, steps + 1), cfg), np.float64)
    grid[0], grid[-1] = 0.0, 1.0
    return grid
