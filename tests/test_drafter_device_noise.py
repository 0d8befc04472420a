"""The FlashMap drafter's noise: drawn from a per-request generator on the drafter's device.

CPU: one generator per request draws the noise and then the proposal samples (unchanged
behaviour, so CPU drafts stay what they were). CUDA (run when a device is there): the noise
comes from a CUDA generator seeded per request (no host draw, no copy), so a draft depends
on its seed only: the same alone and in a batch of 16, and again on a second call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flashmap_proposer import FlashMapProposer, draw_noise, request_generator
from flashmap.drafts import ProposeRequest

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def proposer(device: str) -> FlashMapProposer:
    cfg = DrafterConfig(
        vocab_size=256,
        target_hidden_size=32,
        target_num_layers=4,
        feature_layers=[1],
        dim=32,
        n_blocks=2,
        n_heads=4,
    )
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(256, 32, generator=g)
    torch.manual_seed(0)
    model = FlashMapDiT(cfg, embed, embed)
    with (
        torch.no_grad()
    ):  # an untrained adaLN-Zero block is the identity: give the drafter some signal
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    prop = FlashMapProposer(model.to(device), n_slots=16, max_context=32, device=device)
    rng = np.random.default_rng(0)
    for i in range(16):
        prop.extend(
            f"s{i}", rng.integers(0, 256, 5), rng.standard_normal((5, cfg.feature_dim), np.float32)
        )
    return prop


@pytest.mark.parametrize("device", DEVICES)
def test_draft_depends_on_its_seed_only(device):
    prop = proposer(device)
    assert prop._host_noise == (device == "cpu")
    alone = prop.propose([ProposeRequest("s3", anchor=7, seed=99)], 1)[0]
    batch = [ProposeRequest(f"s{i}", anchor=7, seed=99 if i == 3 else 1000 + i) for i in range(16)]
    drafts = prop.propose(batch, 1)
    again = prop.propose(batch, 1)
    assert np.array_equal(drafts[3].tokens, alone.tokens)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(drafts, again))
    assert len({tuple(d.tokens) for d in drafts}) > 1  # other seeds, other drafts


def test_noise_is_drawn_on_the_generators_device():
    z = draw_noise(request_generator(5), 16, 64)
    assert z.device.type == "cpu" and torch.equal(
        z, torch.randn(64, generator=torch.Generator().manual_seed(5)).expand(16, 64)
    )
    if torch.cuda.is_available():
        g = request_generator(5, 0, "cuda")
        z = draw_noise(g, 16, 64)
        assert z.device.type == "cuda" and torch.equal(
            z, draw_noise(request_generator(5, 0, "cuda"), 16, 64)
        )
