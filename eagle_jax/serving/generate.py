"""Experiment-level entry points over the engine: ``Generator`` (plain), ``SpeculativeGenerator``
and ``speculative_generate``.

There is one host loop, the engine's (``eagle_jax.serving.engine``); these wrappers size an engine
to each call from ``Buckets`` (a batch bucket that holds the call's prompts, a prompt
bucket for its longest prompt, a cache that holds its longest request) and keep engines
for the sizes they have seen, so repeated calls compile nothing. Results are the engine's
``Completion``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from eagle_jax.models.draft import Eagle3Draft, check_compatible
from eagle_jax.serving.engine import Completion, Engine, EngineConfig
from eagle_jax.errors import ConfigError, InputError
from eagle_jax.validate import is_int
from eagle_jax.serving.policy import FixedPolicy, PlainPolicy
from eagle_jax.serving.requests import check_prompt, normalize_params
from eagle_jax.kernels.plan import check_kernel_impl
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.models.target import TargetModel

__all__ = ["Buckets", "Completion", "Generator", "SpeculativeGenerator", "speculative_generate"]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Static shapes the wrappers size their engines from."""

    batch: tuple[int, ...] = (1, 2, 4, 8)
    prompt: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
    cache: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)

    def __post_init__(self):
        for name in ("batch", "prompt", "cache"):
            values = getattr(self, name)
            if not values or any(not is_int(v) or v <= 0 for v in values) or list(values) != sorted(set(values)):
                raise ConfigError(f"buckets.{name}={values!r} must be a non-empty increasing tuple of positive ints")

    @staticmethod
    def pick(values: Sequence[int], n: int, what: str) -> int:
        for v in values:
            if v >= n:
                return v
        raise InputError(f"{what} {n} exceeds the largest bucket {values[-1]}")


