"""The target model's settings: TargetModelConfig, a typed config like the services' (flashmap.
config): each setting once, with its default, its check, its help and the environment variable
that sets it.

Triton hosts the model (model_repository/flashmap_target/1/model.py), so its settings cannot be
flags of a process of ours. They reach it in one of two ways, both read by `from_triton`:
- the launcher (target_service.launcher, whose options include these as flags) writes the
  settings it was given into the served copy of config.pbtxt, as one JSON parameter
  (PARAMETER). JSON in config.pbtxt rather than in an environment variable: the served
  repository says what the model was started with (Triton's model-config API shows it), the
  settings Triton acts on (slots, idle timeout) are written into the same file, and no child
  process of the server inherits them;
- the environment ($FLASHMAP_TARGET_DIR, ...: each option's variable), for the settings the
  JSON does not hold. A bare tritonserver serving the checked-in repository (NVIDIA's image
  without the launcher) is configured by the environment alone.

Standard library only: the launcher imports it without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from flashmap.config import Config, at_least, from_env, option
from flashmap.cpus import parse_cpu_list

PARAMETER = "target_model_config"  # config.pbtxt's parameter holding the JSON


def layer_list(text: str) -> list[int]:
    """ "1,9,17" -> [1, 9, 17] (ValueError otherwise)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _cpu_list(text: str) -> None:
    try:
        parse_cpu_list(text)
    except ValueError as e:
        raise ValueError(f"must be a CPU list like 0-3,6: {e}") from None


AUTO_TRUE_FALSE = ("auto", "true", "false")


def variable(setting: str) -> str:
    """The environment variable of a TargetModelConfig setting, as "$NAME" (for messages)."""
    (f,) = [f for f in fields(TargetModelConfig) if f.name == setting]
    return f"${f.metadata['option'].env}"


@dataclass
class TargetModelConfig(Config):
    """The settings of the Triton model flashmap_target (module docstring). No flags of its own
    (the launcher's TritonConfig offers them, flashmap.config.same_as); a bad value is a
    ValueError naming the variable."""

    model_dir: str | None = option(
        None, "Hugging Face Qwen3 checkpoint directory", env="FLASHMAP_TARGET_DIR", flag=None
    )
    max_seq_len: int | None = option(
        None,
        "context length of a slot (default: the checkpoint's max_position_embeddings)",
        env="FLASHMAP_TARGET_MAX_SEQ_LEN",
        flag=None,
        check=at_least(2),
    )
    device: str = option(
        "auto",
        "cpu, cuda, cuda:N (auto: cuda if available)",
        env="FLASHMAP_TARGET_DEVICE",
        flag=None,
    )
    dtype: str = option(
        "auto",
        "the weights' type (auto: bfloat16 on cuda, float32 on cpu)",
        env="FLASHMAP_TARGET_DTYPE",
        flag=None,
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    feature_layers: str | None = option(
        None,
        "comma-separated decoder layers the drafter reads (default: the drafter checkpoint's, "
        "else the engine's)",
        env="FLASHMAP_TARGET_FEATURE_LAYERS",
        flag=None,
        check=layer_list,
    )
    cuda_graphs: str = option(
        "auto",
        "decode / verify passes replayed from CUDA graphs (auto: on a CUDA device; false: eager)",
        env="FLASHMAP_TARGET_CUDA_GRAPHS",
        flag=None,
        choices=AUTO_TRUE_FALSE,
    )
    cpus: str | None = option(
        None,
        "CPUs the model's compute thread runs on alone, e.g. 0-3,6 (default: where the server "
        "runs; flashmap.cpus)",
        env="FLASHMAP_TARGET_CPUS",
        flag=None,
        check=_cpu_list,
    )
    drafter_dir: str | None = option(
        None,
        "the drafter checkpoint the features are for: its layers, and its context projection "
        "(flashmap.drafter_inputs)",
        env="FLASHMAP_DRAFTER_DIR",
        flag=None,
    )
    context_projection: str = option(
        "auto",
        "apply the drafter's context projection here, so D values per token cross instead of "
        "layers x hidden (auto: with drafter_dir)",
        env="FLASHMAP_CONTEXT_PROJECTION",
        flag=None,
        choices=AUTO_TRUE_FALSE,
    )

    def check(self) -> None:
        if self.context_projection == "true" and not self.drafter_dir:
            raise ValueError("context_projection=true needs drafter_dir")

    # ------------------------------------------------------------------ the way to the model

    def to_json(self) -> str:
        """The settings that differ from their defaults, with absolute paths (the server runs in
        a directory of its own); what the JSON leaves out the model reads from its
        environment (from_triton)."""
        given = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                given[f.name] = str(Path(value).resolve()) if f.name.endswith("_dir") else value
        return json.dumps(given, ensure_ascii=False)

    @staticmethod
    def from_triton(model_config: dict, env=None) -> TargetModelConfig:
        """The settings of a model's Triton config (args["model_config"] as a dict): its PARAMETER's
        JSON, then the environment for the settings it leaves out, then the defaults."""
        params = model_config.get("parameters", {})
        text = params.get(PARAMETER, {}).get("string_value", "") or "{}"
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the {PARAMETER} parameter is not JSON: {e}") from None
        known = {f.name for f in fields(TargetModelConfig)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"the {PARAMETER} parameter has unknown settings {unknown}")
        return from_env(TargetModelConfig, env, **given)

    # ------------------------------------------------------------------ what the model runs

    def checkpoint(self) -> str:
        """model_dir, or a ValueError that says where to set it."""
        if not self.model_dir:
            raise ValueError(
                f"no checkpoint; set {variable('model_dir')} or model_dir in the {PARAMETER} "
                "parameter"
            )
        return self.model_dir

    def device_for(self, cuda_available: bool) -> str:
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.device

    def dtype_for(self, device: str) -> str:
        if self.dtype == "auto":
            return "bfloat16" if device.startswith("cuda") else "float32"
        return self.dtype

    def graphs_for(self, device: str) -> bool:
        """CUDA graphs on this device (ValueError: asked for on a device without CUDA)."""
        if self.cuda_graphs == "true" and not device.startswith("cuda"):
            raise ValueError(f"cuda_graphs=true needs a CUDA device, the model runs on {device}")
        return self.cuda_graphs != "false" and device.startswith("cuda")

    @property
    def layers(self) -> list[int] | None:
        return layer_list(self.feature_layers) if self.feature_layers else None

    @property
    def cpu_set(self) -> set[int] | None:
        return parse_cpu_list(self.cpus) if self.cpus else None
