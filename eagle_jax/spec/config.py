"""The draft shape of a speculative step (``SpeculativeConfig``), on its own so the step
math, the step table, the policies and the CLI can share it without importing each other.
"""

from __future__ import annotations

import dataclasses
import re

from eagle_jax.errors import ConfigError
from eagle_jax.validate import is_int, is_number, one_of, positive_int

# How sampled (temperature > 0) requests are verified; both are exact at thresholds 1.
#  "coupled": each tree slot's next token is drawn from the target with the uniform of its
#    position (the one plain decoding would use) and the tree is walked as in greedy
#    verification against those draws. Lossless by construction, and a request's output
#    is the same with or without speculation, at any batch size.
#  "rejection": SGLang's tree speculative sampling (the Pallas kernel), with its
#    threshold_single / threshold_acc relaxations.
SAMPLING_VERIFY = ("coupled", "rejection")
# How the draft follows plain steps and prefill (speculative.DraftSync).
DRAFT_SYNC_MODES = ("eager", "deferred")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Draft shape: ``num_steps`` S (tree depth), ``topk`` k, ``num_draft_tokens`` T.

    A chain is ``topk == 1`` and forces ``T = S + 1``. A tree keeps the T-1 best of
    ``k + (S-1) k^2`` scored nodes plus the root. ``sampling_verify`` picks how sampled
    requests are verified (``SAMPLING_VERIFY``); ``threshold_single``/``threshold_acc``
    are SGLang's relaxations of its rejection sampling; 1.0 (the default) is exact.
    """

    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int | None = None
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    sampling_verify: str = "coupled"

    def __post_init__(self):
        one_of("sampling_verify", self.sampling_verify, SAMPLING_VERIFY)
        if self.sampling_verify == "coupled" and (self.threshold_single != 1 or self.threshold_acc != 1):
            raise ConfigError(
                f"threshold_single={self.threshold_single}, threshold_acc={self.threshold_acc}: the thresholds "
                "relax SGLang's rejection sampling; set sampling_verify='rejection' to use them"
            )
        positive_int("num_steps", self.num_steps)
        positive_int("topk", self.topk)
        t = self.num_draft_tokens
        if self.topk == 1:
            if t is not None and t != self.num_steps + 1:
                raise ConfigError(
                    f"num_draft_tokens={t} with topk=1 (a chain) must be num_steps + 1 = {self.num_steps + 1}"
                )
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        else:
            most = self.max_draft_tokens(self.num_steps, self.topk)
            if not is_int(t) or not 2 <= t <= most:
                raise ConfigError(
                    f"num_draft_tokens={t!r} with topk={self.topk}, num_steps={self.num_steps} must be an "
                    f"integer in [2, {most}] (root + at most k + (S-1)k^2 candidates)"
                )
        for name in ("threshold_single", "threshold_acc"):
            v = getattr(self, name)
            if not is_number(v) or not 0 < v <= 1:
                raise ConfigError(f"{name}={v!r} must be in (0, 1] (1 = exact)")

    @staticmethod
    def max_draft_tokens(num_steps: int, topk: int) -> int:
        """The most tokens a tree can verify: the root plus k + (S-1)k^2 scored nodes."""
        return 1 + topk + (num_steps - 1) * topk**2

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def shape(self) -> str:
        """``"chain S=5"`` or ``"tree S=3 k=4 T=8"`` (for logs and tables)."""
        if self.is_chain:
            return f"chain S={self.num_steps}"
        return f"tree S={self.num_steps} k={self.topk} T={self.num_draft_tokens}"

    @property
    def max_accept(self) -> int:
        """Tokens one step can emit: S accepted drafts plus the bonus."""
        return self.num_steps + 1

    @property
    def scratch_slots(self) -> int:
        """Draft-cache slots above the prefix used by drafting's tree nodes."""
        return (self.num_steps - 1) * self.topk


# The shape of the fixed and threshold policies when none is given (the CLI's --steps,
# --topk and --draft-tokens defaults, and ``EngineConfig(spec_policy="fixed")``'s): tied
# fastest (with chain S=2) for the released SmolLM2 draft on a 2-core CPU.
DEFAULT_STEPS, DEFAULT_TOPK, DEFAULT_TREE_TOKENS = 3, 4, 8


def default_shape(num_steps: int | None = None, topk: int | None = None, num_draft_tokens: int | None = None,
                  **fields) -> SpeculativeConfig:
    """The fixed shape with the unset parts defaulted: S=3, k=4, and T=8 for a tree (or
    all its nodes if fewer), S+1 for a chain. ``fields``: sampling settings."""
    s = DEFAULT_STEPS if num_steps is None else num_steps
    k = DEFAULT_TOPK if topk is None else topk
    t = num_draft_tokens
    if t is None and k > 1:
        t = min(DEFAULT_TREE_TOKENS, SpeculativeConfig.max_draft_tokens(s, k))
    return SpeculativeConfig(num_steps=s, topk=k, num_draft_tokens=t, **fields)


_SHAPE_RE = re.compile(r"^\s*(?:chain\s+S=(\d+)|tree\s+S=(\d+)\s+k=(\d+)\s+T=(\d+))\s*$")


def parse_shape(text: str, **fields) -> SpeculativeConfig:
    """``"chain S=3"`` or ``"tree S=3 k=4 T=8"`` (the ``shape`` string) as a config;
    ``fields`` (sampling_verify, thresholds) are passed through. Anything else is a
    ``ConfigError`` naming the accepted forms."""
    m = _SHAPE_RE.match(text)
    if not m:
        raise ConfigError(f"speculative shape {text!r} is not 'chain S=<n>' or 'tree S=<n> k=<n> T=<n>'")
    if m.group(1):
        return SpeculativeConfig(num_steps=int(m.group(1)), topk=1, **fields)
    s, k, t = (int(m.group(i)) for i in (2, 3, 4))
    if k == 1:
        raise ConfigError(f"speculative shape {text!r}: a tree needs k >= 2 (k=1 is 'chain S={s}')")
    return SpeculativeConfig(num_steps=s, topk=k, num_draft_tokens=t, **fields)
