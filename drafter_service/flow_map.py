"""The flow map on the draft state: one jump of the flow from time s to time t, and what
drafting reads off and feeds in.

The state of a block of K draft slots is x_s [B, K, V]: noise at s = 0, one-hot at s = 1. Given
the network's clean-block probabilities pi = softmax(logits), the flow map is
X_{s,t}(x) = x + (t-s)/(1-s) * (pi - x) (`jump`): X_{s,1} = pi, and the diagonal s = t is the
teacher denoiser with velocity (pi - x)/(1-t).

The network sees the state only through y = x @ E (E the target's frozen embedding [V, H]),
and the flow map is affine, so serving carries y [B, K, H] instead of x [B, K, V]:
y_t = y_s + (t-s)/(1-s) * (pi @ E - y_s), and the noise x_0 ~ N(0, I_V) enters as
y_0 ~ N(0, E^T E), drawn as z @ F with z ~ N(0, I_r), r = min(V, H), and F^T F = E^T E
(`noise_factor`): the same distribution of drafts without drawing V normals and reading the
[V, H] embedding for every block. A greedy draft is read off the logits by `greedy_summary`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def per_row(v: Tensor | float, n: int, device: torch.device) -> Tensor:
    """A time given as float or [B] tensor -> [B] float32."""
    return torch.as_tensor(v, dtype=torch.float32, device=device).reshape(-1).expand(n)


def jump(x: Tensor, probs: Tensor, s: Tensor | float, t: Tensor | float) -> Tensor:
    """Flow-map update X_{s,t}(x) = x + (t-s)/(1-s) * (pi - x): x, probs [B, K, V], s, t [B]."""
    n = x.shape[0]
    s, t = per_row(s, n, x.device), per_row(t, n, x.device)
    w = ((t - s) / (1 - s).clamp_min(1e-6))[:, None, None]  # [B, 1, 1]
    return x + w * (probs.to(x.dtype) - x)


def greedy_summary(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per slot the argmax and its probability: logits [B, K, V] -> ids [B, K] int64, prob
    [B, K] float32 (prob = exp(max - logsumexp), what a greedy draft is cut on)."""
    top, ids = logits.max(-1)  # [B, K]
    return ids, (top - logits.logsumexp(-1)).exp()


def noise_factor(E: Tensor) -> Tensor:
    """F [r, H] (E's dtype) with F^T F = E^T E, r = min(V, H), for E [V, H]: z @ F with
    z ~ N(0, I_r) is distributed as x_0 @ E with x_0 ~ N(0, I_V). F = L^T from the Cholesky
    factor of E^T E when V > H (an eigendecomposition if E lacks full column rank), E itself
    when V <= H. Computed in float64."""
    V, H = E.shape
    if V <= H:
        return E.clone()
    gram = torch.zeros(H, H, dtype=torch.float64, device=E.device)
    for chunk in E.split(16384):  # a float64 copy of all of E would be 5 GB at Qwen3-8B's size
        c = chunk.double()
        gram += c.T @ c
    try:
        f = torch.linalg.cholesky(gram).T
    except torch.linalg.LinAlgError:
        lam, q = torch.linalg.eigh(gram)
        f = lam.clamp_min(0).sqrt()[:, None] * q.T
    return f.to(E.dtype)
