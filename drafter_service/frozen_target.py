"""The target's frozen embedding and LM head inside a drafter network: the base class
(`FrozenTarget`) of FlashMapDiT, the EAGLE-style drafter and the published DFlash.

Both are [V, H] non-persistent buffers: not parameters and not in the state dict (they come
from the target checkpoint, see drafter_service/checkpoint.py), checked against the drafter's
config when attached.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor


class FrozenTarget(nn.Module):
    """Base of the drafter networks (FlashMapDiT, eagle.EagleDrafter, dflash.DFlashDrafter): the target's frozen
    embedding / LM head [V, H] as non-persistent buffers, checked against self.cfg."""

    def _init_target(self, embed: Tensor | None, lm_head: Tensor | None) -> None:
        """Register the buffers (empty placeholders until the target is attached)."""
        V, H = self.cfg.vocab_size, self.cfg.target_hidden_size
        self.register_buffer(
            "embed", torch.empty(V, H) if embed is None else embed, persistent=False
        )
        self.register_buffer(
            "lm_head", torch.empty(V, H) if lm_head is None else lm_head, persistent=False
        )
        self._check_target_shapes()
        if embed is not None:
            self._target_attached()

    def _target_attached(self) -> None:
        """Hook for what a subclass derives from the frozen target tensors."""

    def _check_target_shapes(self) -> None:
        want = (self.cfg.vocab_size, self.cfg.target_hidden_size)
        for name in ("embed", "lm_head"):
            if tuple(getattr(self, name).shape) != want:
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, config wants {want}"
                )

    def set_target(self, embed: Tensor, lm_head: Tensor) -> None:
        """Attach the frozen target embedding / LM head [V, H] (cast to the model's dtype)."""
        ref = next(self.parameters())
        self.embed = embed.detach().to(ref.device, ref.dtype)
        self.lm_head = lm_head.detach().to(ref.device, ref.dtype)
        self._check_target_shapes()
        self._target_attached()
