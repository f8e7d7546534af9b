"""Prompt files: JSON Lines, one request per line, read as untrusted input.

Each line is ``{"id": ..., "prompt": "text"}`` or ``{"id": ..., "messages": [{"role":
..., "content": ...}, ...]}``; messages go through the model's chat template. Blank
lines are skipped; any other unreadable line is an error that names its line number.

``chat_problem`` says why a well-formed record cannot be a chat request to answer (the
last turn is not the user's, an unknown role, empty content): callers that read large
prompt collections skip such records and count them rather than stop.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

from eagle_jax.errors import InputError
from eagle_jax.validate import is_int

MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: Any
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    line: int | None = None  # where it was read, for messages that name the record


CHAT_ROLES = ("system", "user", "assistant")


def chat_problem(record: PromptRecord) -> str | None:
    """Why ``record`` cannot be answered as the next assistant turn, or None if it can.

    The reasons are short and fixed, so callers can count records by reason."""
    if record.messages is None:
        return "empty content" if not record.prompt.strip() else None
    for m in record.messages:
        if m["role"] not in CHAT_ROLES:
            return "unknown role"
        if not m["content"].strip():
            return "empty content"
    if record.messages[-1]["role"] != "user":
        return "last turn not from the user"
    return None


def _check_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return tuple(dict(m) for m in messages)


def parse_record(obj: Any, where: str, default_id: Any, line: int | None = None) -> PromptRecord:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise InputError(f"{where}: give exactly one of 'prompt' or 'messages'")
    rid = obj.get("id", default_id)
    if not (isinstance(rid, str) or is_int(rid)):
        raise InputError(f"{where}: 'id' must be a string or an integer")
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            raise InputError(f"{where}: 'prompt' must be a string")
        return PromptRecord(rid, prompt=obj["prompt"], line=line)
    return PromptRecord(rid, messages=_check_messages(obj["messages"], where), line=line)


def iter_prompt_file(path: str | Path) -> Iterator[tuple[str, PromptRecord]]:
    """``("FILE:LINE", record)`` for each non-blank line, so a caller's own checks can name the line too."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt file {path} not found")
    with open_prompt_bytes(path) as f:
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
            yield where, parse_record(obj, where, default_id=lineno, line=lineno)


def open_prompt_bytes(path: str | Path):
    """A prompt file opened for reading bytes; ``.gz`` files (large prompt sets kept in
    git compressed) are decompressed on the fly."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rb")
    return path.open("rb")


def prompt_file_sha256(path: str | Path) -> str:
    """sha256 of a prompt file's content, decompressed when it is a ``.gz``: a file and
    its compressed copy have the same digest."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open_prompt_bytes(path) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except (OSError, EOFError) as e:
        raise InputError(f"prompt file {path}: unreadable ({e})") from e
    return h.hexdigest()


def read_prompt_file(path: str | Path) -> list[PromptRecord]:
    records = [r for _, r in iter_prompt_file(path)]
    if not records:
        raise InputError(f"prompt file {path} holds no prompts")
    return records


def check_unique_ids(records: list[PromptRecord], path: str | Path) -> None:
    """Refuse a file in which two records share an id: outputs are keyed by id (a resumed
    run skips the ids already answered), so a repeated id would be answered once."""
    seen: dict[Any, int | None] = {}
    for r in records:
        # 1 and "1" are different ids, as they are in JSON.
        key = (type(r.id).__name__, r.id)
        if key in seen:
            raise InputError(f"{path}:{r.line}: id {r.id!r} repeats the id of line {seen[key]}")
        seen[key] = r.line
