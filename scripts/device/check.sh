#!/usr/bin/env bash
# The device check (scripts/device/check.py): every GPU figure the project needs, in one
# call of at most 8 minutes on one H200. Results go under $OUT (JSON per section,
# summary.md, check.log). docs/measuring.md describes the sections.
#
#   OUT=/tmp/gpu scripts/device/check.sh              # on the GPU machine
#   OUT=/tmp/dry scripts/device/check.sh --dry-run    # tiny shapes on a CPU
#
# It runs the package from this checkout (no install: the GPU machine has no registry)
# with that machine's JAX. Wheels a machine lacks can travel in .whl/ (device README).
set -uo pipefail
source "$(dirname "$0")/env.sh"
exec "$PY" scripts/device/check.py --out "$OUT" "$@"
