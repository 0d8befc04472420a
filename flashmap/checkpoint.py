"""Reading Hugging Face Qwen3 checkpoint directories (config.json + safetensors + tokenizer).

Shared by the target engine and the drafter, which copies the target's embedding and LM
head. Handles single-file and sharded (model.safetensors.index.json) checkpoints.
This module imports no torch: tensors come back in the framework asked for (safetensors
imports it then), and content hashes are taken of numpy arrays.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or corrupt (message says which file)."""


@contextmanager
def config_fields(where: str):
    """Reading a config's fields: a missing one or one of the wrong type becomes a
    CheckpointError naming `where`."""
    try:
        yield
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e}") from None
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: bad field ({e})") from None


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (not a Hugging Face checkpoint directory?)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable config ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: config is not a JSON object")
    return cfg


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from None
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{single}: no such file")
    try:
        with safe_open(str(single), framework="numpy") as f:
            return {name: single for name in f.keys()}
    except Exception as e:  # safetensors raises several types for a corrupt header
        raise CheckpointError(f"{single}: corrupt safetensors file ({e})") from None


def load_tensors(
    model_dir: str | Path, names: list[str] | None = None, framework: str = "pt"
) -> dict:
    """Load the named tensors (all when names is None) from a checkpoint directory, as
    `framework` tensors (safetensors' names: "pt" for torch, "numpy")."""
    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    wanted = list(files) if names is None else names
    missing = [n for n in wanted if n not in files]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {missing[:5]}")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[n], []).append(n)
    out: dict = {}
    for path, ns in by_file.items():
        try:
            with safe_open(str(path), framework=framework) as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from None
    return out


def load_embeddings(model_dir: str | Path, framework: str = "pt") -> tuple:
    """The target's input embedding [V, H] and LM head [V, H] (the same tensor when tied)."""
    cfg = read_config(model_dir)
    files = _weight_files(Path(model_dir))
    names = ["model.embed_tokens.weight"]
    tied = cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in files
    if not tied:
        names.append("lm_head.weight")
    t = load_tensors(model_dir, names, framework)
    emb = t["model.embed_tokens.weight"]
    return emb, emb if tied else t["lm_head.weight"]


def array_hash(a: np.ndarray) -> str:
    """Content hash of an array's values as float32 bytes, to check a drafter was made for
    this target (torch callers pass `t.float().cpu().numpy()`)."""
    data = np.ascontiguousarray(a, dtype=np.float32).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
