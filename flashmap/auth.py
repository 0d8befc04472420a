"""Shared secrets between the parts and the public API key (docs/ARCHITECTURE.md, "Trust boundaries").

- Triton's restricted protocols (inference, shared memory, model control, logging, ...)
  need TARGET_KEY_HEADER: the target key only the orchestrator holds.
- The drafter service needs DRAFTER_TOKEN_HEADER on every call but health.
- The public Generate API takes `authorization: Bearer <key>` when API keys are configured.

Each secret comes from an environment variable, or from a file named by the variable with
a _FILE suffix (container secrets). `flashmap up` makes fresh random ones per run.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TARGET_KEY_HEADER = "x-flashmap-target-key"
# Triton's gRPC endpoint looks for restricted-protocol keys under this prefix (HTTP: the bare name).
TARGET_KEY_GRPC_HEADER = "triton-grpc-protocol-" + TARGET_KEY_HEADER
DRAFTER_TOKEN_HEADER = "x-flashmap-drafter-token"
API_KEY_HEADER = "authorization"  # value: "Bearer <key>", what OpenAI-style clients send

TARGET_KEY_ENV = "FLASHMAP_TARGET_KEY"
DRAFTER_TOKEN_ENV = "FLASHMAP_DRAFTER_TOKEN"
DRAFTER_TOKEN_LOCAL = (
    "drafter_token"  # `flashmap up`'s drafter token, for `flashmap steps` from another shell
)
API_KEY_ENV = "FLASHMAP_API_KEY"


def local_secret_path(name: str) -> Path:
    """Where `flashmap up` leaves a secret for this user's other shells (owner-only file)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "flashmap" / name


def read_secret(env: str, local: str | None = None) -> str:
    """$ENV, else the contents of the file $ENV_FILE, else (local given) of local_secret_path(local);
    stripped; "" when none is set."""
    value = os.environ.get(env, "")
    if value:
        return value
    path = os.environ.get(env + "_FILE", "") or (str(local_secret_path(local)) if local else "")
    return Path(path).read_text().strip() if path and Path(path).is_file() else ""


def write_local_secret(name: str, value: str) -> Path:
    path = local_secret_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(value + "\n")
    return path


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def bearer(key: str) -> str:
    return f"Bearer {key}"
