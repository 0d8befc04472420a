"""The rotary-embedding settings of a Hugging Face config.json, read as transformers 5 reads them
(`RotaryEmbeddingConfigMixin`: `convert_rope_params_to_dict`, `standardize_rope_params`), for
every config the project loads: the target's and the published drafters'.

transformers 4.x wrote `rope_theta` at the top level and a scaled RoPE under `rope_scaling`
(its kind under `type` or `rope_type`); 5.x writes one `rope_parameters` object holding
`rope_type` and `rope_theta`. Either way the result is the same standardized parameters:

- the object is `rope_scaling` when present and non-empty, else `rope_parameters`;
- `rope_theta` inside it wins over the top-level one, which wins over transformers'
  `default_theta` (10,000: Llama and Qwen3 alike);
- the kind is `rope_type`, else `type`, else "default";
- the scaled kinds that need the pretraining length (llama3, yarn, longrope) take
  `original_max_position_embeddings` from the top level when it is there, else from the
  object, else the config's `max_position_embeddings` (whose default depends on the model
  class, so the caller gives it). (A config object transformers has just built may still
  show the object's value; its rotary embedding standardizes again and reads the top level.)

What no consumer here implements is refused by name: a null or non-numeric `rope_theta`,
`partial_rotary_factor` other than 1, parameters nested per layer type. Which RoPE kinds a
consumer runs is its own choice (the target runs "default" only). No torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from flashmap.checkpoint import CheckpointError

DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_NEEDS_PRETRAINING_LENGTH = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeParameters:
    """Standardized RoPE parameters: the base, the kind, and the kind's other fields (factor,
    original_max_position_embeddings, ...) as sorted (key, value) pairs."""

    theta: float = DEFAULT_ROPE_THETA
    rope_type: str = "default"
    fields: tuple[tuple[str, object], ...] = ()

    def as_dict(self) -> dict:
        """The standardized `rope_parameters` object, as transformers 5 writes it."""
        return {**dict(self.fields), "rope_type": self.rope_type, "rope_theta": self.theta}

    @staticmethod
    def default(theta: float = DEFAULT_ROPE_THETA) -> RopeParameters:
        return RopeParameters(float(theta))


def read_rope_parameters(
    cfg: dict, where: str = "config.json", max_position_embeddings: int | None = None
) -> RopeParameters:
    """The RoPE of a config.json dict (4.x or 5.x layout). max_position_embeddings: the config's
    value, or the model class's default when it has none (llama3 / yarn / longrope read it)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: {key} must be an object, got {params!r}")
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:
        raise CheckpointError(
            f"{where}: {key} nested per layer type ({', '.join(nested)}) is not supported"
        )
    params = dict(params)
    theta = params.pop("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise CheckpointError(f"{where}: rope_theta {json.dumps(theta)} is not a number")
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if not isinstance(kind, str):
        raise CheckpointError(f"{where}: {key}.rope_type {kind!r} is not a string")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise CheckpointError(
            f"{where}: partial_rotary_factor {partial!r} is not supported (RoPE over whole heads)"
        )
    params.pop("partial_rotary_factor", None)
    if kind in _NEEDS_PRETRAINING_LENGTH:
        if cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif max_position_embeddings is not None:
            params.setdefault("original_max_position_embeddings", int(max_position_embeddings))
    return RopeParameters(float(theta), kind, tuple(sorted(params.items())))


def rope_config_fields(params: RopeParameters) -> dict:
    """The RoPE fields of a config.json this project writes: `rope_parameters` (read by
    transformers 5) and `rope_theta` (4.x), and for a scaled kind `rope_scaling` too (where 4.x
    reads it; 5.x reads the same object there)."""
    out = {"rope_theta": params.theta, "rope_parameters": params.as_dict()}
    if params.rope_type != "default":
        out["rope_scaling"] = params.as_dict()
    return out
