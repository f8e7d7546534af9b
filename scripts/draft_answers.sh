#!/bin/bash
# Generate, or resume, the committed draft answers of SmolLM2-135M-Instruct to the
# repository's prompts (data/draft-answers/smollm2-135m-instruct/, see README "Train a
# draft for your target"). Safe to kill at any time and to run again, on any machine:
# every run asks only for the prompts not answered in the committed shards.
#
#   setsid nohup nice -n 10 scripts/draft_answers.sh > results/scratch/draft_answers.log 2>&1 &
#
# The training prompts are answered in growing prefixes of the (shuffled) prompt file,
# so whatever a session reaches is a fair sample of all of it; the held-out prompts are
# answered in the first pass. Environment: PYTHON (default .venv/bin/python), BATCH
# (default 32, the fastest measured on the shared 2-core CPU), STEP (prompts per pass).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
BATCH=${BATCH:-32}
STEP=${STEP:-2500}
TOTAL=19528
n=0
while [ "$n" -lt "$TOTAL" ]; do
  n=$((n + STEP))
  [ "$n" -gt "$TOTAL" ] && n=$TOTAL
  echo "== $(date -u +%FT%TZ) training prompts 1..$n"
  "$PYTHON" -m eagle_jax.cli draft-data \
    --model checkpoints/smollm2-135m-instruct \
    --answers data/draft-answers/smollm2-135m-instruct \
    --prompt-file data/prompts/train-prompts.jsonl.gz \
    --eval-prompt-file data/prompts/heldout-prompts.jsonl \
    --train-prompts "$n" --max-new-tokens 256 --max-seq-len 1024 \
    --batch-size "$BATCH" --progress-every 60
done
echo "== $(date -u +%FT%TZ) all training prompts answered"
