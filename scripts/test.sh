#!/usr/bin/env bash
# Install, then run the whole test suite (real Triton, gRPC and Prometheus on 127.0.0.1).
# Arguments go to pytest: `bash scripts/test.sh -m unit` is the fast loop, `-m stack` the tests
# that start services, `tests/test_wire.py` one file (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Prometheus (server + promtool) for the observability tests: Debian's package.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus) >/dev/null
  else
    echo "note: promtool/prometheus not installed and not root: those tests will skip" >&2
  fi
fi
exec .venv/bin/python -m pytest -q --durations=15 "$@"
