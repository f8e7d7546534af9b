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
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to}"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/eagle_jax_site .whl/*.whl \
    || { echo "installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/eagle_jax_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" scripts/device/check.py --out "$OUT" "$@"
