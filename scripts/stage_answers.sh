#!/bin/bash
# Stage the committed draft answers for a commit while scripts/draft_answers.sh may still
# be writing: for each store under data/draft-answers/, a snapshot of its manifest.json
# and exactly the shards that snapshot lists (not a shard being renamed into place, nor
# a temporary file). Then `git commit`.
set -euo pipefail
cd "$(dirname "$0")/.."
snap=$(mktemp)
trap 'rm -f "$snap"' EXIT
for m in data/draft-answers/*/*/manifest.json; do
  [ -f "$m" ] || continue
  d=$(dirname "$m")
  cp "$m" "$snap"
  python3 - "$snap" "$d" <<'PY' | xargs -r git add --
import json, sys
for s in json.load(open(sys.argv[1]))["shards"]:
    print(f"{sys.argv[2]}/{s['file']}")
PY
  git update-index --add --cacheinfo "100644,$(git hash-object -w "$snap"),$m"
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]}: {m['answers']} answers, {m['response_tokens']:,} tokens, {len(m['shards'])} shards\")" "$snap" "$d"
done
