"""Helpers shared by the drafter test files."""

import torch


def randomize(model, seed: int = 0):
    """Give the zero-initialised adaLN a random value so that time conditioning and every
    block matter in comparisons."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in model.blocks:
            for p in (blk.adaln.weight, blk.adaln.bias):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model
