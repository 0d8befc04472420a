"""A Hugging Face Qwen3 checkpoint's configuration as the target engine reads it: config.json
(transformers 4.x or 5.x layout; what this engine cannot run is refused) and the extra stop
ids of generation_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from flashmap.checkpoint import CheckpointError
from flashmap.rope_config import read_rope_parameters


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: tuple[int, ...] = field(default=())  # normalised: HF allows int, list or null

    @classmethod
    def from_dict(cls, cfg: dict) -> Qwen3Config:
        """Build from an HF config.json dict (transformers 4.x or 5.x layout)."""
        if cfg.get("attention_bias", False):
            raise CheckpointError("config.json: attention_bias=true is not Qwen3 (unsupported)")
        if cfg.get("use_sliding_window", False):
            raise CheckpointError("config.json: sliding-window attention is unsupported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos = (
                ()
                if eos is None
                else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            )
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                eos_token_id=eos,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
        except CheckpointError:
            raise
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: bad field value ({e})") from None


def _rope_theta(cfg: dict) -> float:
    """rope_theta as transformers reads it (flashmap.rope_config); the engine's RoPE tables
    are the default kind's, so a scaled kind is refused."""
    rope = read_rope_parameters(cfg, "config.json")
    if rope.rope_type != "default":
        raise CheckpointError(
            f"config.json: rope_type {rope.rope_type!r} (rope_scaling / rope_parameters) is not "
            "supported by the target engine (only 'default')"
        )
    return rope.theta


def generation_eos(model_dir: Path) -> list[int]:
    """Extra stop ids from generation_config.json (Qwen3 lists <|endoftext|> there too)."""
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
