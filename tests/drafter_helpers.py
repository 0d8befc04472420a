"""Helpers shared by the drafter test files."""

import numpy as np
import pytest
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


def distilled_world(root, n_prompts: int, max_new_tokens: int, feature_layers=None):
    """(target dir, data dir, engine, prompts): a random tiny Qwen3 target and its answers to
    n_prompts random prompts as drafter training data (training.drafter_data, 4 per shard;
    the engine's default feature layers unless given)."""
    from target_service.engine import TargetEngine
    from target_service.random_checkpoint import make_random_qwen3
    from training import drafter_data as dd

    target = make_random_qwen3(root / "target", with_tokenizer=False)
    engine = TargetEngine(target, n_slots=4, max_seq_len=96, feature_layers=feature_layers)
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, 500, size=int(rng.integers(3, 9))).tolist() for _ in range(n_prompts)
    ]
    data = root / "data"
    dd.build(
        engine,
        prompts,
        data,
        max_new_tokens=max_new_tokens,
        chunk_size=4,
        target_dir=target,
        progress=False,
    )
    return target, data, engine, prompts


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight a busy machine for cores);
    a module that imports this fixture runs its tests so."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
