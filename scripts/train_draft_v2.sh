#!/bin/bash
# Draft v2 of SmolLM2-135M-Instruct, trained from the committed answers
# (data/draft-answers/smollm2-135m-instruct/) in two phases that fit one session and
# survive its end (docs/training.md):
#
#   1. features: `draft-data --answers ... --out $DATA` runs the target over the first
#      $PROMPTS answered training prompts (and the held-out ones, written first), shard
#      by shard; it stops after $FEATURES_TIME and the next run resumes at the first
#      unfinished shard. Nothing is generated: the answers are the committed ones.
#   2. training: `train-draft --finished-shards` on the sequences whose features exist,
#      inside $BUDGET, continuing $INIT (a fresh vocabulary from the data when $NEW_VOCAB
#      is 1, as the first v2 run does: v1's vocabulary came from template prompts).
#
#   setsid nohup nice -n 10 scripts/train_draft_v2.sh > results/scratch/draft_v2.log 2>&1 < /dev/null &
#
# A later round learns from prompts the earlier ones did not see: SKIP=6000 PROMPTS=6000
# takes prompts 6001-12000, with INIT=the released draft and NEW_VOCAB=0.
#
# Environment (defaults in brackets): PYTHON [.venv/bin/python], PROMPTS [6000], SKIP [0],
# DATA [.cache/draft-v2-data], FEATURES_TIME [40m], OUT [.cache/draft-v2/run-<UTC time>],
# INIT [checkpoints/smollm2-135m-instruct-eagle3], NEW_VOCAB [1], BUDGET [60m],
# TTT [4], BATCH [8], LR [3e-4], EPOCHS [2] (an upper bound), EVAL_EVERY [100].
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PROMPTS=${PROMPTS:-6000}
SKIP=${SKIP:-0}
DATA=${DATA:-.cache/draft-v2-data}
FEATURES_TIME=${FEATURES_TIME:-40m}
OUT=${OUT:-.cache/draft-v2/run-$(date -u +%Y%m%dT%H%M%SZ)}
INIT=${INIT:-checkpoints/smollm2-135m-instruct-eagle3}
NEW_VOCAB=${NEW_VOCAB:-1}
BUDGET=${BUDGET:-60m}
TTT=${TTT:-4}
BATCH=${BATCH:-8}
LR=${LR:-3e-4}
EVAL_EVERY=${EVAL_EVERY:-100}
EPOCHS=${EPOCHS:-2}

echo "== $(date -u +%FT%TZ) features of $PROMPTS training prompts after the first $SKIP into $DATA (at most $FEATURES_TIME)"
# SIGTERM at the time limit: the finished shards are kept (progress.json), the one in
# progress is computed again by the next run.
rc=0
timeout -s TERM "$FEATURES_TIME" "$PYTHON" -m eagle_jax.cli draft-data \
  --model checkpoints/smollm2-135m-instruct \
  --answers data/draft-answers/smollm2-135m-instruct \
  --prompt-file data/prompts/train-prompts.jsonl.gz \
  --eval-prompt-file data/prompts/heldout-prompts.jsonl --eval-prompts 200 \
  --skip-train-prompts "$SKIP" --train-prompts "$PROMPTS" --max-new-tokens 256 --max-seq-len 1024 \
  --progress-every 60 --out "$DATA" || rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then
  echo "draft-data failed (exit $rc)"; exit "$rc"
fi

echo "== $(date -u +%FT%TZ) training $OUT from $INIT for at most $BUDGET"
vocab=()
[ "$NEW_VOCAB" = 1 ] && vocab=(--new-vocab)
"$PYTHON" -m eagle_jax.cli train-draft --model checkpoints/smollm2-135m-instruct \
  --data "$DATA" --finished-shards --out "$OUT" --init-from "$INIT" "${vocab[@]}" \
  --time-budget "$BUDGET" --epochs "$EPOCHS" --ttt-length "$TTT" --batch-size "$BATCH" --lr "$LR" \
  --warmup-steps 20 --eval-every "$EVAL_EVERY" --checkpoint-every 100 --save-dtype float16
echo "== $(date -u +%FT%TZ) done: $OUT"
