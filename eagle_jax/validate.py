"""Field checks shared by every configuration and request type.

Each helper returns the value it accepts and otherwise raises ``error`` (``ConfigError``
unless the call site raises another class, e.g. ``InputError`` for a request's
sampling values) with one message that names the field and the value:
``max_batch=0 must be an integer >= 1``. ``bool`` is an ``int`` in Python; no integer
check here accepts ``True`` or ``False``.

- ``is_int(v)``: an ``int`` and not a ``bool``; ``is_number(v)``: an ``int`` or a
  ``float`` and not a ``bool``;
- ``int_at_least(name, v, lo)``, ``positive_int`` (>= 1), ``non_negative_int`` (>= 0);
- ``int_in(name, v, lo, hi)``: ``lo <= v < hi``;
- ``one_of(name, v, choices)``: ``v`` is one of ``choices`` (the message lists them);
- ``flag(name, v)``: ``True`` or ``False``;
- ``optional(check, name, v, ...)``: None, or what ``check`` accepts (the message adds
  "or None").

``note`` adds a parenthesis to the message, e.g. ``(0 = off)``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from eagle_jax.errors import ConfigError

T = TypeVar("T")


def is_int(v: Any) -> bool:
    """An ``int`` and not a ``bool`` (``True`` is an ``int`` to ``isinstance``)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An ``int`` or a ``float`` and not a ``bool``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _message(name: str, v: Any, what: str, or_none: bool, note: str) -> str:
    return f"{name}={v!r} {what}" + (" or None" if or_none else "") + (f" ({note})" if note else "")


def int_at_least(name: str, v: Any, lo: int, *, error: type[Exception] = ConfigError, note: str = "",
                 or_none: bool = False) -> int:
    """``v`` if it is an integer >= ``lo``."""
    if not is_int(v) or v < lo:
        raise error(_message(name, v, f"must be an integer >= {lo}", or_none, note))
    return v


def positive_int(name: str, v: Any, *, error: type[Exception] = ConfigError, note: str = "",
                 or_none: bool = False) -> int:
    """``v`` if it is an integer >= 1."""
    return int_at_least(name, v, 1, error=error, note=note, or_none=or_none)


def non_negative_int(name: str, v: Any, *, error: type[Exception] = ConfigError, note: str = "",
                     or_none: bool = False) -> int:
    """``v`` if it is an integer >= 0."""
    return int_at_least(name, v, 0, error=error, note=note, or_none=or_none)


def int_in(name: str, v: Any, lo: int, hi: int, *, error: type[Exception] = ConfigError, hi_text: str | None = None,
           note: str = "", or_none: bool = False) -> int:
    """``v`` if it is an integer with ``lo <= v < hi``; ``hi_text`` names the bound in the
    message (e.g. ``"max_seq_len=64"``, ``"2**32"``)."""
    if not is_int(v) or not lo <= v < hi:
        raise error(_message(name, v, f"must be an integer in [{lo}, {hi_text or hi})", or_none, note))
    return v


def one_of(name: str, v: Any, choices: Sequence[T], *, error: type[Exception] = ConfigError) -> T:
    """``v`` if it is one of ``choices``; the message lists them."""
    if isinstance(v, bool) and not any(isinstance(c, bool) for c in choices) or v not in tuple(choices):
        raise error(f"{name}={v!r}; valid: {', '.join(map(str, choices))}")
    return v


def flag(name: str, v: Any, *, error: type[Exception] = ConfigError) -> bool:
    """``v`` if it is ``True`` or ``False``."""
    if not isinstance(v, bool):
        raise error(f"{name}={v!r} must be True or False")
    return v


def optional(check: Callable[..., T], name: str, v: Any, *args: Any, **kwargs: Any) -> T | None:
    """None, or ``check(name, v, *args, **kwargs)`` (one of the integer checks above),
    whose refusal then says "or None"."""
    if v is None:
        return None
    return check(name, v, *args, or_none=True, **kwargs)
