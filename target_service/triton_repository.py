"""The model repository tritonserver serves: a copy of target_service/model_repository with
the settings of this server written into its config.pbtxt: the ones Triton acts on (slots,
idle timeout, queue delay, the FEATURES type), which model.py reads back from its config so
the sequence batcher and the model agree on them, and the model's own settings
(TargetModelConfig, as one JSON parameter: target_service.target_config).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from target_service.target_config import PARAMETER, TargetModelConfig

MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"
MODEL_NAME = "flashmap_target"


def write_model_repository(
    dest: Path,
    *,
    n_slots: int | None = None,
    idle_timeout_s: float | None = None,
    max_queue_delay_us: int | None = None,
    features_dtype: str | None = None,
    model: TargetModelConfig | None = None,
    source: Path = MODEL_REPOSITORY,
) -> Path:
    """Copy the model repository to dest, writing the given settings into config.pbtxt.

    Triton's (the sequence batcher, the output type), which model.py reads back from its
    config, left as None keep the checked-in values; the model's (checkpoint, dtype, ...)
    replace the PARAMETER's JSON (TargetModelConfig.to_json: the settings that differ from
    their defaults).
    """
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    cfg_path = dest / MODEL_NAME / "config.pbtxt"
    text = cfg_path.read_text()
    if n_slots is not None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        # One KV slot per sequence: Triton keeps at most n_slots sequences active (others wait
        # in its backlog) and a batch holds at most one request per sequence.
        text = _set_field(text, "max_batch_size", str(n_slots))
        text = _set_field(text, "max_candidate_sequences", str(n_slots))
    if idle_timeout_s is not None:
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        text = _set_field(text, "max_sequence_idle_microseconds", str(int(idle_timeout_s * 1e6)))
    if max_queue_delay_us is not None:
        text = _set_field(text, "max_queue_delay_microseconds", str(int(max_queue_delay_us)))
    if features_dtype is not None:
        # model.py sends FEATURES in whatever type this output declares.
        triton_type = {"float32": "TYPE_FP32", "float16": "TYPE_FP16"}[features_dtype]
        text, n = re.subn(
            r'(name: "FEATURES"\s*data_type: )TYPE_\w+', lambda m: m.group(1) + triton_type, text
        )
        if n != 1:
            raise ValueError(f"{cfg_path}: could not find the FEATURES output")
    if model is not None:
        text, n = re.subn(
            rf'(?m)^(\s*{{ key: "{PARAMETER}"\s*value: {{ string_value: )"[^"]*"',  # not a comment
            lambda m: m.group(1) + _quoted(model.to_json()),
            text,
        )
        if n != 1:
            raise ValueError(f"{cfg_path}: could not find the {PARAMETER} parameter")
    cfg_path.write_text(text)
    return dest


def _set_field(text: str, name: str, value: str) -> str:
    new, n = re.subn(rf"(\b{name}:\s*)[^\s\]]+", lambda m: m.group(1) + value, text)
    if n != 1:
        raise ValueError(f"config.pbtxt: expected exactly one '{name}' field, found {n}")
    return new


def _quoted(text: str) -> str:
    """text as a protobuf text-format string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
