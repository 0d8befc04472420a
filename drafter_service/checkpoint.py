"""Drafter checkpoints: a directory with config.json + model.safetensors (docs/ARCHITECTURE.md, Checkpoints).

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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from flashmap.checkpoint import CheckpointError, array_hash, load_embeddings, read_config
from flashmap.types import feature_layers_for

FORMAT = "flashmap-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


_TARGET_KEYS = ("vocab_size", "target_hidden_size", "target_num_layers")


def _hashes(embed: torch.Tensor, lm_head: torch.Tensor) -> tuple[str, str]:
    """Content hashes of the embedding and LM head (hashed once when tied)."""
    h = tensor_hash(embed)
    return h, h if lm_head is embed else tensor_hash(lm_head)


def tensor_hash(t: torch.Tensor) -> str:
    """flashmap.checkpoint.array_hash of a tensor's values."""
    return array_hash(t.detach().float().cpu().numpy())


def _target_fields(target_dir: str | Path) -> dict:
    """Shape of the target as a drafter config sees it."""
    tcfg = read_config(target_dir)
    try:
        return dict(
            vocab_size=int(tcfg["vocab_size"]),
            target_hidden_size=int(tcfg["hidden_size"]),
            target_num_layers=int(tcfg["num_hidden_layers"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{Path(target_dir) / 'config.json'}: missing or bad field {e}"
        ) from None


def init_model(
    model_cls: type,
    config_cls: type,
    label: str,
    target_dir: str | Path,
    *,
    seed: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    config_overrides: dict | None = None,
    defaults: Callable[[dict], dict] | None = None,
):
    """A freshly initialised model_cls(config_cls(...)) for the target in target_dir (any drafter
    kind: FlashMapDiT / DrafterConfig here, EagleDrafter / EagleConfig in drafter_service.eagle).

    Fields: target name and feature layers from the target, then defaults(target fields),
    then config_overrides; target shape and hashes always come from the target. seed makes the
    init reproducible. label names the config in errors ("bad {label} config")."""
    config_overrides = config_overrides or {}
    fixed = sorted(set(config_overrides) & {*_TARGET_KEYS, "embed_hash", "lm_head_hash"})
    if fixed:
        raise ValueError(f"{fixed} come from the target checkpoint and cannot be overridden")
    target = _target_fields(target_dir)
    embed, lm_head = load_embeddings(target_dir)
    embed_hash, lm_head_hash = _hashes(embed, lm_head)
    fields = dict(
        target_name=Path(target_dir).resolve().name,
        feature_layers=feature_layers_for(target["target_num_layers"]),
    )
    fields.update(defaults(target) if defaults else {})
    fields.update(config_overrides)
    fields.update(target, embed_hash=embed_hash, lm_head_hash=lm_head_hash)
    try:
        cfg = config_cls(**fields)
        if seed is not None:
            torch.manual_seed(seed)
        model = model_cls(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad {label} config: {e}") from None
    model.set_target(embed, lm_head)
    return model.to(device, dtype)


def init_drafter(
    target_dir: str | Path,
    *,
    seed: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> FlashMapDiT:
    """A freshly initialised drafter for the target in target_dir.

    config_overrides are DrafterConfig fields (dim=..., kind="dflash", ...); target
    fields and hashes come from the target. seed makes the init reproducible."""
    return init_model(
        FlashMapDiT,
        DrafterConfig,
        "drafter",
        target_dir,
        seed=seed,
        device=device,
        dtype=dtype,
        config_overrides=config_overrides,
    )


def save_drafter(model: torch.nn.Module, directory: str | Path) -> Path:
    """Write config.json (model.cfg + format tag) + model.safetensors (trainable weights only)
    into directory. Any drafter kind (FlashMapDiT, eagle.EagleDrafter)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Write to temporaries and rename, so a crash never leaves a half-written checkpoint.
    tmp_w, tmp_c = directory / f".{WEIGHTS_FILE}.tmp", directory / f".{CONFIG_FILE}.tmp"
    save_file(weights, str(tmp_w), metadata={"format": FORMAT})
    tmp_c.write_text(
        json.dumps(
            {"format": FORMAT, "format_version": FORMAT_VERSION, **model.cfg.to_dict()},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    os.replace(tmp_w, directory / WEIGHTS_FILE)
    os.replace(tmp_c, directory / CONFIG_FILE)
    return directory


def _read_tagged(path: Path) -> dict:
    """The JSON object in a drafter checkpoint's config.json, checked for the format tag."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (not a drafter checkpoint directory?)")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable drafter config ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f'{path}: not a drafter config (missing "format": "{FORMAT}")')
    return d


def checkpoint_kind(directory: str | Path) -> str:
    """The "kind" of a drafter checkpoint directory ("flashmap", "dflash", "eagle")."""
    return str(_read_tagged(Path(directory) / CONFIG_FILE).get("kind", "flashmap"))


def read_model_config(
    directory: str | Path,
    config_cls: type,
    label: str,
    kind: str | None = None,
    kind_name: str = "",
):
    """config_cls stored in a drafter checkpoint directory (format tag and version checked;
    with `kind`, a checkpoint of another kind is refused as "not {kind_name}")."""
    path = Path(directory) / CONFIG_FILE
    d = _read_tagged(path)
    if kind is not None and str(d.get("kind", "flashmap")) != kind:
        raise CheckpointError(
            f"{path}: a {str(d.get('kind', 'flashmap'))!r} drafter, not {kind_name}"
        )
    if d.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: unsupported format_version {d.get('format_version')!r} "
            f"(this build reads {FORMAT_VERSION})"
        )
    d = {k: v for k, v in d.items() if k not in ("format", "format_version")}
    try:
        return config_cls.from_dict(d).validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad {label} config ({e})") from None


def read_drafter_config(directory: str | Path) -> DrafterConfig:
    """The DrafterConfig stored in a drafter checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such drafter checkpoint directory")
    return read_model_config(directory, DrafterConfig, "drafter")


def check_target(cfg, target_dir: str | Path, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Raise CheckpointError unless the target in target_dir is the one cfg (any drafter
    config with the target-reference fields) was made for."""
    target = _target_fields(target_dir)
    mine = {k: getattr(cfg, k) for k in target}
    if mine != target:
        diff = ", ".join(f"{k} {mine[k]} vs {target[k]}" for k in target if mine[k] != target[k])
        raise CheckpointError(
            f"drafter was made for another target ({cfg.target_name!r}): "
            f"{diff} (drafter vs {target_dir})"
        )
    got_hashes = _hashes(embed, lm_head)
    for name, got, want in zip(
        ("embedding", "LM head"), got_hashes, (cfg.embed_hash, cfg.lm_head_hash)
    ):
        if got != want:
            raise CheckpointError(
                f"drafter was made for another target ({cfg.target_name!r}): {name} hash "
                f"{got} of {target_dir} differs from the drafter's {want}"
            )


def load_model(
    model_cls: type,
    cfg,
    directory: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """model_cls(cfg) with the weights of directory, attaching (and checking) the frozen
    embedding / LM head of target_dir. cfg: the checkpoint's config (read_model_config)."""
    directory = Path(directory)
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
        model = model_cls(cfg)  # no allocation until the weights are assigned
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    bad = [
        f"{k} {tuple(weights[k].shape)} vs {want[k]}"
        for k in want
        if tuple(weights[k].shape) != want[k]
    ]
    if bad:
        raise CheckpointError(
            f"{path}: weight shape mismatch: {'; '.join(bad[:3])} (stored vs config)"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
    model.set_target(embed, lm_head)
    return model.to(device, dtype).eval()


def load_drafter(
    directory: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> FlashMapDiT:
    """Load a drafter, attaching (and checking) the frozen embedding / LM head of target_dir."""
    return load_model(
        FlashMapDiT, read_drafter_config(directory), directory, target_dir, device, dtype
    )
