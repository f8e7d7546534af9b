"""Prompt files are untrusted: every unreadable line is reported with its line number."""

import pytest

from eagle_jax.errors import InputError
from eagle_jax.serving.prompts import PromptRecord, chat_problem, check_unique_ids, read_prompt_file


def _write(tmp_path, text, mode="w"):
    f = tmp_path / "p.jsonl"
    if mode == "wb":
        f.write_bytes(text)
    else:
        f.write_text(text)
    return f


def test_reads_prompts_and_messages(tmp_path):
    f = _write(tmp_path, '{"id": 1, "prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    recs = read_prompt_file(f)
    assert recs[0].id == 1 and recs[0].prompt == "a"
    assert recs[1].id == 3 and recs[1].messages == ({"role": "user", "content": "b"},)
    assert [r.line for r in recs] == [1, 3]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": 1, "prompt": "a"}\n[1, 2]\n', ":2: expected a JSON object"),
        ('{"id": 1, "prompt": "a"}\n{"id": 2}\n', ":2: give exactly one of"),
        ('{"prompt": "a", "messages": []}\n', ":1: give exactly one of"),
        ('{"prompt": 5}\n', ":1: 'prompt' must be a string"),
        ('{"messages": [{"role": "user"}]}\n', ":1: messages\\[0\\]"),
        ('{"messages": []}\n', ":1: 'messages' must be a non-empty list"),
        ('{"id": [1], "prompt": "a"}\n', ":1: 'id' must be"),
        ('\n{"prompt": "a"\n', ":2: not valid JSON"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_lines(tmp_path, content, message):
    with pytest.raises(InputError, match=message):
        read_prompt_file(_write(tmp_path, content))


def test_invalid_utf8(tmp_path):
    with pytest.raises(InputError, match=":1: not valid UTF-8"):
        read_prompt_file(_write(tmp_path, b'{"prompt": "\xff"}\n', "wb"))


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_prompt_file(tmp_path / "none.jsonl")


def _chat(*turns):
    return PromptRecord("x", messages=tuple({"role": r, "content": c} for r, c in turns))


@pytest.mark.parametrize(
    "record, problem",
    [
        (_chat(("user", "hi")), None),
        (_chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "and?")), None),
        (PromptRecord("x", prompt="text"), None),
        (_chat(("user", "hi"), ("assistant", "hello")), "last turn not from the user"),
        (_chat(("tool", "{}"), ("user", "hi")), "unknown role"),
        (_chat(("user", " \n ")), "empty content"),
        (_chat(("user", "hi"), ("assistant", ""), ("user", "again")), "empty content"),
        (PromptRecord("x", prompt="  "), "empty content"),
    ],
)
def test_chat_problem(record, problem):
    assert chat_problem(record) == problem


def test_repeated_ids_name_both_lines(tmp_path):
    f = _write(tmp_path, '{"id": "a", "prompt": "x"}\n{"id": 1, "prompt": "y"}\n{"id": "1", "prompt": "z"}\n{"id": "a", "prompt": "w"}\n')
    recs = read_prompt_file(f)
    check_unique_ids(recs[:3], f)  # 1 and "1" differ, as in JSON
    with pytest.raises(InputError, match=r"p.jsonl:4: id 'a' repeats the id of line 1"):
        check_unique_ids(recs, f)
