"""The features the target engine keeps: every cached position's feature-layer hidden states
(or their context projection) of every slot, on the engine's device, [slots, positions, F or D].

A verify writes the features of each row's positions here (`keep`), projected first when the
engine has the drafter's context projection (flashmap.drafter_inputs: D values per position
leave the engine instead of F), and hands back only those a row asks for; a later row of the
sequence reads the ones before it (`before`, VerifyRow.features_from). Handed back in
features_dtype: on the host (numpy) or, for the in-process drafter, on the device (tensors).
"""

from __future__ import annotations

import numpy as np
import torch

from flashmap.drafter_inputs import ContextProjection
from flashmap.types import VerifyRow
from target_service.qwen3 import cast_features


class KeptFeatures:
    def __init__(
        self,
        n_slots: int,
        max_seq_len: int,
        n_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        features_dtype: torch.dtype = torch.float32,
        context_projection: ContextProjection | None = None,
    ):
        """n_layers feature layers of hidden_size each (F = n_layers * hidden_size); dtype: the
        model's (the projection runs in it); features_dtype: of the features handed back."""
        self._projection = None
        width = n_layers * hidden_size
        if context_projection is not None:
            p = context_projection
            if p.weight.shape[1] != width:
                raise ValueError(
                    f"the context projection takes {p.weight.shape[1]} features, the target "
                    f"makes {width} ({n_layers} layers of {hidden_size})"
                )
            self._projection = (
                torch.as_tensor(p.weight, dtype=dtype, device=device),
                None if p.norm is None else torch.as_tensor(p.norm, dtype=dtype, device=device),
                p.eps,
            )
            width = p.width
        shape = (n_slots, max_seq_len, width)
        self._host_dtype = np.float16 if features_dtype == torch.float16 else np.float32
        # numpy's zeros leave untouched pages unmapped; torch's would write them all.
        if device.type == "cpu":
            self._features = torch.from_numpy(np.zeros(shape, self._host_dtype))
        else:
            self._features = torch.zeros(shape, dtype=features_dtype, device=device)
        # Cast by torch where the features are made (on the device before a GPU's copy): numpy's
        # float16 casts are several times slower than torch's.
        self.features_dtype = features_dtype

    @property
    def width(self) -> int:
        """Features per position: F, or D with the context projection."""
        return self._features.shape[-1]

    @property
    def bytes_per_token(self) -> int:
        return self._features.shape[-1] * self._features.element_size()

    def keep(
        self, rows: list[VerifyRow], features: torch.Tensor, src: list[np.ndarray], on_device: bool
    ) -> list[np.ndarray | torch.Tensor]:
        """Project and keep each row's features, rows src[i] of `features` ([T, F] on the
        device), at its positions (one scatter for all rows); returns each row's features
        [len(src[i]), F or D] in features_dtype on the host (on the device with on_device), or
        none ([0, F or D]) for a row that does not ask."""
        features = cast_features(self.project(features), self.features_dtype)
        dev = features.device
        slot = np.concatenate([np.full(len(i), r.slot) for r, i in zip(rows, src)])
        pos = np.concatenate([r.start_pos + np.arange(len(i)) for r, i in zip(rows, src)])
        self._features[torch.as_tensor(slot, device=dev), torch.as_tensor(pos, device=dev)] = (
            features[torch.as_tensor(np.concatenate(src), device=dev)]
        )
        asked = [i for r, i in zip(rows, src) if r.features]
        if on_device:
            ids = torch.as_tensor(np.concatenate(asked or [np.zeros(0, np.int64)]), device=dev)
            parts = iter(features[ids].split([len(i) for i in asked] or [0]))
            return [next(parts) if r.features else features[:0] for r in rows]
        host = np.zeros((0, features.shape[1]), self._host_dtype)
        if asked:  # one copy off the device for every row that asks
            host = features[torch.as_tensor(np.concatenate(asked), device=dev)].cpu().numpy()
        parts = iter(np.split(host, np.cumsum([len(i) for i in asked])[:-1]))
        return [next(parts) if r.features else host[:0] for r in rows]

    def before(
        self, slot: int, start: int, stop: int, on_device: bool
    ) -> np.ndarray | torch.Tensor:
        """The kept features of positions start .. stop-1 of a slot [stop - start, F or D]: a
        copy, since the in-process drafter holds them until its next draft call, and a later
        verify may rewrite the slot (a rebuilt cache, a slot handed to another sequence)."""
        kept = self._features[slot, start:stop]
        return kept.clone() if on_device else np.array(kept.cpu())

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The context projection of features [T, F] -> [T, D] (as they are without one)."""
        if self._projection is None:
            return features
        w, norm, eps = self._projection
        c = torch.nn.functional.linear(features.to(w.dtype), w)
        return c if norm is None else torch.nn.functional.rms_norm(c, (c.shape[-1],), norm, eps)


def join_features(parts: list) -> np.ndarray | torch.Tensor:
    """Row pieces of features, on the host (numpy) or on the device (tensors), joined."""
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)
