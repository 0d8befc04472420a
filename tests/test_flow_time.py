"""The tau <-> t map of the one-hot flow (drafter_service/flow_time.py)."""

import numpy as np
import pytest
import torch

from drafter_service.flow_time import (
    check_knots,
    correct_decode_prob,
    embedded_decode_prob,
    embedded_time_knots,
    map_tau_of_t,
    map_time_grid,
    t_of_tau,
    tau_of_t,
    time_grid,
)

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
    assert (
        abs(float(correct_decode_prob(np.array(0.0), V)) - 1 / V) < 1e-9
    )  # symmetry at pure noise


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


# ----------------------------------------------------------------------------- embedded map


def _bayes_accuracy_direct(E: torch.Tensor, t: float, n: int, seed: int) -> float:
    """Accuracy of the Bayes decoder of y from y_t = (1-t) eps @ E + t E_y, simulated in
    vocabulary space (eps ~ N(0, I_V)) and decoded with the Gaussian likelihood directly."""
    g = torch.Generator().manual_seed(seed)
    E = E.double()
    V = E.shape[0]
    y = torch.randint(0, V, (n,), generator=g)
    yt = (1 - t) * torch.randn(n, V, generator=g, dtype=torch.float64) @ E + t * E[y]
    G_inv = torch.linalg.pinv(E.T @ E)
    score = t * yt @ G_inv @ E.T - 0.5 * t * t * ((E @ G_inv) * E).sum(
        -1
    )  # log-likelihood up to a constant
    return float((score.argmax(-1) == y).double().mean())


def test_embedded_map_with_identity_embedding_is_the_vocab_map():
    """E = I: y_t is x_t, the Bayes decoder is the argmax, P_E is the analytic P."""
    V = 32
    t = np.array([0.2, 0.4, 0.55, 0.7])
    p_e = embedded_decode_prob(t, torch.eye(V), samples=40000)
    p = correct_decode_prob(t, V)
    assert np.all(np.abs(p_e - p) < 4 * np.sqrt(p * (1 - p) / 40000) + 1e-3)


@pytest.mark.parametrize("t", [0.8, 0.9])
def test_critical_snr_matches_a_direct_bayes_decoder(t):
    E = torch.randn(128, 16, generator=torch.Generator().manual_seed(3)) * torch.linspace(
        0.2, 3, 16
    )
    n = 20000
    p_e = float(embedded_decode_prob(np.array(t), E, samples=n, seed=1))
    p_direct = _bayes_accuracy_direct(E, t, n, seed=2)
    assert abs(p_e - p_direct) < 4 * np.sqrt(p_direct * (1 - p_direct) / n) * 1.5 + 2e-3


def test_embedding_squeezes_the_state():
    """V >> H: at the vocab map's tau = 0.9 the embedded state is far less readable, and the
    embedded map puts tau = 0.9 much later in t."""
    V, H = 1024, 32
    E = torch.randn(V, H, generator=torch.Generator().manual_seed(0))
    t90 = t_of_tau(0.9, V)
    assert float(embedded_decode_prob(np.array(t90), E, samples=4096)) < 0.3
    t_k, tau_k = embedded_time_knots(E, samples=4096)
    check_knots(t_k, tau_k)
    assert np.interp(0.9, tau_k, t_k) > t90 + 0.05
    assert t_k[0] == 0.0 and t_k[-1] == 1.0 and tau_k[0] == 0.0 and tau_k[-1] == 1.0


def test_config_time_maps_and_legacy_configs():
    from drafter_service.config import DrafterConfig

    base = dict(vocab_size=256, target_hidden_size=16, target_num_layers=4, feature_layers=[1])
    E = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    t_k, tau_k = embedded_time_knots(E, samples=2048)
    cfg = DrafterConfig(**base, time_table_t=t_k, time_table_tau=tau_k).validate()
    back = DrafterConfig.from_json(cfg.to_json())
    assert back.time_map == "embedded" and back.time_table_t == t_k  # stored, not recomputed
    g = map_time_grid(4, back)
    np.testing.assert_allclose(map_tau_of_t(g, back), np.linspace(0, 1, 5), atol=1e-9)
    old = {
        k: v
        for k, v in cfg.to_dict().items()
        if k
        not in ("time_map", "state_input", "time_table_t", "time_table_tau", "time_map_samples")
    }
    legacy = DrafterConfig.from_dict(old)  # a config.json written before the embedded map
    assert legacy.time_map == "vocab" and legacy.state_input == "rms"
    np.testing.assert_allclose(map_time_grid(3, legacy), time_grid(3, 256))
    with pytest.raises(ValueError):
        DrafterConfig(
            **base, time_table_t=[0.0, 0.5, 1.0], time_table_tau=[0.0, 0.7, 0.6, 1.0]
        ).validate()


