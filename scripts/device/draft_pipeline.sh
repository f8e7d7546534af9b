#!/usr/bin/env bash
# The draft pipeline on a lent GPU (scripts/device/draft_pipeline.py): the committed
# answer store filled, features computed, the draft trained, in one call of at most 8
# minutes. Results under $OUT (pipeline.json, pipeline.log, answers-new.tar,
# draft.tar.part-NN); docs/measuring.md gives the device calls in order.
#
#   python scripts/device/draft_pipeline.py --prepare-gguf GGUF     # here, once: the parts to carry
#   OUT=/tmp/gpu scripts/device/draft_pipeline.sh                  # on the GPU machine
#
# Like check.sh it runs the package from this checkout with that machine's JAX; wheels a
# machine lacks travel in .whl/.
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
exec "$PY" scripts/device/draft_pipeline.py --out "$OUT" "$@"
