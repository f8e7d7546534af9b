"""Prompt files: JSON Lines, one request per line, read as untrusted input.

Each line is ``{"id": ..., "prompt": "text"}`` or ``{"id": ..., "messages": [{"role":
..., "content": ...}, ...]}``; messages go through the model's chat template. Blank
lines are skipped; any other unreadable line is an error that names its line number.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from eagle_jax.errors import InputError

MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: Any
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def _check_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return tuple(dict(m) for m in messages)


def parse_record(obj: Any, where: str, default_id: Any) -> PromptRecord:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise InputError(f"{where}: give exactly one of 'prompt' or 'messages'")
    rid = obj.get("id", default_id)
    if not isinstance(rid, (str, int)):
        raise InputError(f"{where}: 'id' must be a string or an integer")
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            raise InputError(f"{where}: 'prompt' must be a string")
        return PromptRecord(rid, prompt=obj["prompt"])
    return PromptRecord(rid, messages=_check_messages(obj["messages"], where))


def read_prompt_file(path: str | Path) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt file {path} not found")
    records = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{where}: not valid UTF-8 ({e})") from e
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            records.append(parse_record(obj, where, default_id=lineno))
    if not records:
        raise InputError(f"prompt file {path} holds no prompts")
    return records
