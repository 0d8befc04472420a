#!/usr/bin/env bash
# Install, then start the local stack (Triton target + drafter + orchestrator) serving Generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flashmap up "$@"
