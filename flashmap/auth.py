"""Shared secrets between the parts and the public API key (DESIGN.md, "Trust boundaries").

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
DRAFTER_TOKEN_HEADER = "x-flashmap-drafter-token"
API_KEY_HEADER = "authorization"  # value: "Bearer <key>", what OpenAI-style clients send

TARGET_KEY_ENV = "FLASHMAP_TARGET_KEY"
DRAFTER_TOKEN_ENV = "FLASHMAP_DRAFTER_TOKEN"
API_KEY_ENV = "FLASHMAP_API_KEY"


def read_secret(env: str) -> str:
    """$ENV, else the contents of the file $ENV_FILE (stripped), else ""."""
    value = os.environ.get(env, "")
    if value:
        return value
    path = os.environ.get(env + "_FILE", "")
    return Path(path).read_text().strip() if path else ""


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def bearer(key: str) -> str:
    return f"Bearer {key}"