class _Wrapper:
    """Shared by both generators: checks, engine sizing, the engine cache."""

    def __init__(self, target: TargetModel, tokenizer, buckets: Buckets, max_seq_len: int | None):
        limit = min(target.config.max_position_embeddings, buckets.cache[-1])
        if max_seq_len is not None and not 1 < max_seq_len <= limit:
            raise ConfigError(f"max_seq_len={max_seq_len} must be in [2, {limit}] (model context and largest cache bucket)")
        self.target = self.model = target
        self.tokenizer = tokenizer
        self.buckets = buckets
        self.max_seq_len = max_seq_len or limit
        self.eos_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else target.config.eos_token_ids
        self._engines: dict[tuple, Engine] = {}

    def _config(self, prompts: list[list[int]], params: list[SamplingParams], speculative) -> EngineConfig:
        b = Buckets.pick(self.buckets.batch, min(len(prompts), self.buckets.batch[-1]), "batch size")
        longest = max(len(p) for p in prompts)
        need = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
        cache = Buckets.pick(self.buckets.cache, min(need, self.max_seq_len), "sequence length")
        p_len = min((v for v in self.buckets.prompt if v >= longest), default=cache)
        cache = max(cache, Buckets.pick(self.buckets.cache, p_len, "prompt length"))
        # Only the shapes this call needs: one prompt bucket (it holds every prompt), one
        # batch bucket, and greedy steps only for greedy-only calls. The whole batch is
        # prefilled in one call: an offline call has no decoding requests that a large
        # prefill would delay (the engine's budget is for those), and b single-row
        # prefills cost b weight reads (4096 rows took ~12 s of host time alone).
        budget = max(EngineConfig.prefill_token_budget, b * p_len)
        return EngineConfig(max_batch=b, max_seq_len=cache, batch_buckets=(b,), prompt_buckets=(p_len,),
                            speculative=speculative, dtype=None, sampled_steps=not all(sp.greedy for sp in params),
                            prefill_token_budget=budget)

    def _engine(self, key, make) -> Engine:
        if key not in self._engines:
            self._engines[key] = make()
        return self._engines[key]

    def _check(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        params = normalize_params(prompts, params)
        for i, p in enumerate(prompts):
            check_prompt(i, p, self.max_seq_len, self.target.config.vocab_size)
        return [list(p) for p in prompts], params


class Generator(_Wrapper):
    """Plain generation for a loaded target model.

    Args:
      model: the target.
      tokenizer: optional ``eagle_jax.checkpoint.tokenizer.Tokenizer`` (text output, stop strings).
      buckets: static shapes engines are sized from.
      max_seq_len: context limit (default: the model's ``max_position_embeddings``,
        capped by the largest cache bucket).
    """

    def __init__(self, model: TargetModel, tokenizer=None, *, buckets: Buckets = Buckets(), max_seq_len: int | None = None):
        super().__init__(model, tokenizer, buckets, max_seq_len)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt (token ids); ``on_text(index, delta)`` streams text."""
        prompts, params = self._check(prompts, params)
        cfg = self._config(prompts, params, None)
        engine = self._engine(cfg, lambda: Engine(self.target, None, cfg, self.tokenizer, progress=False))
        return engine.generate(prompts, params, on_text=on_text)


class SpeculativeGenerator(_Wrapper):
    """Speculative generation with a target and an EAGLE-3 draft (experiment-level API).

    Args:
      target, draft: loaded models (checked for compatibility).
      spec: the draft shape; ``None`` runs the plain step.
      tokenizer: optional, for text and stop strings.
      buckets: batch, prompt and cache buckets.
      max_seq_len: context limit.
      kernel_impl: verification kernels: "auto" (Pallas on GPU, XLA reference on CPU),
        "kernel" or "reference".
    """

    def __init__(
        self, target: TargetModel, draft: Eagle3Draft, spec: SpeculativeConfig | None, tokenizer=None, *,
        buckets: Buckets = Buckets(), max_seq_len: int | None = None, kernel_impl: str = "auto",
    ):
        check_compatible(draft.config, target.config)
        check_kernel_impl(kernel_impl)
        super().__init__(target, tokenizer, buckets, max_seq_len)
        self.draft, self.spec, self.kernel_impl = draft, spec, kernel_impl

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        on_text=None,
        oracle: Sequence[Sequence[int]] | None = None,
        oracle_noise: float = 0.0,
    ) -> list[Completion]:
        """Generate for every prompt (token ids).

        Args:
          oracle: per prompt, the full sequence (prompt + continuation) the target is
            known to produce greedily; its tokens replace the draft's proposals (the
            ``oracle.OracleProposer``), with a fraction ``oracle_noise`` made wrong.
        """
        prompts, params = self._check(prompts, params)
        if oracle is not None and len(oracle) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(oracle)} oracle sequences")
        if not 0 <= oracle_noise <= 1:
            raise InputError(f"oracle_noise={oracle_noise} must be in [0, 1]")
        if oracle is not None and self.spec is None:
            raise InputError("an oracle replaces draft proposals; with spec=None nothing is drafted")
        cfg = dataclasses.replace(self._config(prompts, params, self.spec), kernel_impl=self.kernel_impl)
        policy = (lambda: PlainPolicy()) if self.spec is None else (lambda: FixedPolicy(self.spec))
        if oracle is None:
            engine = self._engine((cfg, None), lambda: Engine(self.target, self.draft, cfg, self.tokenizer, policy=policy(), progress=False))
            return engine.generate(prompts, params, on_text=on_text)
        from eagle_jax.spec.oracle import OracleProposer

        width = cfg.max_seq_len + self.spec.num_draft_tokens
        oracle_proposer = OracleProposer(row_width=width, noise=float(oracle_noise), vocab_size=self.target.config.vocab_size)
        # The engine is kept between calls; each request's row is this call's oracle
        # sequence for its prompt (the longest, where a prompt repeats: they agree).
        rows: dict = {}
        for p, o in zip(prompts, oracle):
            if len(o) > len(rows.get(tuple(p), ())):
                rows[tuple(p)] = list(o)
        self._oracle_rows = rows
        engine = self._engine((cfg, oracle_proposer), lambda: Engine(
            self.target, self.draft, cfg, self.tokenizer, policy=policy(), proposer=oracle_proposer,
            proposer_rows=lambda rid, prompt: self._oracle_rows[tuple(prompt)], progress=False))
        return engine.generate(prompts, params, on_text=on_text)


def speculative_generate(
    target: TargetModel,
    draft: Eagle3Draft,
    prompts: Sequence[Sequence[int]],
    spec: SpeculativeConfig = SpeculativeConfig(),
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    tokenizer=None,
    buckets: Buckets = Buckets(),
    max_seq_len: int | None = None,
) -> list[Completion]:
    """One-call speculative generation for experiments: tokens, text and the accept
    length of every step per prompt (the engine drives the same compiled step)."""
    gen = SpeculativeGenerator(target, draft, spec, tokenizer, buckets=buckets, max_seq_len=max_seq_len)
    return gen.generate(prompts, params)
