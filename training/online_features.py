"""The frozen target inside training: each batch's features computed online, by the engine
that serves, so the data on disk are token ids only (prompt + the target's response,
`training.generate_data`).

Offline features (`training.drafter_data`) cost 5 layers x 4096 values x 2 bytes = 40 KB per
token for Qwen3-8B: 500K sequences of ~1,000 tokens would be 20 TB. Online, a step runs one
prefill row per sequence of its batch through `TargetEngine.verify` (the serving engine's own
forward, packed rows, features of every position left on the device), which costs
about 2 x 7e9 FLOPs per token for Qwen3-8B, the bulk of a training step (docs/training.md,
"Sizes").

- `OnlineTarget`: the engine (bf16 on a GPU, fp32 on the CPU), `features(seqs)` and
  `attach(seqs)` (training.drafter_data.Sequence with its features on the device).
- `share_frozen(drafter, target)`: the drafter's frozen embedding / LM head buffers become
  the target's own tensors (same storage), so one copy of each is in memory.
- `check_fits`: a run whose drafter, data or lengths do not fit the target is refused before
  any step runs, each reason naming the setting.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch

from training.drafter_data import target_features

# bytes of one element of the training state per drafter parameter: fp32 weights, fp32 gradient
# and AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 16


def default_dtype(device) -> torch.dtype:
    """The target's compute dtype in training: bf16 on a GPU (as it serves there), fp32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class OnlineTarget:
    """A TargetEngine whose verify pass gives the features of training batches.

    n_slots: sequences per verify pass (a micro-batch's sequences go through in passes of
    n_slots); max_len: the longest sequence (the engine's max_seq_len)."""

    def __init__(
        self,
        target_dir: str | Path,
        *,
        n_slots: int,
        max_len: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ):
        from target_service.engine import TargetEngine

        dtype = dtype or default_dtype(device)
        self.target_dir = Path(target_dir)
        # The features leave the engine in the dtype they were computed in (bf16 on a GPU: exact).
        self.engine = TargetEngine(
            target_dir,
            n_slots=n_slots,
            max_seq_len=max_len,
            device=device,
            dtype=dtype,
            features_dtype=dtype if dtype != torch.float16 else torch.float32,
        )
        self.engine.model.requires_grad_(False)
        self.device = torch.device(device)

    @property
    def model(self):
        return self.engine.model

    @property
    def embed(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    @property
    def max_len(self) -> int:
        return self.engine.max_seq_len

    def features(self, sequences: list) -> list[torch.Tensor]:
        """Features [L, F] of every position of each token sequence (lists, arrays or tensors),
        on the target's device: one prefill row per sequence, n_slots rows per verify pass,
        exactly what `training.drafter_data.target_features` stores offline."""
        return target_features(
            self.engine, [np.asarray(q, np.int64) for q in sequences], features_on_device=True
        )

    def host(self, models: list, *, amp: bool, shards: int = 1) -> None:
        """Make room for training `models` (the trained drafter first, then its frozen teacher):
        their frozen embedding / LM head become the target's tensors (one copy in memory; bf16
        on a GPU, read under autocast, so only with amp there), and on a GPU the training state
        must fit in what the target left free (check_memory; shards: FSDP2's ranks)."""
        if self.embed.dtype == torch.float32 or (amp and self.device.type == "cuda"):
            for m in models:
                share_frozen(m, self)
        n = sum(p.numel() for p in models[0].parameters())
        copies = 1 + 2 * (len(models) > 1)  # distillation: the teacher and the EMA
        check_memory(training_bytes(n, copies, shards), self.device)

    def attach(self, seqs: list, max_len: int | None = None) -> list:
        """The sequences (training.drafter_data.Sequence, token data) with their features,
        computed on the target's device; cut to max_len tokens first (the training cut)."""
        cut = [s.tokens[:max_len] if max_len else s.tokens for s in seqs]
        feats = self.features([c.numpy() if torch.is_tensor(c) else c for c in cut])
        return [
            dataclasses.replace(s, tokens=torch.as_tensor(c), features=f)
            for s, c, f in zip(seqs, cut, feats)
        ]


# ----------------------------------------------------------------------------- sharing


def share_frozen(model: torch.nn.Module, target: OnlineTarget) -> torch.nn.Module:
    """Point the drafter's frozen embedding / LM head buffers at the target's tensors (same
    storage, no copy; the target's dtype, bf16 on a GPU, read under autocast). Derived buffers
    (the state whitening, the time map) were computed from the same values when the drafter
    was made and stay as they are."""
    for name, t in (("embed", target.embed), ("lm_head", target.lm_head)):
        mine = getattr(model, name)
        if tuple(mine.shape) != tuple(t.shape):
            raise ValueError(
                f"the drafter's {name} is {tuple(mine.shape)}, the target's {tuple(t.shape)}"
            )
        setattr(model, name, t.detach())
    return model


def copy_sharing_frozen(model: torch.nn.Module) -> torch.nn.Module:
    """copy.deepcopy of a drafter whose frozen embedding / LM head stay the original's tensors
    (distillation's student and EMA, the acceptance check's copy: one of each in memory)."""
    memo = {id(model.embed): model.embed, id(model.lm_head): model.lm_head}
    return copy.deepcopy(model, memo)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- fit


def check_fits(
    model_cfg,
    target_dir: str | Path,
    *,
    max_len: int,
    meta: dict | None = None,
    target_max_len: int | None = None,
) -> None:
    """Refuse (ValueError naming the setting) a run whose drafter config, data or lengths do not
    fit the target, before anything is trained: the drafter's target shape and hashes, its
    feature layers, the data's target (vocabulary, embedding hash) and max_len against the
    target's context (target_max_len: its max_position_embeddings when None)."""
    from flashmap.checkpoint import read_config

    c = read_config(target_dir)
    tgt = dict(
        vocab_size=int(c["vocab_size"]),
        target_hidden_size=int(c["hidden_size"]),
        target_num_layers=int(c["num_hidden_layers"]),
    )
    for key in ("vocab_size", "target_hidden_size", "target_num_layers"):
        if getattr(model_cfg, key) != tgt[key]:
            raise ValueError(
                f"the drafter has {key} {getattr(model_cfg, key)}, the target {target_dir} "
                f"{tgt[key]}: not a drafter for this target"
            )
    bad = [l for l in model_cfg.feature_layers if not 0 <= l < tgt["target_num_layers"]]
    if bad:
        raise ValueError(
            f"feature layers {bad} are not layers of the target ({tgt['target_num_layers']} layers)"
        )
    limit = target_max_len or int(c.get("max_position_embeddings", 0))
    if limit and max_len > limit:
        raise ValueError(f"--max-len {max_len} is past the target's context of {limit} tokens")
    if meta is not None:
        if int(meta["target_vocab_size"]) != tgt["vocab_size"]:
            raise ValueError(
                f"the data were made for a vocabulary of {meta['target_vocab_size']}, the target "
                f"has {tgt['vocab_size']}"
            )
        if meta.get("embed_hash") and meta["embed_hash"] != model_cfg.embed_hash:
            raise ValueError(
                "the data were made with another target (embedding hash differs): generate "
                "them with this target (python -m training.generate_data)"
            )


def training_bytes(n_params: int, n_copies: int = 1, shards: int = 1) -> int:
    """Device memory of a drafter's training state on one rank: weights, gradients and AdamW
    moments in fp32 (STATE_BYTES_PER_PARAM each; divided among `shards` ranks under FSDP2),
    plus n_copies - 1 more fp32 weight copies (distillation's teacher and EMA)."""
    return n_params * STATE_BYTES_PER_PARAM // shards + n_params * 4 * (n_copies - 1)


def check_memory(need_bytes: int, device) -> None:
    """On a GPU, refuse a run whose drafter state alone does not fit in what the loaded target
    left free (activations come on top)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(dev)
    if need_bytes > free:
        raise ValueError(
            f"the drafter's training state needs {need_bytes / 2**30:.1f} GiB, only "
            f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB are free on {dev} beside the "
            f"target: shard it with --fsdp over more GPUs, or train a smaller drafter"
        )
