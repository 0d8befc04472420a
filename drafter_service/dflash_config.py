"""The config.json of a published DFlash drafter (z-lab's layout): the fields the model reads,
read as the reference loaders read them (transformers' Qwen3Config under z-lab's model, SGLang
and SpecForge), and written back.

`dflash_config: {target_layer_ids, mask_token_id, ...}` first, then the top level (as the
reference does). RoPE as flashmap.rope_config reads it (`rope_parameters` or `rope_theta`,
transformers' default base when neither; the scaled kinds linear, llama3 and yarn honoured,
others refused by name).

Layers may be "sliding_attention" (`layer_types`, with `use_sliding_window` and
`sliding_window`, as Qwen3Config reads them): a block position at p then sees the keys at
positions > p - sliding_window only, and, unless `is_causal` says otherwise, only the block
positions up to its own. The reference loaders resolve it so: an explicit `is_causal` applies
to every layer, else sliding layers are causal and full ones bidirectional. A bidirectional
sliding layer whose window is shorter than the block is refused (the references disagree on
its right edge).
"""

from __future__ import annotations

from dataclasses import dataclass

from drafter_service.layers import Rotary
from flashmap.checkpoint import CheckpointError, config_fields
from flashmap.rope_config import RopeParameters, read_rope_parameters, rope_config_fields

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS_FILE = "model.safetensors"
# transformers' Qwen3Config defaults, for configs without the field
QWEN3_MAX_POSITIONS = 32768
QWEN3_SLIDING_WINDOW = 4096
QWEN3_MAX_WINDOW_LAYERS = 28
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class DFlashConfig:
    """The fields of a published DFlash config.json that the model reads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16  # positions of the block: the anchor and block_size - 1 drafts
    rms_norm_eps: float = 1e-6
    rope: RopeParameters = RopeParameters()
    max_position_embeddings: int = QWEN3_MAX_POSITIONS
    layer_types: tuple[str, ...] = ()  # () : every layer full_attention
    sliding_window: int | None = None  # the window of the sliding_attention layers
    is_causal: bool | None = None  # None: sliding layers causal, full ones bidirectional
    attention_bias: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def target_hidden_size(self) -> int:  # FrozenTarget: the embedding / LM head width
        return self.hidden_size

    @property
    def feature_dim(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def attention(self, layer: int) -> tuple[bool, int | None]:
        """Layer `layer`'s attention inside the block: (causal, window or None)."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == SLIDING
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, self.sliding_window if sliding else None

    @staticmethod
    def from_json(d: dict, where: str = "config.json") -> DFlashConfig:
        """From a published config dict: `dflash_config` first, then the top level."""
        sub = d.get("dflash_config") or {}
        get = lambda k, default=None: sub.get(k, d.get(k, default))  # noqa: E731
        with config_fields(where):
            heads = int(d["num_attention_heads"])
            head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // heads)
            positions = int(d.get("max_position_embeddings") or QWEN3_MAX_POSITIONS)
            rope_params = read_rope_parameters(d, where, positions)
            Rotary(rope_params, head_dim, positions, where)  # refuses what it cannot run
            block_size = int(get("block_size", 16))
            types, window, causal = attention_layout(d, block_size, where)
            ids = get("target_layer_ids")
            if not ids:
                raise KeyError("dflash_config.target_layer_ids")
            if get("mask_token_id") is None:
                raise KeyError("dflash_config.mask_token_id")
            softcap = get("final_logit_softcapping")
            return DFlashConfig(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=head_dim,
                vocab_size=int(d["vocab_size"]),
                target_layer_ids=tuple(int(i) for i in ids),
                mask_token_id=int(get("mask_token_id")),
                block_size=block_size,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=rope_params,
                max_position_embeddings=positions,
                layer_types=types,
                sliding_window=window,
                is_causal=causal,
                attention_bias=bool(d.get("attention_bias", False)),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None else float(softcap),
            )


def is_dflash(config: dict) -> bool:
    """Whether a config.json dict is a published DFlash drafter."""
    return ARCHITECTURE in (config.get("architectures") or [])


def attention_layout(
    d: dict, block_size: int, where: str
) -> tuple[tuple[str, ...], int | None, bool | None]:
    """(layer_types, sliding_window, is_causal) of a config dict, as transformers' Qwen3Config
    reads them (the window only with use_sliding_window; without layer_types, the layers from
    max_window_layers on slide); what the block cannot run is refused, naming the field."""
    n = int(d["num_hidden_layers"])
    window = d.get("sliding_window", QWEN3_SLIDING_WINDOW) if d.get("use_sliding_window") else None
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS))
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise CheckpointError(f"{where}: layer_types {types!r} is not a list of {n} layer kinds")
    bad = sorted({t for t in types if t not in (FULL, SLIDING)})
    if bad:
        raise CheckpointError(f"{where}: layer_types has {bad}; supported: {FULL!r}, {SLIDING!r}")
    causal = d.get("is_causal")
    if causal is not None and not isinstance(causal, bool):
        raise CheckpointError(f"{where}: is_causal {causal!r} is not a boolean")
    if SLIDING not in types:
        return tuple(types), None, causal
    if window is None:
        raise CheckpointError(
            f"{where}: layer_types has {SLIDING!r} layers but no window (use_sliding_window "
            f"{d.get('use_sliding_window')!r}, sliding_window {d.get('sliding_window')!r})"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"{where}: sliding_window {window!r} is not a positive integer")
    if causal is False and window < block_size:
        raise CheckpointError(
            f"{where}: sliding_window {window} < block_size {block_size} with is_causal false: "
            "a bidirectional window shorter than the block is not supported"
        )
    return tuple(types), window, causal


def published_config(cfg: DFlashConfig) -> dict:
    """config.json of a DFlash checkpoint in the published layout."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
        },
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_config_fields(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types or [FULL] * cfg.num_hidden_layers),
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        **({} if cfg.is_causal is None else {"is_causal": cfg.is_causal}),
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
