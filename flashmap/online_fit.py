"""Least-squares fits that follow a drifting cost: the speculation controller's models of what a
verify, a draft call and a round without drafts cost (flashmap.speculation).

Numpy only.
"""

from __future__ import annotations

import numpy as np


class OnlineLinear:
    """y ~ w0 + w . x by least squares with exponential forgetting (recent rounds count most),
    held towards `prior` by a weight that does not decay: along a direction the recent rounds
    do not vary (drafted tokens while speculation is off) the fit keeps what the last rounds
    that varied it said, and returns to the prior only once those have decayed away."""

    def __init__(self, prior: tuple[float, ...], forget: float = 0.98, prior_weight: float = 1e-3):
        self.forget = forget
        self.prior = np.asarray(prior, np.float64)  # [1 + m]
        self.P = prior_weight * np.eye(len(self.prior))
        self.A = np.zeros_like(self.P)  # normal equations A w = b of the (decayed) data
        self.b = np.zeros(len(self.prior))
        self.n = 0

    def add(self, x, y: float) -> None:
        v = np.concatenate([[1.0], np.atleast_1d(np.asarray(x, np.float64))])
        self.A = self.forget * self.A + np.outer(v, v)
        self.b = self.forget * self.b + v * float(y)
        self.n += 1

    @property
    def coef(self) -> tuple[float, ...]:
        """The least-squares weights, none negative: a weight that comes out negative is fixed
        at 0 and the others are fitted again (clipping it alone would shift the prediction
        where the data is, when rows and the intercept are nearly collinear)."""
        A, b = self.A + self.P, self.b + self.P @ self.prior
        free = np.ones(len(b), bool)
        w = np.zeros(len(b))
        while free.any():
            w[:] = 0.0
            w[free] = np.linalg.solve(A[np.ix_(free, free)], b[free])
            if (w >= 0).all():
                break
            free[np.argmin(w)] = False
        return tuple(float(c) for c in w)

    def __call__(self, x) -> float:
        w = self.coef
        return w[0] + float(np.dot(w[1:], np.atleast_1d(x)))
