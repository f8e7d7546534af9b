"""eagle_jax.checkpoint.tokenizer: parity with transformers (encode, decode, chat templates) on the
real SmolLM2 tokenizer and on a tiny one built here; the streaming detokenizer; the eos
rule; and message validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_jax.errors import CheckpointError, InputError
from eagle_jax.checkpoint.tokenizer import StreamDecoder, Tokenizer

# ----------------------------------------------------------------------------------------
# A tiny byte-level tokenizer directory (no model needed)
# ----------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Exercises what transformers sets up around a template: namespace, loop controls,
# raise_exception, the {% generation %} tag, tojson without HTML escaping, dict(),
# strftime_now, and the special-token variables.
FANCY_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif -%}
{%- if m.role not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor -%}
[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ ns.system | tojson }}|{{ dict(a='<b>&é', c=[1, 2]) | tojson }}|{{ strftime_now('%Y') }}]
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def write_tiny_tokenizer(directory: Path, template: str | None = FANCY_TEMPLATE, generation_config=None) -> Path:
    """tokenizer.json (GPT-2 byte alphabet, three special tokens, a couple of merges) and
    tokenizer_config.json, in the format the GGUF importer writes."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    alphabet = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet + ["Ġt", "he", "Ġthe"])}
    backend = Backend(BPE(vocab=vocab, merges=[("Ġ", "t"), ("h", "e"), ("Ġt", "he")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    return write_tiny_tokenizer(tmp_path / "tiny")


@pytest.fixture
def tiny(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be <brief> & \"kind\" — é"}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Quatre.\nC'est tout."},
        {"role": "user", "content": "Et 東京 ? 🙂"},
    ],
    [{"role": "user", "content": "a\tb\n\n  c"}, {"role": "assistant", "content": "ok", "name": None}],
]


def test_tiny_basics(tiny):
    assert tiny.vocab_size == 3 + 256 + 3
    assert tiny.bos_token_id == 1 and tiny.pad_token_id == 0
    the = tiny.token_to_id("Ġthe")
    assert tiny.encode(" the theme") == [the, the, tiny.token_to_id("m"), tiny.token_to_id("e")]
    assert tiny.decode(tiny.encode("Ünïcödé 東京 🙂\n\t x")) == "Ünïcödé 東京 🙂\n\t x"
    # Special tokens in text are matched whole, and dropped by decode unless asked.
    ids = tiny.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny.decode(ids) == "hi"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_tiny_eos_rule(tiny_dir, tmp_path):
    # eos_token first, then <|im_end|> because the template writes it.
    assert Tokenizer.from_dir(tiny_dir).eos_token_ids == (0, 2)
    # generation_config.json eos ids come after the tokenizer's eos, without repeats.
    d = write_tiny_tokenizer(tmp_path / "gen", generation_config={"eos_token_id": [0, 5]})
    assert Tokenizer.from_dir(d).eos_token_ids == (0, 5, 2)
    # A template that never writes <|im_end|> adds nothing.
    d = write_tiny_tokenizer(tmp_path / "plain", template="{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).eos_token_ids == (0,)


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_chat_template_matches_transformers(tiny, tiny_dir, chat, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    want = ref.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert tiny.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == want
    assert "&" in want and "\\u" not in want  # tojson kept '<b>&é' as written
    ids = tiny.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_template_raise_exception_becomes_input_error(tiny):
    with pytest.raises(InputError, match="unknown role tool"):
        tiny.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_dir(write_tiny_tokenizer(tmp_path / "t", template=None))
    with pytest.raises(InputError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = write_tiny_tokenizer(tmp_path / "t")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hello", "must be a list"),
        ([], "empty"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict"),
        ([{"content": "a"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\['content'\] must be a str, got list"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str, got NoneType"),
        ([{"role": 3, "content": "a"}], r"messages\[0\]\['role'\] must be a str, got int"),
    ],
)
def test_bad_messages(tiny, messages, fragment):
    with pytest.raises(InputError, match=fragment):
        tiny.apply_chat_template(messages)


def test_bad_encode_decode_input(tiny):
    with pytest.raises(InputError, match="must be a str"):
        tiny.encode(b"bytes")
    with pytest.raises(InputError, match="outside the vocabulary"):
        tiny.decode([1, 10**6])


def test_stream_decoder_holds_back_split_characters(tiny):
    ids = tiny.encode("é東🙂")  # 2 + 3 + 4 bytes, one token per byte here
    assert len(ids) == 9
    stream = tiny.stream_decoder()
    deltas = [stream.push(i) for i in ids]
    assert deltas == ["", "é", "", "", "東", "", "", "", "🙂"]
    assert stream.flush() == ""


def test_stream_decoder_special_tokens_and_flush(tiny):
    stream = StreamDecoder(tiny)
    assert stream.push(1) == ""  # <|im_start|> is skipped
    assert stream.push(tiny.token_to_id("h")) == "h"
    lone = tiny.encode("é")[0]  # the first byte of a two-byte character, never completed
    assert stream.push(lone) == ""
    assert stream.flush() == "\ufffd"
    keep = StreamDecoder(tiny, skip_special_tokens=False)
    assert keep.push(2) == "<|im_end|>"


# ----------------------------------------------------------------------------------------
# SmolLM2: parity with the tokenizer transformers builds from the GGUF
# ----------------------------------------------------------------------------------------

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  leading and trailing spaces  ",
    "multiple     spaces\tand\t\ttabs\n\nnew\nlines\r\n\r\nend",
    "Café naïve façade résumé Ångström Œuvre",
    "東京は日本の首都です。中文測試，한국어 텍스트",
    "😀🎉👍🏽 family: 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "Ελληνικά Русский العربية हिन्दी ไทย",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    '{"key": [1, 2.5, null], "nested": {"ok": true}}',
    "numbers 1234567890 3.14159 1e-5 and 42nd",
    "\u00a0nbsp, zero\u200bwidth, soft\u00adhyphen",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm you're we'll they've she'd it's DON'T",
]

SMOL_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about 東京 🌸."},
    ],
    [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "Hi!\n\nHow are you?"},
        {"role": "assistant", "content": "Très bien, merci !"},
        {"role": "user", "content": "def f(x):\n\treturn x"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
    ],
]


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)



@pytest.mark.smollm2
def test_smollm2_properties(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1  # <|im_start|>
    assert smol.eos_token_ids == (2,)  # <|im_end|> is both the eos and the end of turn


@pytest.mark.smollm2
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_smollm2_encode_decode_match_transformers(smol, smollm2_hf_tokenizer, text):
    ref = smollm2_hf_tokenizer
    ids = smol.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert smol.encode(text, add_special_tokens=True) == ref.encode(text)
    for skip in (True, False):
        assert smol.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    if "<|" not in text:
        assert smol.decode(ids) == text


@pytest.mark.smollm2
def test_smollm2_decode_random_ids_matches_transformers(smol, smollm2_hf_tokenizer):
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(49152) for _ in range(rng.randrange(1, 30))] + [rng.randrange(17)]
        for skip in (True, False):
            assert smol.decode(ids, skip_special_tokens=skip) == smollm2_hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.smollm2
@pytest.mark.parametrize("chat", SMOL_CHATS, ids=range(len(SMOL_CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smol, smollm2_hf_tokenizer, chat, add_generation_prompt):
    ref = smollm2_hf_tokenizer
    text = smol.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = smol.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


@pytest.mark.smollm2
def test_smollm2_stream_decoder(smol):
    text = "Emoji 😀🎉👍🏽 and 東京 and é — done.\n"
    ids = smol.encode(text)
    stream = smol.stream_decoder()
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some character did span several tokens and was held back
