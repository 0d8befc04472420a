"""The controlled joint-structure task's world: contexts whose 16-token continuations are a few
known modes, and the exact acceptance of a drafted block against that truth.

Each context (random feature vectors standing in for target hidden states, plus an anchor
token) fixes a small set of continuations ("modes") that share most slots but differ jointly
in `diverge` of the first `diverge_window` slots. The frozen embedding E [V, H] is random with
a spread spectrum like a trained one. The experiment on it: research.joint_task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from training.flow import Batch
from training.shuffle_test import proposal_prob


@dataclass
class JointTaskConfig:
    vocab_size: int = 256
    hidden_size: int = 16  # V/H = 16, the demo target's squeeze
    n_contexts: int = 64  # enough clusters for the bootstrap over contexts (the coverage check)
    n_modes: int = 3
    diverge: int = 4  # slots in which the modes differ (jointly)
    diverge_window: int = 8  # ... chosen among the first slots, where acceptance is decided
    block_size: int = 16
    context_len: int = 4
    spectrum: float = 46.0  # largest / smallest singular value of E, about the demo target's
    seed: int = 0
    # drafter and training
    dim: int = 128
    n_blocks: int = 2
    n_heads: int = 4
    batch_size: int = 64
    flow_steps: int = 2000
    flow_lr: float = 1e-3
    distill_steps: int = 1000
    distill_lr: float = 3e-4
    # the recipe's drafter settings (DrafterConfig fields)
    time_map: str = "embedded"
    time_map_candidates: tuple[int, ...] = (0,)
    state_input: str = "whiten"
    shared_noise: bool = False
    pure_noise_fraction: float = 0.0
    # evaluation
    draws: int = 16  # noise draws (requests) per context
    law_draws: int = 256  # noise draws per context that estimate a sampling drafter's law q
    coverage_repeats: int = 20  # evaluation seeds of the coverage check (DFlash per slot, Delta 0)
    coverage_contexts: tuple[int, ...] = (8,)  # ... also on the first N contexts only
    teacher_steps: tuple[int, ...] = (16,)
    ablations: tuple[str, ...] = ("vocab-map", "mix-map", "rms-input", "shared-noise", "old-recipe")
    device: str = "cpu"

    @classmethod
    def small(cls) -> JointTaskConfig:
        """CI size: well under a minute on two CPU cores."""
        return cls(
            vocab_size=128,
            hidden_size=16,
            n_contexts=8,
            n_modes=2,
            diverge=4,
            dim=64,
            batch_size=64,
            flow_steps=400,
            flow_lr=2e-3,
            distill_steps=250,
            distill_lr=5e-4,
            draws=24,
            law_draws=32,
            coverage_repeats=4,
            coverage_contexts=(),
            teacher_steps=(16,),
            ablations=(),
        )


# Teachers trained beside the recipe's, each changing it in one or more DrafterConfig fields.
ABLATIONS = {
    "vocab-map": dict(time_map="vocab"),  # tau of the state's argmax in vocabulary space
    # The embedded map, half of it for a two-candidate reader.
    "mix-map": dict(time_map_candidates=[2, 0]),
    "rms-input": dict(state_input="rms"),  # the state rms-normalised, not whitened
    "shared-noise": dict(shared_noise=True),  # one noise draw for all K slots
    "old-recipe": dict(
        time_map="vocab", state_input="rms", shared_noise=True, pure_noise_fraction=0.3
    ),
}


@dataclass
class JointTask:
    cfg: JointTaskConfig
    embed: Tensor  # [V, H] frozen embedding (= LM head)
    features: Tensor  # [C, T, H] context features
    anchors: Tensor  # [C] anchor token ids
    modes: Tensor  # [C, M, K] the continuations
    probs: Tensor  # [C, M] their probabilities


def make_task(cfg: JointTaskConfig) -> JointTask:
    g = torch.Generator().manual_seed(cfg.seed)
    V, H, C, M, K = cfg.vocab_size, cfg.hidden_size, cfg.n_contexts, cfg.n_modes, cfg.block_size
    # E = Z diag(s) Q: random directions, singular values spread log-uniformly (a trained
    # embedding's Gram matrix is far from isotropic).
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=g))
    s = torch.exp(torch.linspace(0, float(np.log(cfg.spectrum)), H))
    embed = (torch.randn(V, H, generator=g) / H**0.5 * s) @ q
    embed = embed / embed.norm(dim=1).mean()  # rows of norm ~1, as the demo target's
    features = torch.randn(C, cfg.context_len, H, generator=g)
    anchors = torch.randint(0, V, (C,), generator=g)
    modes = torch.randint(0, V, (C, 1, K), generator=g).repeat(1, M, 1)
    for c in range(C):
        slots = torch.randperm(cfg.diverge_window, generator=g)[: cfg.diverge]
        for k in slots.tolist():  # M distinct tokens, one per mode
            modes[c, :, k] = torch.randperm(V, generator=g)[:M]
    w = torch.ones(C, M)
    w[1::2] = 2.0 ** -torch.arange(M, dtype=torch.float32)  # odd contexts: 4/7, 2/7, 1/7 for M = 3
    return JointTask(cfg, embed, features, anchors, modes, w / w.sum(1, keepdim=True))


def sample_batch(task: JointTask, n: int, gen: torch.Generator) -> Batch:
    """n training blocks: contexts uniform, each block one mode drawn by its probability."""
    C, T = task.features.shape[:2]
    ctx = torch.randint(0, C, (n,), generator=gen)
    mode = torch.multinomial(task.probs[ctx], 1, generator=gen)[:, 0]
    target = task.modes[ctx, mode]  # [n, K]
    return Batch(
        task.features,
        ctx,
        torch.full((n,), T),
        task.anchors[ctx],
        target,
        torch.ones_like(target, dtype=torch.bool),
    ).to(task.cfg.device)


def drafter_config(task: JointTask, kind: str = "flashmap", **overrides) -> DrafterConfig:
    c = task.cfg
    return DrafterConfig(
        kind=kind,
        dim=c.dim,
        n_blocks=c.n_blocks,
        n_heads=c.n_heads,
        block_size=c.block_size,
        time_freq_dim=32,
        vocab_size=c.vocab_size,
        target_hidden_size=c.hidden_size,
        target_num_layers=1,
        feature_layers=[0],
        target_name="joint-task",
        **{
            **dict(
                time_map=c.time_map,
                time_map_candidates=list(c.time_map_candidates),
                state_input=c.state_input,
                shared_noise=c.shared_noise,
                pure_noise_fraction=c.pure_noise_fraction,
            ),
            **overrides,
        },
    )


def new_drafter(task: JointTask, kind: str = "flashmap", seed: int = 0, **overrides) -> FlashMapDiT:
    torch.manual_seed(seed)
    return FlashMapDiT(drafter_config(task, kind, **overrides), task.embed, task.embed).to(
        task.cfg.device
    )


# ----------------------------------------------------------------------------- exact acceptance


def prefix_probs(task: JointTask, c: int, tokens: np.ndarray) -> np.ndarray:
    """[K+1] P(the continuation starts with tokens[:k]) under context c, k = 0..K."""
    modes, probs = task.modes[c].numpy(), task.probs[c].numpy().astype(np.float64)
    agree = np.cumprod(modes == tokens[None], axis=1)  # [M, K]: mode m matches the first k+1 tokens
    return np.concatenate([[1.0], (probs[:, None] * agree).sum(0)])


def true_alpha(task: JointTask, c: int, draft) -> np.ndarray:
    """Per-slot acceptance probabilities [K] of a draft against the true conditional:
    min(1, p(d_k | c, d_<k) / q_k(d_k)) (q = 1 for greedy drafts)."""
    pre = prefix_probs(task, c, draft.tokens)
    cond = np.divide(pre[1:], pre[:-1], out=np.zeros(len(pre) - 1), where=pre[:-1] > 0)
    return np.minimum(1.0, cond / np.maximum(proposal_prob(draft), 1e-12))


def in_support(task: JointTask, c: int, tokens: np.ndarray) -> bool:
    return bool((task.modes[c].numpy() == tokens[None]).all(1).any())


def which_mode(task: JointTask, c: int, tokens: np.ndarray) -> int:
    hit = np.nonzero((task.modes[c].numpy() == tokens[None]).all(1))[0]
    return int(hit[0]) if len(hit) else -1
