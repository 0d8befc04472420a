#!/usr/bin/env bash
# Install FlashMap Serve into ./.venv (idempotent). Used by scripts/run.sh, scripts/test.sh and .ci/run.
# A second run with the same pyproject.toml and this script returns at once (the install is
# editable: source changes need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAMP=.venv/.installed-from
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum)"
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: on the project's CPU machines this is a wheel on local disk; an
# unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.5,<=2.14.1"
.venv/bin/python -m pip install -q -e ".[dev,triton]"
# AIPerf, the load generator of docs/benchmarking.md (bench.loadgen, tests/test_loadgen.py), in
# a venv of its own inside .venv: its pins (numpy, pillow, transformers, prometheus-client) are
# not the stack's, and it needs no torch.
[ -x .venv/aiperf/bin/python ] || "$PY" -m venv .venv/aiperf
.venv/aiperf/bin/python -m pip install -q "aiperf==0.13.0"
echo "$WANT" >"$STAMP"
