#!/bin/sh
# Install a service's pinned requirements into its image (deploy/Dockerfile.*):
#   install-deps.sh venv REQUIREMENTS          # a virtual environment at /opt/venv
#   install-deps.sh target DIR REQUIREMENTS    # a directory for the image's own Python (Triton)
# The CPU profile's shared base (deploy/base/Containerfile.python) already holds every package
# and sets FLASHMAP_DEPS_PREINSTALLED=1: there this only checks, with no package index, that the
# base satisfies the service's pins, so a pin that deploy/requirements/cpu.lock lacks fails the
# build instead of the service.
set -eu
mode=$1
shift
if [ "${FLASHMAP_DEPS_PREINSTALLED:-0}" = 1 ]; then
  [ "$mode" = target ] && shift
  exec /opt/venv/bin/pip install --no-index --no-cache-dir --quiet -r "$1"
fi
case "$mode" in
  venv) python -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir -r "$1" ;;
  target) python3 -m pip install --no-cache-dir --target "$1" -r "$2" ;;
  *) echo "install-deps.sh: unknown mode $mode" >&2; exit 2 ;;
esac
