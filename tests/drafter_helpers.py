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


class TreeProposer:
    """A drafter of trees of a fixed shape (parents, as VerifyRow.parents) whose tokens are
    drawn uniformly from the vocabulary by the request's seed: drafts that do not depend on the
    target's noise, the condition of tree verification at T > 0 (target_service.tree). Keeps no
    context beyond its length."""

    steps, max_blocks, feature_dim = 1, 1, 0

    def __init__(self, parents, vocab_size: int, block_size: int = 16):
        self.parents = np.asarray(parents, np.int64)
        self.vocab_size, self.block_size = vocab_size, block_size
        self.length: dict[str, int] = {}

    def extend_many(self, items):
        for seq_id, ids, _ in items:
            self.length[seq_id] = self.length.get(seq_id, 0) + len(ids)
        return {}

    def context_length(self, seq_id: str) -> int:
        return self.length.get(seq_id, 0)

    def truncate(self, seq_id: str, n: int) -> None:
        self.length[seq_id] = n

    def release(self, seq_id: str) -> None:
        self.length.pop(seq_id, None)

    def draft(self, requests, n_blocks: int = 1):
        from flashmap.drafts import Draft

        out = []
        for r in requests:
            rng = np.random.default_rng([int(r.seed) & (2**63 - 1), 7])
            tokens = rng.integers(0, self.vocab_size, size=len(self.parents))
            n = len(self.parents) if r.max_draft_tokens is None else r.max_draft_tokens
            out.append([Draft.tree(tokens, self.parents).truncate(n)])
        return out


class BlockProposer(TreeProposer):
    """A drafter of `max_blocks` chains of `length` tokens whose slot k is drawn from a proposal
    law q_k of its own (`support` random ids, Dirichlet probabilities), all from the request's
    seed and the block's index: blocks with a known proposal law, as multi-draft rejection
    sampling needs them (flashmap.drafts.Draft.forest)."""

    def __init__(self, vocab_size: int, length: int = 4, support: int = 3, max_blocks: int = 3):
        super().__init__([-1, *range(length - 1)], vocab_size)
        self.block, self.support, self.max_blocks = length, support, max_blocks

    def draft(self, requests, n_blocks: int = 1):
        from flashmap.drafts import Draft

        out = []
        for r in requests:
            blocks = []
            for b in range(n_blocks):
                rng = np.random.default_rng([int(r.seed) & (2**63 - 1), 11, b])
                ids = np.stack(
                    [
                        rng.choice(self.vocab_size, self.support, replace=False)
                        for _ in range(self.block)
                    ]
                )
                q = rng.dirichlet(np.ones(self.support), size=self.block).astype(np.float32)
                tok = np.array([rng.choice(ids[k], p=q[k] / q[k].sum()) for k in range(self.block)])
                n = self.block if r.max_draft_tokens is None else r.max_draft_tokens
                blocks.append(Draft(tok.astype(np.int64), ids.astype(np.int64), q).truncate(n))
            out.append(blocks)
        return out
