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
source "$(dirname "$0")/env.sh"
exec "$PY" scripts/device/draft_pipeline.py --out "$OUT" "$@"
