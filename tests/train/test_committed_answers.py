"""The draft answers committed under data/draft-answers/ (made by scripts/draft_answers.sh):
every shard a manifest lists is there with its sha256 and counts, and each store still
belongs to the prompt file in data/prompts/ that it names. Fast: no model is loaded."""

import json
from pathlib import Path

import pytest

from eagle_jax.serving.prompts import prompt_file_sha256, read_prompt_file
from eagle_jax.train.data import AnswerStore

ROOT = Path(__file__).resolve().parents[2]
STORES = sorted(p.parent for p in (ROOT / "data" / "draft-answers").glob("*/*/manifest.json"))


def test_there_are_committed_answers():
    assert STORES, "no committed answer store under data/draft-answers/"


@pytest.mark.parametrize("store", STORES, ids=[f"{p.parent.name}/{p.name}" for p in STORES])
def test_committed_store_verifies(store):
    m = json.loads((store / "manifest.json").read_text())
    st = AnswerStore(store, None, vocab_size=1 << 16, read_only=True)  # refuses a missing or changed shard
    assert len(st.answers) == m["answers"] == sum(s["answers"] for s in m["shards"])
    assert sum(len(a.response_ids) for a in st.answers.values()) == m["response_tokens"]
    prompts = ROOT / "data" / "prompts" / m["prompt_file"]
    assert prompt_file_sha256(prompts) == m["prompt_file_sha256"]
    assert max(st.answers) < len(read_prompt_file(prompts))
    # The budget the issue sets: 16 MB for 1.5 M answer tokens.
    size = sum(f.stat().st_size for f in store.iterdir())
    assert size <= 16e6 * max(m["response_tokens"], 1) / 1.5e6 + 4096
