"""Drafter checkpoints: a directory with config.json + model.safetensors (DESIGN.md, Checkpoints).

config.json is the DrafterConfig (architecture, target reference with the content hashes
of the target's embedding and LM head, feature layers, block size, flow settings) plus a
format tag. model.safetensors holds the trainable weights only; the frozen embedding /
LM head are taken from the target checkpoint at load and checked against the hashes, so a
drafter cannot silently run against a target it was not made for.
Every failure is a one-line CheckpointError naming the file or the mismatch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from flashmap.types import feature_layers_for
from target_service.checkpoint import CheckpointError, load_embeddings, read_config, tensor_hash

FORMAT = "flashmap-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


_TARGET_KEYS = ("vocab_size", "target_hidden_size", "target_num_layers")


def _hashes(embed: torch.Tensor, lm_head: torch.Tensor) -> tuple[str, str]:
    """Content hashes of the embedding and LM head (hashed once when tied)."""
    h = tensor_hash(embed)
    return h, h if lm_head is embed else tensor_hash(lm_head)


def _target_fields(target_dir: str | Path) -> dict:
    """Shape of the target as a drafter config sees it."""
    tcfg = read_config(target_dir)
    try:
        return dict(vocab_size=int(tcfg["vocab_size"]), target_hidden_size=int(tcfg["hidden_size"]),
                    target_num_layers=int(tcfg["num_hidden_layers"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(target_dir) / 'config.json'}: missing or bad field {e}") from None


def init_drafter(target_dir: str | Path, *, seed: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, **config_overrides) -> FlashMapDiT:
    """A freshly initialised drafter for the target in target_dir.

    config_overrides are DrafterConfig fields (dim=..., kind="dflash", ...); target
    fields and hashes come from the target. seed makes the init reproducible."""
    fixed = sorted(set(config_overrides) & {*_TARGET_KEYS, "embed_hash", "lm_head_hash"})
    if fixed:
        raise ValueError(f"{fixed} come from the target checkpoint and cannot be overridden")
    target = _target_fields(target_dir)
    embed, lm_head = load_embeddings(target_dir)
    embed_hash, lm_head_hash = _hashes(embed, lm_head)
    fields = dict(target_name=Path(target_dir).resolve().name,
                  feature_layers=feature_layers_for(target["target_num_layers"]))
    fields.update(config_overrides)
    fields.update(target, embed_hash=embed_hash, lm_head_hash=lm_head_hash)
    try:
        cfg = DrafterConfig(**fields)
        if seed is not None:
            torch.manual_seed(seed)
        model = FlashMapDiT(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad drafter config: {e}") from None
    model.set_target(embed, lm_head)
    return model.to(device, dtype)


def save_drafter(model: FlashMapDiT, directory: str | Path) -> Path:
    """Write config.json + model.safetensors (trainable weights only) into directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Write to temporaries and rename, so a crash never leaves a half-written checkpoint.
    tmp_w, tmp_c = directory / f".{WEIGHTS_FILE}.tmp", directory / f".{CONFIG_FILE}.tmp"
    save_file(weights, str(tmp_w), metadata={"format": FORMAT})
    tmp_c.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **model.cfg.to_dict()},
                                indent=2, sort_keys=True) + "\n")
    os.replace(tmp_w, directory / WEIGHTS_FILE)
    os.replace(tmp_c, directory / CONFIG_FILE)
    return directory


def read_drafter_config(directory: str | Path) -> DrafterConfig:
    """The DrafterConfig stored in a drafter checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such drafter checkpoint directory")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (not a drafter checkpoint directory?)")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable drafter config ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a drafter config (missing \"format\": \"{FORMAT}\")")
    if d.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported format_version {d.get('format_version')!r} "
                              f"(this build reads {FORMAT_VERSION})")
    d = {k: v for k, v in d.items() if k not in ("format", "format_version")}
    try:
        return DrafterConfig.from_dict(d).validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad drafter config ({e})") from None


def check_target(cfg: DrafterConfig, target_dir: str | Path, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Raise CheckpointError unless the target in target_dir is the one cfg was made for."""
    target = _target_fields(target_dir)
    mine = {k: getattr(cfg, k) for k in target}
    if mine != target:
        diff = ", ".join(f"{k} {mine[k]} vs {target[k]}" for k in target if mine[k] != target[k])
        raise CheckpointError(f"drafter was made for another target ({cfg.target_name!r}): "
                              f"{diff} (drafter vs {target_dir})")
    got_hashes = _hashes(embed, lm_head)
    for name, got, want in zip(("embedding", "LM head"), got_hashes, (cfg.embed_hash, cfg.lm_head_hash)):
        if got != want:
            raise CheckpointError(f"drafter was made for another target ({cfg.target_name!r}): {name} hash "
                                  f"{got} of {target_dir} differs from the drafter's {want}")


def load_drafter(directory: str | Path, target_dir: str | Path, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> FlashMapDiT:
    """Load a drafter, attaching (and checking) the frozen embedding / LM head of target_dir."""
    directory = Path(directory)
    cfg = read_drafter_config(directory)
    embed, lm_head = load_embeddings(target_dir)
    check_target(cfg, target_dir, embed, lm_head)

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        weights = load_file(str(path))
    except Exception as e:  # safetensors raises several types for a corrupt header / truncated data
        raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from None

    with torch.device("meta"):
        model = FlashMapDiT(cfg)  # no allocation until the weights are assigned
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    bad = [f"{k} {tuple(weights[k].shape)} vs {want[k]}" for k in want if tuple(weights[k].shape) != want[k]]
    if bad:
        raise CheckpointError(f"{path}: weight shape mismatch: {'; '.join(bad[:3])} (stored vs config)")
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
    model.set_target(embed, lm_head)
    return model.to(device, dtype).eval()
