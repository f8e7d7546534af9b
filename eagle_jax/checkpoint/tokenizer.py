"""Text <-> token ids for a Hugging Face-layout model directory, without transformers.

:class:`Tokenizer` wraps a ``tokenizer.json`` (the ``tokenizers`` library) and the
``tokenizer_config.json`` next to it, and renders the model's chat template the way
transformers' ``apply_chat_template`` does. :class:`StreamDecoder` turns generated ids into
text deltas as they arrive.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from eagle_jax.errors import CheckpointError, InputError

# Special tokens that chat templates write at the end of a turn. A model trained on such a
# template stops a reply with one of these, which need not be the tokenizer's eos token
# (Llama 3 ends turns with <|eot_id|> while its eos is <|end_of_text|>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# Keys of tokenizer_config.json that transformers passes to the template as variables
# (its ``special_tokens_map``).
_TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A model's tokenizer and chat template, loaded from a model directory."""

    def __init__(self, backend, config: dict[str, Any], generation_config: dict[str, Any] | None = None):
        """Prefer :meth:`from_dir`. ``backend`` is a ``tokenizers.Tokenizer``; ``config`` the
        parsed tokenizer_config.json; ``generation_config`` the parsed generation_config.json."""
        self._backend = backend
        self._config = dict(config)
        self._generation_config = dict(generation_config or {})
        self._compiled_template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (and, if present,
        ``generation_config.json``) from a model directory."""
        from tokenizers import Tokenizer as BackendTokenizer

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file} not found: a model directory needs tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise CheckpointError(f"{tokenizer_file} is not a valid tokenizers file: {e}") from e
        config = _read_json_object(path / "tokenizer_config.json", required=True)
        generation_config = _read_json_object(path / "generation_config.json", required=False)
        return cls(backend, config, generation_config)

    # ----------------------------------------------------------------------------------
    # Token ids
    # ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``. ``add_special_tokens`` adds what the tokenizer's
        post-processor adds (BOS/EOS only if the model's tokenizer asks for them)."""
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text for ``ids`` (special tokens such as ``<|im_end|>`` dropped by default)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a reply, in this order without repeats:

        1. the tokenizer's ``eos_token``;
        2. the ``eos_token_id`` (one or a list) of generation_config.json, if present;
        3. each token of :data:`END_OF_TURN_TOKENS` (``<|im_end|>``, ``<|eot_id|>``, ...)
           that is in the vocabulary and written literally by the chat template: the
           template ends every turn with it, so the model ends its reply with it.
        """
        ids: list[int] = []
        if (eos := self._special_id("eos_token")) is not None:
            ids.append(eos)
        gen_eos = self._generation_config.get("eos_token_id")
        if gen_eos is not None:
            ids.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        template = self.chat_template or ""
        for token in END_OF_TURN_TOKENS:
            if token in template and (tid := self._backend.token_to_id(token)) is not None:
                ids.append(tid)
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def chat_template(self) -> str | None:
        template = self._config.get("chat_template")
        if isinstance(template, list):  # the named-templates form: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _special_id(self, name: str) -> int | None:
        token = _token_content(self._config.get(name))
        return None if token is None else self._backend.token_to_id(token)

    # ----------------------------------------------------------------------------------
    # Chat template
    # ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's
        chat template, as transformers' ``apply_chat_template`` does; the ids of the
        rendered text (no extra special tokens) when ``tokenize``."""
        messages = validate_messages(messages)
        template = self._compiled()
        variables = {
            name: token
            for name in _TEMPLATE_SPECIAL_TOKENS
            if (token := _token_content(self._config.get(name))) is not None
        }
        import jinja2

        try:
            rendered = template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template rejected these messages: {e}") from e
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def _compiled(self):
        if self._compiled_template is None:
            template = self.chat_template
            if not template:
                raise InputError(
                    "this tokenizer has no chat template (tokenizer_config.json has no "
                    "chat_template); pass plain text instead"
                )
            self._compiled_template = compile_chat_template(template)
        return self._compiled_template


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of dicts with str ``role`` and ``content``;
    return copies with ``None``-valued keys dropped (as transformers does)."""
    if not isinstance(messages, (list, tuple)):
        raise InputError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise InputError("messages is empty: give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InputError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise InputError(f"messages[{i}] has no {key!r} key")
            if not isinstance(message[key], str):
                raise InputError(
                    f"messages[{i}][{key!r}] must be a str, got {type(message[key]).__name__}"
                )
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def compile_chat_template(template: str):
    """Compile a chat template in a sandbox set up as transformers sets it up: trimmed
    blocks, loop controls, a ``{% generation %}`` tag, JSON without HTML escaping, and the
    ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` globals."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """``dict(...)`` for templates, without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed names (sandbox hardening)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"the chat template does not compile: {e}") from e


class StreamDecoder:
    """Incremental detokenizer: ``push(token_id)`` returns the text that token adds.

    Decoding each token alone is wrong twice over: a character may span several byte-level
    tokens, and some decoders treat a sequence's first token specially. So the decoder
    keeps a short window of ids: it decodes the window with and without the new tokens and
    returns the difference. While that text ends in U+FFFD (an incomplete UTF-8
    sequence) it is held back until later tokens complete it; :meth:`flush` returns what
    is still held at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window
        self._read = 0  # ids before this are already returned as text

    def push(self, token_id: int) -> str:
        """Add one generated id; return the new text (possibly empty)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return any held-back text (e.g. a truly invalid byte sequence at the end)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        done = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(full) <= len(done) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done) :]


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken-style dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json_object(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} not found: a model directory needs it next to tokenizer.json")
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return obj
