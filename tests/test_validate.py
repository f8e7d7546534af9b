"""The shared field checks (``eagle_jax.validate``): ``bool`` is never an integer, every
refusal names the field and the value, and the call sites keep their messages."""

from __future__ import annotations

import re

import pytest

from eagle_jax.errors import ConfigError, InputError
from eagle_jax.validate import (
    flag,
    int_at_least,
    int_in,
    is_int,
    is_number,
    non_negative_int,
    one_of,
    optional,
    positive_int,
)


def test_is_int_and_is_number_refuse_bool():
    assert is_int(0) and is_int(-3) and is_int(10**20)
    assert not any(is_int(v) for v in (True, False, 1.0, "1", None))
    assert is_number(1) and is_number(0.5) and not is_number(True) and not is_number("0.5")


@pytest.mark.parametrize("check, lo", [(positive_int, 1), (non_negative_int, 0)])
def test_integer_bounds(check, lo):
    assert check("n", lo) == lo and check("n", lo + 5) == lo + 5
    for bad in (lo - 1, True, False, 1.0, "2", None):
        with pytest.raises(ConfigError, match=re.escape(f"n={bad!r} must be an integer >= {lo}")):
            check("n", bad)


def test_int_at_least_error_class_and_note():
    assert int_at_least("k", 7, 7) == 7
    with pytest.raises(InputError, match=re.escape("top_k=-1 must be an integer >= 0 (0 = off)")):
        non_negative_int("top_k", -1, error=InputError, note="0 = off")
    with pytest.raises(ConfigError, match=re.escape("k=6 must be an integer >= 7")):
        int_at_least("k", 6, 7)


def test_int_in():
    assert int_in("seed", 0, 0, 2**32) == 0
    for bad in (-1, 2**32, True, 3.0):
        with pytest.raises(InputError, match=re.escape(f"seed={bad!r} must be an integer in [0, 2**32)")):
            int_in("seed", bad, 0, 2**32, error=InputError, hi_text="2**32")
    with pytest.raises(ConfigError, match=re.escape("c=9 must be an integer in [0, 9)")):
        int_in("c", 9, 0, 9)


def test_optional():
    assert optional(positive_int, "x", None) is None
    assert optional(positive_int, "x", 3) == 3
    with pytest.raises(ConfigError, match=re.escape("x=0 must be an integer >= 1 or None")):
        optional(positive_int, "x", 0)
    with pytest.raises(ConfigError, match=re.escape("t=True must be an integer >= 0 or None (never off)")):
        optional(non_negative_int, "t", True, note="never off")


def test_one_of():
    assert one_of("mode", "a", ("a", "b")) == "a"
    assert one_of("dtype", None, (None, "float32")) is None
    with pytest.raises(ConfigError, match=re.escape("mode='c'; valid: a, b")):
        one_of("mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match=re.escape("layers=True; valid: 1")):
        one_of("layers", True, (1,), error=ValueError)  # True == 1, but it is not the integer 1


def test_flag():
    assert flag("f", True) is True and flag("f", False) is False
    for bad in (1, 0, "true", None):
        with pytest.raises(ConfigError, match=re.escape(f"f={bad!r} must be True or False")):
            flag("f", bad)


def test_call_sites_refuse_bool_and_keep_their_messages():
    from eagle_jax.serving.policy import ThresholdPolicy
    from eagle_jax.spec.config import SpeculativeConfig
    from eagle_jax.spec.sampling import SamplingParams
    from eagle_jax.spec.steps import DraftSync
    from eagle_jax.train.ttt import TrainConfig

    with pytest.raises(InputError, match=re.escape("max_new_tokens=True must be an integer >= 1")):
        SamplingParams(max_new_tokens=True)
    with pytest.raises(InputError, match=re.escape("top_k=False must be an integer >= 0 (0 = off)")):
        SamplingParams(top_k=False)
    with pytest.raises(InputError, match=re.escape("seed=True must be an integer in [0, 2**32)")):
        SamplingParams(seed=True)
    with pytest.raises(InputError, match="temperature=True must be a finite number"):
        SamplingParams(temperature=True)
    with pytest.raises(InputError, match="stop_token_ids has True"):
        SamplingParams(stop_token_ids=(True,))
    with pytest.raises(ConfigError, match=re.escape("num_steps=True must be an integer >= 1")):
        SpeculativeConfig(num_steps=True)
    with pytest.raises(ConfigError, match=re.escape("sampling_verify='x'; valid: coupled, rejection")):
        SpeculativeConfig(sampling_verify="x")
    with pytest.raises(ConfigError, match=re.escape("threshold=True must be an integer >= 0 or None")):
        ThresholdPolicy(SpeculativeConfig(num_steps=2), True)
    with pytest.raises(ConfigError, match=re.escape("hysteresis=True must be an integer >= 1")):
        ThresholdPolicy(SpeculativeConfig(num_steps=2), 4, hysteresis=True)
    with pytest.raises(ValueError, match="both integers >= 1"):
        DraftSync("deferred", rows=True)
    with pytest.raises(ConfigError, match=re.escape("warmup_steps=True must be an integer >= 0")):
        TrainConfig(warmup_steps=True)
    with pytest.raises(ConfigError, match=re.escape("intermediate_size=0 must be an integer >= 1 or None")):
        TrainConfig(intermediate_size=0)
