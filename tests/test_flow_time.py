"""The tau <-> t map of the one-hot flow (drafter_service/flow_time.py)."""

import numpy as np
import pytest
import torch

from drafter_service.flow_time import correct_decode_prob, t_of_tau, tau_of_t, time_grid

VOCABS = [2, 512, 151936]


@pytest.mark.parametrize("V", VOCABS)
def test_tau_monotone_with_fixed_endpoints(V):
    t = np.linspace(0, 1, 1001)
    tau = tau_of_t(t, V)
    assert tau[0] == 0.0 and tau[-1] == 1.0
    assert np.all(np.diff(tau) >= 0)
    assert tau_of_t(0.5, V) < tau_of_t(0.9, V)


@pytest.mark.parametrize("V", VOCABS)
def test_t_of_tau_inverts(V):
    tau = np.linspace(0, 1, 101)
    t = t_of_tau(tau, V)
    assert np.all(np.diff(t) > 0), "t(tau) must be strictly increasing"
    np.testing.assert_allclose(tau_of_t(t, V), tau, atol=1e-6)
    t_mid = np.linspace(0.05, 0.95, 19) * t_of_tau(0.999, V)  # where tau is not flat
    np.testing.assert_allclose(t_of_tau(tau_of_t(t_mid, V), V), t_mid, atol=1e-3)


@pytest.mark.parametrize("V,t", [(8, 0.3), (64, 0.6), (64, 0.75)])
def test_decode_prob_matches_monte_carlo(V, t):
    g = np.random.default_rng(0)
    n = 40000
    y = g.integers(0, V, n)
    x = (1 - t) * g.standard_normal((n, V))
    x[np.arange(n), y] += t
    p_mc = (x.argmax(1) == y).mean()
    p = float(correct_decode_prob(np.array(t), V))
    assert abs(p - p_mc) < 4 * np.sqrt(p * (1 - p) / n) + 1e-3
    assert abs(float(correct_decode_prob(np.array(0.0), V)) - 1 / V) < 1e-9  # symmetry at pure noise


def test_numpy_torch_float_agree():
    V = 512
    tau = np.array([0.0, 0.1, 0.5, 0.9, 1.0])
    t_np = t_of_tau(tau, V)
    t_pt = t_of_tau(torch.tensor(tau, dtype=torch.float32), V)
    assert isinstance(t_pt, torch.Tensor) and t_pt.dtype == torch.float32
    np.testing.assert_allclose(t_pt.numpy(), t_np, atol=1e-6)
    assert isinstance(t_of_tau(0.5, V), float) and t_of_tau(0.5, V) == pytest.approx(t_np[2])
    back = tau_of_t(torch.tensor(t_np, dtype=torch.float64), V)
    np.testing.assert_allclose(back.numpy(), tau, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 2, 3, 8])
def test_time_grid(steps):
    V = 151936
    g = time_grid(steps, V)
    assert g.shape == (steps + 1,) and g[0] == 0.0 and g[-1] == 1.0
    assert np.all(np.diff(g) > 0)
    np.testing.assert_allclose(tau_of_t(g, V), np.linspace(0, 1, steps + 1), atol=1e-6)
    if steps == 2:
        assert g[1] == pytest.approx(t_of_tau(0.5, V))
    with pytest.raises(ValueError):
        time_grid(0, V)