def _tiny_drafter_config(V: int, H: int, dim: int, samples: int):
    """A one-block drafter config for a [V, H] embedding whose time map takes `samples` draws."""
    from drafter_service.config import DrafterConfig

    return DrafterConfig(
        dim=dim,
        n_blocks=1,
        n_heads=2,
        time_freq_dim=dim // 2,
        vocab_size=V,
        target_hidden_size=H,
        target_num_layers=4,
        feature_layers=[1],
        time_map_samples=samples,
    )


def test_drafter_measures_its_map_and_whitens_its_state():
    from drafter_service.flashmap_dit import FlashMapDiT

    V, H = 512, 32
    E = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 2.0, H)
    model = FlashMapDiT(_tiny_drafter_config(V, H, 32, 2048), E, E)
    assert len(model.cfg.time_table_t) > 2  # measured on E when it was attached
    check_knots(model.cfg.time_table_t, model.cfg.time_table_tau)
    np.testing.assert_allclose(
        model.time_grid(2)[1], np.interp(0.5, model.cfg.time_table_tau, model.cfg.time_table_t)
    )
    noise = torch.randn(20000, V, generator=torch.Generator().manual_seed(1)) @ E  # eps @ E
    w = model.read_state(noise)
    np.testing.assert_allclose(torch.cov(w.T).numpy(), np.eye(H), atol=0.06)  # isotropic


def test_committed_drafters_keep_their_time_map():
    """Checkpoints made before the embedded map load with the vocab map and the rms input."""
    from pathlib import Path

    from drafter_service.checkpoint import load_drafter

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    model = load_drafter(root / "demo-flashmap", root / "demo-target")
    assert model.cfg.time_map == "vocab" and model.cfg.state_input == "rms"
    np.testing.assert_allclose(model.time_grid(2), time_grid(2, model.cfg.vocab_size))


# The draws the embedded map was measured with before they were pinned to the CPU (HEAD before
# the fix, same E / seed / samples): the first six critical ratios, per candidates.
_PINNED_CRITICAL = {
    0: [4.718716144561768, 3.261840343475342, 7.509744644165039, 6.832027912139893]
    + [6.9615936279296875, 3.985757827758789],
    5: [1.3790974617004395, 1.5403673648834229, 1.1894404888153076, 1.717059850692749]
    + [5.471625804901123, -0.6099768877029419],
}


@pytest.mark.parametrize("candidates", [0, 5])
def test_critical_snr_draws_on_the_cpu_whatever_the_default_device(candidates):
    """The map's draws come from a CPU generator on the CPU whatever device is the default: a
    draw that followed the default device (what failed inside `torch.device("cuda")`) lands on
    "meta" here and cannot be read. The numbers are the ones drawn before the fix."""
    from drafter_service.flow_time import critical_snr

    E = torch.randn(48, 12, generator=torch.Generator().manual_seed(3))
    plain = critical_snr(E, samples=512, seed=7, candidates=candidates)
    with torch.device("meta"):
        inside = critical_snr(E, samples=512, seed=7, candidates=candidates)
    np.testing.assert_array_equal(inside, plain)
    np.testing.assert_allclose(plain[:6], _PINNED_CRITICAL[candidates], rtol=1e-5)


def test_drafter_builds_its_time_map_inside_a_device_context():
    """FlashMapDiT built inside `with torch.device(...)` (bench/gpu_drafter.py builds the
    paper-size drafter inside `torch.device("cuda")`): the embedded map is measured on E's
    device and is the one built outside any context. On a GPU, E on CUDA gives the CPU's map
    up to the rounding of the math (the draws are the same)."""
    from drafter_service.flashmap_dit import FlashMapDiT

    V, H = 256, 16
    E = torch.randn(V, H, generator=torch.Generator().manual_seed(0))
    cfg = lambda: _tiny_drafter_config(V, H, 16, 1024)  # noqa: E731
    want = FlashMapDiT(cfg(), E, E).cfg.time_table_t
    with torch.device("meta"):  # parameters on meta, E on the CPU: the map is E's
        got = FlashMapDiT(cfg(), E, E).cfg.time_table_t
    assert got == want and len(want) > 2
    if torch.cuda.is_available():
        with torch.device("cuda"):
            on_gpu = FlashMapDiT(cfg(), E.cuda(), E.cuda()).cfg.time_table_t
        np.testing.assert_allclose(on_gpu, want, atol=2e-3)
