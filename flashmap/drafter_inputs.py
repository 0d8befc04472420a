"""What the target computes for a drafter: which layers' hidden states, and the drafter's own
first step on them, read from the drafter's checkpoint directory.

Every drafter starts the same way: the target's hidden states of a few layers, concatenated
(width F = layers x target hidden), go through one linear map to the drafter's context width
D, and most then through an RMS norm:

    FlashMap / DFlash-style (this project's format)   ctx_proj [D, F], ctx_norm [D]
    EAGLE-style (this project's format)               feat_proj [D, F], feat_norm [D]
    DFlash (published)                                fc [H, F], hidden_norm [H]
    EAGLE-3 (published)                               fc [H, F] (no norm: its residual is fc's output)

A target that applies this step itself ("context projection") sends D values per committed
token instead of F (not when D = F: the drafter tells the two apart by width): 10x fewer bytes
for the paper-size FlashMap drafter on Qwen3-8B (2,048
against 5 x 4,096), 5x for DFlash, 3x for EAGLE-3. The drafter takes either width.
No torch import: the target and the drafter each run the map in their own framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashmap.checkpoint import CheckpointError, load_tensors, read_config
from flashmap.types import feature_layers_for


@dataclass
class ContextProjection:
    weight: np.ndarray  # [D, F] float32
    norm: np.ndarray | None  # [D] float32 RMS-norm gain, or None
    eps: float

    @property
    def width(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """The map on the host (numpy; tests and references): [.., F] -> [.., D] float32."""
        c = np.asarray(features, np.float32) @ self.weight.T
        if self.norm is not None:
            c = c / np.sqrt(np.mean(c * c, -1, keepdims=True) + self.eps) * self.norm
        return c


def eagle3_default_layers(num_target_layers: int) -> list[int]:
    """SGLang's default EAGLE-3 layers, the outputs of layers 1, N/2 - 1 and N - 4 of an N-layer
    target; where those are not three distinct layers (tiny targets), three evenly spaced over
    all of them."""
    n = num_target_layers
    ids = [1, n // 2 - 1, n - 4]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, 3)})


@dataclass
class DrafterInputs:
    layout: str  # "flashmap" (the project's format), "dflash" or "eagle3" (published)
    feature_layers: list[int]  # decoder-layer outputs, 0-based, in the drafter's order
    projection: tuple[str, str | None, float]  # (linear weight name, norm weight name, eps)


def drafter_inputs(drafter_dir: str | Path, target_num_layers: int) -> DrafterInputs:
    """The layers a drafter checkpoint reads and the names of its context projection."""
    d = read_config(drafter_dir)
    arch = d.get("architectures") or []
    if "DFlashDraftModel" in arch:
        sub = d.get("dflash_config") or {}
        layers = sub.get("target_layer_ids", d.get("target_layer_ids"))
        if not layers:
            raise CheckpointError(f"{Path(drafter_dir) / 'config.json'}: no target_layer_ids")
        return DrafterInputs(
            "dflash",
            [int(x) for x in layers],
            ("fc.weight", "hidden_norm.weight", float(d.get("rms_norm_eps", 1e-6))),
        )
    if "LlamaForCausalLMEagle3" in arch:
        n = target_num_layers
        layers = (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        ) or eagle3_default_layers(n)
        return DrafterInputs("eagle3", [int(x) for x in layers], ("fc.weight", None, 0.0))
    layers = d.get("feature_layers") or feature_layers_for(target_num_layers)
    eps = float(d.get("norm_eps", 1e-6))
    if d.get("kind") == "eagle":
        return DrafterInputs(
            "flashmap", [int(x) for x in layers], ("feat_proj.weight", "feat_norm.weight", eps)
        )
    return DrafterInputs(
        "flashmap", [int(x) for x in layers], ("ctx_proj.weight", "ctx_norm.weight", eps)
    )


def read_context_projection(drafter_dir: str | Path, target_num_layers: int) -> ContextProjection:
    """The drafter's context projection, from its checkpoint directory."""
    inputs = drafter_inputs(drafter_dir, target_num_layers)
    w_name, n_name, eps = inputs.projection
    names = [w_name] + ([n_name] if n_name else [])
    # Through torch: drafter weights are often bf16, which numpy cannot hold (the target and the
    # drafter, which call this, have torch).
    t = {k: v.float().numpy() for k, v in load_tensors(drafter_dir, names, framework="pt").items()}
    weight = t[w_name]
    if weight.shape[1] % len(inputs.feature_layers):
        raise CheckpointError(
            f"{drafter_dir}: {w_name} {weight.shape} does not take {len(inputs.feature_layers)} layers"
        )
    norm = t[n_name] if n_name else None
    return ContextProjection(weight, norm, eps)


def checkpoint_dir(drafter: str | Path | None) -> Path | None:
    """The drafter checkpoint directory a drafter spec names; None for one made where it runs
    ("init", a test oracle), which reads the target's default layers, unprojected."""
    if drafter is None or not (Path(drafter) / "config.json").is_file():
        return None
    return Path(drafter)


def target_inputs(
    drafter_dir: str | Path | None,
    target_dir: str | Path,
    feature_layers: list[int] | None = None,
    project: bool = True,
) -> tuple[list[int] | None, ContextProjection | None]:
    """What a target serving this drafter computes: its layers (feature_layers, if given, must
    be the same) and, with project, its context projection. No drafter: (feature_layers, None),
    the target's default layers and no projection."""
    if drafter_dir is None:
        return feature_layers, None
    n = int(read_config(target_dir)["num_hidden_layers"])
    inputs = drafter_inputs(drafter_dir, n)
    if feature_layers is not None and list(feature_layers) != inputs.feature_layers:
        raise CheckpointError(
            f"feature_layers {list(feature_layers)} are not the drafter's {inputs.feature_layers} "
            f"({drafter_dir})"
        )
    proj = read_context_projection(drafter_dir, n) if project else None
    if proj is not None and proj.width == proj.weight.shape[1]:
        # A drafter tells raw from projected context by its width: equal widths would be
        # ambiguous, and projecting would save no bytes.
        proj = None
    return inputs.feature_layers, proj
