"""The step table: every compiled graph an engine runs, built once at start-up.

What SGLang captures as CUDA graphs, we compile ahead of time (``jit(...).lower(...)
.compile()``) for every static shape the host loop can ask for:

- ``prefill (n, p)``: prefill ``n`` requests of prompt bucket ``p`` into a fresh
  ``n``-row state (requests admitted together share one call);
- ``insert (b, n)``: write those ``n`` rows into a ``b``-row state (donated);
- ``gather (b, b')``: a bucket change, the live rows of a ``b``-row state into ``b'`` rows
  (neighbouring buckets only; ``gather`` goes bucket by bucket);
- ``zeros b``: a zeroed ``b``-row state;
- ``step (b, shape, greedy)``: the plain step (``shape`` None) or a speculative step of
  that shape, for greedy-only or mixed batches; with ``time_phases`` a speculative step is
  its ``draft`` and ``verify`` phase graphs instead.

One state layout serves every step of a batch bucket: it is sized for the largest
speculative shape (``speculative.state_spec``), so the policy can switch shapes between
steps without moving data. The state is donated to every step.

Shardings come from logical axes through the rules (``target.DEFAULT_AXIS_RULES``, fitted
to the target and mesh by ``sharding.model_axis_rules``): the abstract state's
(``ArraySpec``: batch on "data", KV heads on "model") and every parameter's
(``logical_axes`` metadata: heads, MLP width and vocabulary on "model"; norms and
hidden dims replicated). Parameters are placed with those shardings, in and out
shardings are pinned on every graph and GSPMD partitions the rest. The draft runs
replicated over "model" (see ``__init__``). Under a mesh of several devices the Pallas
kernels run inside shard_map (custom calls cannot be partitioned by GSPMD;
``eagle_jax.kernels.sharded``) and the CPU FFI kernels are off: the execution plan
(``self.plan``, ``kernels.plan``) says which kernels every graph runs.

Calling a key that was not built raises ``CompileAfterBuildError``, and a built graph is
a ``Compiled`` executable, which refuses arguments of other shapes instead of
recompiling: after ``build`` this table cannot compile, by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.kernels.plan import KERNEL_IMPLS, TREE_ATTENTION_BLOCK  # noqa: F401  (re-exported)
from eagle_jax.models.draft import Eagle3Draft
from eagle_jax.errors import ConfigError, EagleJaxError
from eagle_jax.spec.sampling import SamplingArrays
from eagle_jax.spec.config import SpeculativeConfig
from eagle_jax.spec.steps import (
    DraftSync,
    SpecState,
    Tree,
    Proposer,
    EAGLE3,
    draft_phase_impl,
    plain_step_impl,
    prefill_impl,
    speculative_step_impl,
    state_spec,
    verify_phase_impl,
)
from eagle_jax.runtime.executable_cache import ExecutableCache, describe_tree
from eagle_jax.runtime.plan import bind_for_inference, resolve_plan
from eagle_jax.runtime.sharding import DRAFT_SHARDINGS, check_draft_sharding  # noqa: F401  (DRAFT_SHARDINGS re-exported)
from eagle_jax.runtime.sharding import batch_rules, describe_mesh, model_axis_rules, replicated_rules, spans_processes
from eagle_jax.validate import int_in
from eagle_jax.models.target import (TargetModel, cache_len, default_mesh, init_from_spec, is_spec, partition_spec,
                                     shardings_for)

log = logging.getLogger(__name__)

class CompileAfterBuildError(EagleJaxError):
    """A graph was asked for that the step table did not compile at start-up."""


def default_prefill_batches(batch_buckets: Sequence[int], prompt_bucket: int, token_budget: int) -> tuple[int, ...]:
    """Prefill batch sizes for one prompt bucket: 1, then every batch bucket whose padded
    tokens fit ``token_budget``. Batching pays for short prompts (matrix products of a
    few dozen rows waste the weights' reads); a long prompt is already a big product."""
    return tuple(sorted({1} | {n for n in batch_buckets if n * prompt_bucket <= token_budget}))


def _largest_at_most(values: Sequence[int], n: int) -> int:
    return max(v for v in values if v <= n)


@dataclasses.dataclass(frozen=True)
class GraphTiming:
    """Where one graph's start-up time went: tracing in Python, lowering to StableHLO
    (a Pallas kernel's own passes included), and the backend compile, which a persistent
    cache hit replaces by a read (``cache_hit``)."""

    name: str
    trace_s: float
    lower_s: float
    compile_s: float
    cache_hit: bool
    # Read from the eagle-jax executable cache (``runtime.executable_cache``): not traced
    # nor lowered (cache_hit is set too).
    loaded: bool = False

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s


class _CacheEvents:
    """Counts JAX's persistent-cache hits (a monitoring event per executable read back),
    per thread: the event fires in the thread that compiles, and graphs compile on
    several threads at once (``StepTable._compile``)."""

    _local = threading.local()

    @classmethod
    def on_event(cls, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            cls._local.hits = cls.hits() + 1

    @classmethod
    def hits(cls) -> int:
        """Hits seen so far on the calling thread."""
        return getattr(cls._local, "hits", 0)


jax.monitoring.register_event_listener(_CacheEvents.on_event)


@dataclasses.dataclass
class BuildReport:
    graphs: int
    seconds: float
    names: list[str]
    # From each executable's memory analysis: the largest scratch one graph needs while it
    # runs (graphs run one at a time) and the code they hold (0 where XLA does not say).
    max_temp_bytes: int = 0
    code_bytes: int = 0
    timings: list[GraphTiming] = dataclasses.field(default_factory=list)
    workers: int = 1  # compiles that ran at once (the compile seconds overlap when > 1)

    @property
    def cache_hits(self) -> int:
        """Graphs read back from a cache (JAX's persistent cache or the executable cache)."""
        return sum(t.cache_hit for t in self.timings)

    @property
    def loaded(self) -> int:
        """Graphs read back from the executable cache, without tracing or lowering."""
        return sum(t.loaded for t in self.timings)

    def describe(self) -> str:
        split = ""
        if self.timings:
            phase = lambda f: sum(f(t) for t in self.timings)  # noqa: E731
            split = (f": trace {phase(lambda t: t.trace_s):.1f} s, lower {phase(lambda t: t.lower_s):.1f} s, "
                     f"compile or load {phase(lambda t: t.compile_s):.1f} s; {self.loaded} of {len(self.timings)} "
                     f"loaded untraced from the executable cache, {self.cache_hits - self.loaded} from JAX's "
                     f"persistent cache")
        threads = f" on {self.workers} threads" if self.workers > 1 else ""
        return (f"{self.graphs} graphs compiled in {self.seconds:.1f} s{threads}{split} (largest scratch "
                f"{self.max_temp_bytes / 2**20:.1f} MiB, code {self.code_bytes / 2**20:.1f} MiB)")

    def plus(self, other: "BuildReport | None") -> "BuildReport":
        """This report and ``other``'s (graphs compiled after it, e.g. by ``build_later``)
        as one: their graphs, seconds and timings added up."""
        if other is None:
            return self
        return BuildReport(self.graphs + other.graphs, self.seconds + other.seconds, self.names + other.names,
                           max(self.max_temp_bytes, other.max_temp_bytes), self.code_bytes + other.code_bytes,
                           self.timings + other.timings, max(self.workers, other.workers))

    def slowest(self, n: int = 5) -> str:
        """The ``n`` graphs that took longest, with their split (for a debug log)."""
        top = sorted(self.timings, key=lambda t: -t.total_s)[:n]
        how = lambda t: ", loaded" if t.loaded else ", cached" if t.cache_hit else ""  # noqa: E731
        return "; ".join(f"{t.name} {t.total_s:.1f} s (trace {t.trace_s:.1f}, lower {t.lower_s:.1f}, "
                         f"compile {t.compile_s:.1f}{how(t)})" for t in top)


def _memory_analysis(graph) -> dict | None:
    """``{"temp": scratch bytes, "code": code bytes}`` of a compiled graph, or None where the
    backend does not say."""
    try:
        m = graph.memory_analysis()
    except (AttributeError, NotImplementedError):  # a backend without the analysis
        return None
    if m is None:
        return None
    return {"temp": int(m.temp_size_in_bytes), "code": int(m.generated_code_size_in_bytes)}


def _is_speculative(key: tuple) -> bool:
    """A speculative step's graph (or one of its phases), as keyed by ``StepTable._define``."""
    return key[0] in ("draft", "verify") or (key[0] == "step" and key[2] is not None)


class StepTable:
    """Every compiled graph for one (target, draft) pair and one set of static shapes.

    Args:
      target: the target model (``eagle_jax.models.target.TargetModel``).
      draft: the EAGLE-3 draft, or None (plain steps only).
      shapes: the speculative shapes the policy may choose (empty: plain only).
      batch_buckets: padded batch sizes.
      prompt_buckets: padded prompt lengths for prefill.
      max_seq_len: context of one request (prompt + new tokens).
      prefill_token_budget: prefill batches up to this many padded tokens (see
        ``default_prefill_batches``).
      kernel_impl: verification kernels, "auto" / "kernel" / "reference" (the execution
        plan, ``self.plan``, is resolved from it, the backend and the mesh).
      check_finite: steps also return per-row "logits were finite" flags.
      time_phases: speculative steps run as two graphs (draft phase, verify phase), each
        waited for and timed into ``phase_seconds`` (a measuring mode: the syncs cost the
        host/device overlap); ``step`` still takes one call.
      proposer: what proposes the verified tokens (``steps.Proposer``; default EAGLE-3's
        draft tree; the oracle measures at a chosen acceptance). With ``row_width`` > 0,
        speculative steps take the proposer's per-row data (``rows``, ``[B, row_width]``).
      mesh: the device mesh, axes data and model (default: one device;
        ``sharding.make_mesh``). On more than one device the Pallas kernels run under
        shard_map (``plan.kernel_path`` says so) and the CPU FFI kernels are off.
      cache_align: round the target cache length up to a multiple of this (default: the
        tree-attention kernel's block on GPUs, so the kernel applies; 1 on CPU).
      plain: compile the plain step (a policy that never runs it need not).
      sampled: compile steps for batches with sampled rows (False: greedy-only steps).
      draft_sharding: "replicated" (the draft whole on every device, its rows on "data")
        or "model" (its heads, MLP width and vocabularies split over "model" by the
        target's rules fitted to the draft's sizes).
      draft_sync: how plain steps and prefill keep the draft (``speculative.DraftSync``
        or its mode, "eager" or "deferred"); with no draft it does not apply.
      weight_dtype: the weights' dtype asked for; "bfloat16" on a CPU with the packed
        kernel binds float32 weights as bfloat16 panels (``runtime.plan.model_dtype``:
        load the models in float32 for it).
    """

    def __init__(
        self, target: TargetModel, draft: Eagle3Draft | None, *, shapes: Sequence[SpeculativeConfig],
        batch_buckets: Sequence[int], prompt_buckets: Sequence[int], max_seq_len: int,
        prefill_token_budget: int = 512, kernel_impl: str = "auto", check_finite: bool = False,
        time_phases: bool = False, proposer: Proposer = EAGLE3,
        mesh: Mesh | None = None, cache_align: int | None = None, plain: bool = True, sampled: bool = True,
        draft_sharding: str = "replicated", draft_sync: DraftSync | str = "eager", weight_dtype: str | None = None,
    ):
        shapes = tuple(dict.fromkeys(shapes))  # unique, in order
        if shapes and draft is None:
            raise ConfigError("speculative shapes were given but there is no draft")
        if time_phases and not shapes:
            raise ConfigError("time_phases needs at least one speculative shape")
        if not isinstance(proposer, Proposer):
            raise ConfigError(f"proposer must be a eagle_jax.spec.steps.Proposer, got {type(proposer).__name__}")
        if not plain and not shapes:
            raise ConfigError("a step table needs the plain step or at least one speculative shape")
        if isinstance(draft_sync, str):
            try:
                draft_sync = DraftSync(draft_sync)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if not isinstance(draft_sync, DraftSync):
            raise ConfigError(f"draft_sync must be a DraftSync or its mode, got {type(draft_sync).__name__}")
        # Without a draft there is nothing to keep in sync.
        self.draft_sync = draft_sync if draft is not None else DraftSync("eager")
        self.plain, self.sampled = plain, sampled
        self.target, self.draft, self.shapes = target, draft, shapes
        self.batch_buckets = tuple(batch_buckets)
        self.prompt_buckets = tuple(prompt_buckets)
        self.max_seq_len = max_seq_len
        self.check_finite, self.time_phases = check_finite, time_phases
        self.proposer = proposer
        # Seconds spent in each phase of the speculative steps run under time_phases
        # ("wait": draining work queued before the draft phase).
        self.phase_seconds = {"wait": 0.0, "draft": 0.0, "verify": 0.0}
        self.mesh = mesh or default_mesh()
        self.multi_process = spans_processes(self.mesh)
        # Which kernels every graph runs, decided once (runtime.plan.resolve_plan, by the
        # rules in kernels.plan) and passed to each (plan=): the verify kernels and tree
        # attention by backend and kernel_impl, the CPU FFI kernels where they build on one
        # device, the Pallas kernels under shard_map over a mesh of several devices.
        self.plan = resolve_plan(kernel_impl=kernel_impl, mesh=self.mesh, dtype=weight_dtype)
        self.kernel_impl = kernel_impl
        self.cache_align = cache_align or self.plan.cache_align
        self.prefill_batches = {
            p: default_prefill_batches(self.batch_buckets, p, prefill_token_budget) for p in self.prompt_buckets
        }
        # The target's stacked form where the plan stacks layers, packed where it packs.
        self.plan, target, self._bound = bind_for_inference(self.plan, target, draft)
        self.target = target
        # Sharding rules: the target's from its sizes (a ConfigError when the mesh does not
        # fit it; KV heads replicated where they do not divide "model"). The draft runs
        # replicated over "model" by default (its rows on "data"): one small layer run S
        # times per step, where tensor parallelism adds two all-reduces per draft step
        # plus a vocabulary-wide top-k across shards; draft_sharding="model" splits it
        # (scripts/bench_draft_sharding.py times both on the devices at hand).
        self.draft_sharding = check_draft_sharding(draft_sharding)
        self.rules = model_axis_rules(target.axis_sizes(), self.mesh, what="target")
        self.draft_rules = (model_axis_rules(draft.axis_sizes(), self.mesh, what="draft")
                            if draft is not None and draft_sharding == "model" else replicated_rules(self.rules))
        self.param_shardings = tuple(
            tuple(NamedSharding(self.mesh, partition_spec(a, rules)) for a in axes)
            for axes, rules in zip(self._bound.axes, (self.rules, self.draft_rules))
        )
        self.params = jax.device_put(self._bound.params, self.param_shardings)
        self._specs = {b: self._state_spec(b) for b in set(self.batch_buckets) | self._prefill_sizes() | {1}}
        self._clear = None  # rezero's flag on the devices, made at its first call
        self._graphs: dict[tuple, Any] = {}
        # Executables kept across runs, looked up before tracing (off across processes:
        # each would load its own, and one that misses would trace collectives alone).
        self.executable_cache = None if self.multi_process else ExecutableCache.for_manifest(self._manifest())
        self.report: BuildReport | None = None
        # Speculative graphs left to build_later (build(speculative_later=True)).
        self._later: list[tuple[str, tuple, Callable]] = []
        # bucket -> the shapes compiled there, where prune_later left some out.
        self._shapes_at: dict[int, tuple[SpeculativeConfig, ...]] = {}

    @functools.cached_property
    def params_signature(self) -> str:
        """``describe_tree`` of the bound parameters, for the graphs' signatures."""
        return "params:" + describe_tree(self.params)

    def _manifest(self) -> dict:
        """What every graph of this table depends on besides its own signature (the
        executable cache's key, with the sources and versions it adds)."""
        import os

        kind = lambda m: f"{type(m).__module__}.{type(m).__qualname__}" if m is not None else None  # noqa: E731
        return {
            "target": kind(self.target), "target_config": repr(self.target.config),
            "draft": kind(self.draft), "draft_config": repr(self.draft.config) if self.draft is not None else None,
            "plan": repr(self.plan), "kernel_impl": self.kernel_impl, "check_finite": self.check_finite,
            "time_phases": self.time_phases, "proposer": f"{kind(self.proposer)}:{self.proposer.describe()}",
            "draft_sync": repr(self.draft_sync), "max_seq_len": self.max_seq_len, "cache_align": self.cache_align,
            "plain": self.plain, "sampled": self.sampled, "draft_sharding": self.draft_sharding,
            "rules": repr(self.rules), "draft_rules": repr(self.draft_rules),
            "mesh": [self.mesh.axis_names, dict(self.mesh.shape), [d.id for d in self.mesh.devices.flat]],
            "cpu_matmul": os.environ.get("EAGLE_JAX_CPU_MATMUL", ""),
        }

    # -- shapes and shardings

    def _prefill_sizes(self) -> set[int]:
        return {n for ns in self.prefill_batches.values() for n in ns}

    def _state_spec(self, b: int) -> SpecState:
        return state_spec(self.target, self.draft, list(self.shapes), b, self.max_seq_len,
                          cache_align=self.cache_align, deferred=self.draft_sync.deferred)

    def _batch_sharding(self, b: int, ndim: int) -> NamedSharding:
        """Arrays of ``b`` rows (axis 0): rows on "data" when it divides ``b`` (``sharding.batch_rules``)."""
        return NamedSharding(self.mesh, partition_spec(("batch",) + (None,) * (ndim - 1), batch_rules(self.rules, self.mesh, b)))

    @property
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def _host_sharding(self, b: int, ndim: int) -> NamedSharding:
        """What the host loop reads back (tokens, accept lengths, finite flags): rows on
        "data" like the state, except on a mesh over several processes, where it is
        replicated so that every process can read every row (a small all-gather)."""
        if self.multi_process:
            return self._replicated
        return self._batch_sharding(b, ndim)

    def state_shardings(self, b: int) -> SpecState:
        """The sharding of every leaf of a ``b``-row state, from its logical axes: the
        target cache by the target's rules, the draft cache by the draft's."""
        spec = self._specs[b]
        sh = shardings_for(spec, self.mesh, batch_rules(self.rules, self.mesh, b))
        if spec.draft_cache is not None:
            sh = dataclasses.replace(sh, draft_cache=shardings_for(
                spec.draft_cache, self.mesh, batch_rules(self.draft_rules, self.mesh, b)))
        return sh

    def _structs(self, b: int):
        spec = self._specs[b]
        sh = self.state_shardings(b)
        return jax.tree.map(lambda s, h: s.struct(h), spec, sh, is_leaf=is_spec), sh

    def _samp_struct(self, b: int) -> SamplingArrays:
        return SamplingArrays(*(jax.ShapeDtypeStruct(s, d, sharding=self._batch_sharding(b, len(s)))
                                for s, d in (((b,), jnp.float32), ((b,), jnp.int32), ((b,), jnp.float32), ((b, 2), jnp.uint32))))

    def _int_struct(self, *shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._batch_sharding(shape[0], len(shape)))

    @property
    def target_cache_len(self) -> int:
        return cache_len(self._specs[self.batch_buckets[0]].target_cache)

    def verify_attention_path(self) -> str:
        """How verify forwards attend in this table's graphs, and why (for the start-up
        log): ``ExecutionPlan.verify_attention`` with the table's shapes and its real cache
        shape, by the same rule the forwards follow."""
        leaf = jax.tree.leaves(self._specs[self.batch_buckets[0]].target_cache, is_leaf=is_spec)[0]
        shape = leaf.shape
        if "layers" in leaf.axes:  # [B, L, S, KV, D]: a layer's is [B, S, KV, D]
            shape = tuple(n for n, a in zip(shape, leaf.axes) if a != "layers")
        return self.plan.verify_attention(self.target.config.num_attention_heads, shape, leaf.dtype,
                                          [(s.shape, s.num_draft_tokens) for s in self.shapes], self.plain)

    def describe(self) -> str:
        """What this table compiled and how it runs, for the start-up line: buckets,
        context, dtype, the mesh and what its rules did that a reader would not guess,
        the execution plan, and how the draft follows plain steps."""
        parts = [
            f"batch buckets {self.batch_buckets}; prompt buckets {self.prompt_buckets} (prefill batches "
            f"{dict(self.prefill_batches)}); max_seq_len {self.max_seq_len} (target cache {self.target_cache_len} slots); "
            f"dtype {jnp.dtype(self.target.dtype).name}",
            self._mesh_note(),
            self.plan.describe(self.verify_attention_path()),
        ]
        if self.draft is not None:
            s = self.draft_sync
            how = ("plain steps and prefill store the draft's inputs, a speculative step first runs the draft over "
                   f"what is pending, {s.rows} rows x {s.width} positions at a time" if s.deferred
                   else "prefill and plain steps run the draft")
            parts.append(f"draft sync {s.mode} ({how})")
        if self.time_phases:
            parts.append("time_phases on (draft and verify phases compiled and timed separately, slower than the fused step)")
        if self.proposer != EAGLE3:
            parts.append(f"proposer {self.proposer.describe()}")
        return "; ".join(parts)

    def _mesh_note(self) -> str:
        """The mesh, its devices, and what the rules did that a reader would not guess."""
        mesh = self.mesh
        note = f"mesh {describe_mesh(mesh)} over {[str(d) for d in mesh.devices.flat]}"
        if self.multi_process:
            note += f" (process {jax.process_index()} of {jax.process_count()}; tokens read back replicated)"
        if mesh.shape["model"] > 1:
            kv = self.target.axis_sizes()["kv_heads"]
            note += (f" (KV heads: {kv}, replicated over model={mesh.shape['model']})" if self.rules["kv_heads"] is None
                     else f" (KV heads: {kv} split over model)")
            if self.draft is not None:
                note += f"; draft {'split over' if self.draft_sharding == 'model' else 'replicated over'} model"
        shards = mesh.shape.get("expert", 1)
        if shards > 1:
            e = self.target.axis_sizes()["experts"]
            note += f" (routed experts: {e} split over expert={shards} ({e // shards} per device))"
        d = mesh.shape["data"]
        if d > 1:
            odd = [b for b in self.batch_buckets if b % d]
            note += (f"; batch buckets {odd} are not multiples of data={d}: their rows run replicated over data"
                     if odd else f"; batch rows split over data={d}")
        return note

    # -- graph definitions

    def _jit(self, fn, in_sh, out_sh, donate=()):
        return jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)

    def _modules(self, params):
        return self._bound.modules(params)

    def _define(self) -> list[tuple[str, tuple, Callable[[], Any]]]:
        """(name, key, ``_GraphJob``) for every graph."""
        jobs = []
        psh = self.param_shardings
        bsh, hsh = self._batch_sharding, self._host_sharding
        fin = (lambda b: hsh(b, 1)) if self.check_finite else (lambda b: None)
        proposer, width = self.proposer, self.proposer.row_width

        for n in sorted(self._prefill_sizes() - set(self.batch_buckets)):
            _, sh = self._structs(n)
            jobs.append((f"zeros batch {n}", ("zeros", n), self._job(lambda n=n: init_from_spec(self._specs[n]), (), sh, (), (),
                                                                      output=self._specs[n])))
        # A one-row prefill state zeroed in place (donated): what a fresh one costs is mostly
        # the allocator mapping and faulting in new pages (32 ms for SmolLM2's 2,050 slots
        # against 3 ms to clear the same buffers), on every request's time to first token.
        # The select on a runtime flag reads the old values, so XLA writes the zeros into
        # the donated buffers instead of allocating (a constant zero ignores them).
        st1, sh1 = self._structs(1)

        def rezero(state, clear):
            return jax.tree.map(lambda s: jnp.where(clear, jnp.zeros((), s.dtype), s), state)

        jobs.append(("rezero batch 1", ("rezero", 1),
                     self._job(rezero, (sh1, self._replicated), sh1, (0,), (st1, jax.ShapeDtypeStruct((), jnp.bool_)))))
        for p in self.prompt_buckets:
            for n in self.prefill_batches[p]:
                def prefill(params, state, tokens, start, lengths, next_tokens, samp):
                    t, d = self._modules(params)
                    return prefill_impl(t, d, state, tokens, lengths, samp, greedy_only=False, plan=self.plan,
                                        start=start, next_tokens=next_tokens)

                st, sh = self._structs(n)
                i1 = self._int_struct(n)
                args = (self.params, st, self._int_struct(n, p), i1, i1, i1, self._samp_struct(n))
                in_sh = (psh, sh, bsh(n, 2), bsh(n, 1), bsh(n, 1), bsh(n, 1), self._samp_shardings(n))
                jobs.append((f"prefill chunk {n}x{p}", ("prefill", n, p), self._job(prefill, in_sh, (sh, hsh(n, 1)), (1,), args)))

        for b in self.batch_buckets:
            st, sh = self._structs(b)
            jobs.append((f"zeros batch {b}", ("zeros", b),
                         self._job(lambda b=b: init_from_spec(self._specs[b]), (), sh, (), (), output=self._specs[b])))
            for n in sorted(self._prefill_sizes()):
                if n > b:
                    continue
                nst, nsh = self._structs(n)

                def insert(state, rows_state, rows):
                    # Row i of rows_state goes to row rows[i]; rows past the end are padding, dropped.
                    return jax.tree.map(lambda s, r: s.at[rows].set(r.astype(s.dtype), mode="drop"), state, rows_state)

                jobs.append((f"insert {n} into batch {b}", ("insert", b, n),
                             self._job(insert, (sh, nsh, bsh(n, 1)), sh, (0,), (st, nst, self._int_struct(n)))))
            for other in self._resize_targets(b):
                _, osh = self._structs(other)

                def gather(state, rows):
                    return jax.tree.map(lambda s: jnp.take(s, rows, axis=0), state)

                jobs.append((f"resize {b}->{other}", ("gather", b, other),
                             self._job(gather, (sh, bsh(other, 1)), osh, (), (st, self._int_struct(other)))))
            samp = self._samp_struct(b)
            # The proposer's per-row data (None without: no argument to pass).
            rows, rows_sh = (self._int_struct(b, width), bsh(b, 2)) if width else (None, None)
            for shape in ((None,) if self.plain else ()) + self.shapes:
                if shape is not None and self.time_phases:
                    def draft_phase(params, dcache, state, samp, rows, shape=shape):
                        t, d = self._modules(params)
                        return draft_phase_impl(t, d, dataclasses.replace(state, draft_cache=dcache), samp, cfg=shape,
                                                proposer=proposer, rows=rows, sync=self.draft_sync, plan=self.plan)

                    rest = dataclasses.replace(st, draft_cache=None)
                    rest_sh = dataclasses.replace(sh, draft_cache=None)
                    tree_sh = bsh(b, 2)
                    jobs.append((f"draft phase batch {b} {shape.shape}", ("draft", b, shape),
                                 self._job(draft_phase, (psh, sh.draft_cache, rest_sh, self._samp_shardings(b), rows_sh),
                                             (tree_sh, sh.draft_cache), (1,), (self.params, st.draft_cache, rest, samp, rows))))
                for greedy in (True, False) if self.sampled else (True,):
                    how = "greedy" if greedy else "sampled"
                    kw = dict(greedy_only=greedy, max_seq_len=self.max_seq_len)
                    outs = (sh, hsh(b, 2), hsh(b, 1), fin(b))
                    if shape is None:
                        def plain(params, state, samp, kw=kw):
                            t, d = self._modules(params)
                            return plain_step_impl(t, d, state, samp, check_finite=self.check_finite, plan=self.plan, **kw)

                        jobs.append((f"plain step batch {b} {how}", ("step", b, None, greedy),
                                     self._job(plain, (psh, sh, self._samp_shardings(b)), outs, (1,), (self.params, st, samp))))
                    elif self.time_phases:
                        def verify_phase(params, state, tree, samp, shape=shape, kw=kw):
                            t, d = self._modules(params)
                            return verify_phase_impl(t, d, state, tree, state.draft_cache, samp, cfg=shape,
                                                     plan=self.plan, check_finite=self.check_finite, **kw)

                        tree_struct = self._tree_struct(b, shape)
                        jobs.append((f"verify phase batch {b} {shape.shape} {how}", ("verify", b, shape, greedy),
                                     self._job(verify_phase, (psh, sh, bsh(b, 2), self._samp_shardings(b)), outs, (1,),
                                                 (self.params, st, tree_struct, samp))))
                    else:
                        def spec_step(params, state, samp, rows, shape=shape, kw=kw):
                            t, d = self._modules(params)
                            return speculative_step_impl(t, d, state, samp, cfg=shape, plan=self.plan,
                                                         check_finite=self.check_finite, proposer=proposer, rows=rows,
                                                         sync=self.draft_sync, **kw)

                        jobs.append((f"speculative step batch {b} {shape.shape} {how}", ("step", b, shape, greedy),
                                     self._job(spec_step, (psh, sh, self._samp_shardings(b), rows_sh), outs, (1,),
                                                 (self.params, st, samp, rows))))
        return jobs

    def _samp_shardings(self, b: int) -> SamplingArrays:
        sh = self._batch_sharding
        return SamplingArrays(sh(b, 1), sh(b, 1), sh(b, 1), sh(b, 2))

    def _tree_struct(self, b: int, shape: SpeculativeConfig):
        s = self._int_struct(b, shape.num_draft_tokens)
        return Tree(tokens=s, parents=s, depths=s)

    def _job(self, fn, in_sh, out_sh, donate, args, output=None) -> "_GraphJob":
        """``output``: for a graph whose result does not follow from its arguments (a
        zeroed state: its shapes follow the largest speculative shape), that result's
        spec, so the executable cache keys it."""
        return _GraphJob(self, fn, in_sh, out_sh, donate, args, output)

    # -- build

    def build(self, progress: bool = False, speculative_later: bool = False, workers: int | None = None) -> BuildReport:
        """Compile every graph (once); returns how many and how long.

        ``workers``: backend compiles that run at once (default
        ``defaults.compile_workers()``, one per core up to four): this thread traces and
        lowers each graph in turn (Python, one at a time) while XLA compiles the ones
        before it on other threads, so a cold start uses every core.

        ``speculative_later``: compile everything but the speculative steps (and their
        draft and verify phases) now, and leave those to ``build_later`` (the engine's
        background compile, ``EngineConfig.background_compile``): the table can prefill
        and run plain steps as soon as this returns. Asking for a speculative graph
        before ``build_later`` has compiled it raises ``CompileAfterBuildError``."""
        if self.report is not None:
            return self.report
        jobs = self._define()
        if speculative_later:
            self._later = [j for j in jobs if _is_speculative(j[1])]
            jobs = [j for j in jobs if not _is_speculative(j[1])]
        self.report = self._compile(jobs, progress, "at start-up", workers=workers)
        return self.report

    def shapes_at(self, b: int) -> tuple[SpeculativeConfig, ...]:
        """The speculative shapes compiled (or to be compiled) in batch bucket ``b``."""
        return self._shapes_at.get(b, self.shapes)

    def prune_later(self, shapes_at: Callable[[int], Sequence[SpeculativeConfig]]) -> int:
        """Leave out of ``build_later`` the speculative graphs of every bucket ``b`` whose
        shape is not in ``shapes_at(b)`` (a policy's ``shapes_at``, fitted before they
        compile); returns how many graphs were left out. The state layout stays the one
        for every shape, so a bucket's rows move to any other without change."""
        if any(_is_speculative(k) for k in self._graphs):
            raise ConfigError("prune_later() after the speculative graphs were compiled")
        kept = {b: tuple(s for s in self.shapes if s in tuple(shapes_at(b))) for b in self.batch_buckets}
        before = len(self._later)
        self._later = [j for j in self._later if j[1][2] in kept[j[1][1]]]
        self._shapes_at = {b: v for b, v in kept.items() if v != self.shapes}
        return before - len(self._later)

    def build_later(self, stop: threading.Event | None = None, workers: int = 1,
                    when: str = "in the background") -> BuildReport | None:
        """Compile the graphs ``build(speculative_later=True)`` left out (any thread may
        call it while another runs the table's compiled graphs: it only adds graphs);
        returns their report, or None when ``stop`` was set before the last one (checked
        between graphs: a compile in progress cannot be interrupted). One compile at a
        time by default: the engine's steps keep the other cores."""
        if self.report is None:
            raise CompileAfterBuildError("build_later() before build(): nothing was compiled yet")
        report = self._compile(self._later, False, when, stop, workers=workers)
        if report is not None:
            self._later = []
        return report

    @property
    def speculative_pending(self) -> int:
        """Speculative graphs that ``build(speculative_later=True)`` left to ``build_later``
        and that are not compiled yet."""
        return sum(key not in self._graphs for _, key, _ in self._later)

    def _compile(self, jobs, progress: bool, when: str, stop: threading.Event | None = None,
                 workers: int | None = None) -> BuildReport | None:
        """Build ``jobs``: each graph in the executable cache is loaded on a worker thread;
        the others are traced and lowered in order on this thread and compiled (then
        stored in the cache) on ``workers`` threads. At most ``workers`` graphs wait or
        compile at once, which bounds memory; each is stored in the table as it finishes,
        in order. ``stop`` is checked before each graph; the ones in flight then finish."""
        import collections
        import concurrent.futures
        import contextlib

        from rich.progress import Progress

        from eagle_jax.defaults import compile_workers

        workers = compile_workers() if workers is None else int_in("workers", workers, 1, 64)
        cache = self.executable_cache
        t0 = time.perf_counter()
        timings = []
        memories: list[dict] = []  # each graph's memory analysis, taken on the worker threads
        in_flight: collections.deque = collections.deque()

        def noted(e: Exception, name: str) -> Exception:
            e.add_note(f"eagle-jax: while compiling the {name} graph {when}")
            return e

        def compile_and_store(job, lowered, exe_key, name):
            graph, seconds, hit = job.compile(lowered)
            memory = _memory_analysis(graph)
            # Only what XLA compiled here: an executable JAX read back from its own cache
            # serializes without its kernels on XLA:CPU (the loaded copy then fails with
            # "Function ... not found"), so it is left to the next cold compile.
            if exe_key is not None and not hit:
                cache.store(exe_key, graph, name, memory)
            return graph, seconds, hit, False, memory

        def load(exe_key, name):
            t = time.perf_counter()
            got = cache.load(exe_key, name, devices=list(self.mesh.devices.flat))
            if got is None:
                return None, time.perf_counter() - t, False, False, None
            graph, memory = got
            return graph, time.perf_counter() - t, True, True, memory if memory is not None else _memory_analysis(graph)

        def lowered(name, job):
            try:
                return job.lower()
            except Exception as e:
                raise noted(e, name)

        def finish(bar, task) -> None:
            name, key, job, exe_key, trace_s, lower_s, future = in_flight.popleft()
            try:
                graph, compile_s, hit, loaded, memory = future.result()
                if graph is None:  # an unreadable cache entry (warned): compile it here
                    low, trace_s, lower_s = lowered(name, job)
                    graph, compile_s, hit, loaded, memory = compile_and_store(job, low, exe_key, name)
            except Exception as e:
                raise noted(e, name)
            self._graphs[key] = graph  # one assignment: a reader on another thread sees it whole or not at all
            if memory is not None:
                memories.append(memory)
            timings.append(GraphTiming(name, trace_s, lower_s, compile_s, hit, loaded))
            log.debug("compiled %s in %.1f s (trace %.2f, lower %.2f, compile %.2f%s)", name, timings[-1].total_s,
                      trace_s, lower_s, compile_s,
                      ", loaded from the executable cache" if loaded else ", from the persistent cache" if hit else "")
            if bar is not None:
                bar.advance(task)

        with (Progress(transient=True) if progress else contextlib.nullcontext()) as bar, \
                concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="eagle-jax-xla") as pool:
            task = bar.add_task("compiling", total=len(jobs)) if bar is not None else None
            try:
                for name, key, job in jobs:
                    if stop is not None and stop.is_set():
                        return None
                    if bar is not None:
                        bar.update(task, description=f"compiling {name}")
                    exe_key = cache.key(key, job.signature()) if cache is not None else None
                    if exe_key is not None and cache.has(exe_key):
                        in_flight.append((name, key, job, exe_key, 0.0, 0.0, pool.submit(load, exe_key, name)))
                    else:
                        low, trace_s, lower_s = lowered(name, job)
                        in_flight.append((name, key, job, exe_key, trace_s, lower_s,
                                          pool.submit(compile_and_store, job, low, exe_key, name)))
                    while len(in_flight) >= workers:
                        finish(bar, task)
                while in_flight:
                    finish(bar, task)
            finally:  # an error or a stop: what was submitted finishes (or fails) before we go on
                for *_, future in in_flight:
                    future.cancel()
        if cache is not None:
            cache.touch()
            for gone in cache.prune():
                log.info("executable cache: dropped %s (least recently used, over the size limit)", gone)
        report = BuildReport(len(jobs), time.perf_counter() - t0, [j[0] for j in jobs],
                             max([0] + [m["temp"] for m in memories]), sum(m["code"] for m in memories), timings,
                             workers)
        log.debug("slowest graphs: %s", report.slowest())
        return report

    def compile_graph(self, key: tuple) -> float:
        """Compile the one graph ``key`` (as ``build`` would) unless it is compiled; the
        seconds it took (0.0 when it already was). For measuring tools that time a few
        graphs of a large model (scripts/device/check.py): ``build`` compiles every graph
        the host loop can ask for, which an engine needs and a step timing does not."""
        if key in self._graphs:
            return 0.0
        jobs = {k: (name, job) for name, k, job in self._define()}
        if key not in jobs:
            raise CompileAfterBuildError(f"graph {key} is not one this table defines")
        name, job = jobs[key]
        t0 = time.perf_counter()
        try:
            self._graphs[key] = job.compile(job.lower()[0])[0]
        except Exception as e:
            e.add_note(f"eagle-jax: while compiling the {name} graph")
            raise
        return time.perf_counter() - t0

    def compiled(self, key: tuple):
        """The compiled executable of graph ``key`` (``as_text()`` shows its HLO, e.g. to
        check which kernels a step calls); raises ``CompileAfterBuildError`` if it was not
        compiled."""
        return self._get(key)

    def _get(self, key: tuple):
        g = self._graphs.get(key)
        if g is None:
            if any(key == k for _, k, _ in self._later):
                raise CompileAfterBuildError(f"graph {key} is still compiling in the background (build_later)")
            if self.report is None and not self._graphs:
                raise CompileAfterBuildError(f"step table not built yet (graph {key} asked for); call build() first")
            if len(key) > 2 and key[0] in ("step", "draft", "verify") and key[1] in self._shapes_at \
                    and key[2] is not None and key[2] not in self._shapes_at[key[1]]:
                raise CompileAfterBuildError(
                    f"graph {key} was left out at start-up: batch bucket {key[1]} compiles only "
                    f"{[s.shape for s in self._shapes_at[key[1]]] or 'the plain step'} (the policy's shapes_at)")
            raise CompileAfterBuildError(
                f"graph {key} was not compiled at start-up; the table holds batch buckets {self.batch_buckets}, "
                f"prompt buckets {self.prompt_buckets}, shapes {[s.shape for s in self.shapes]}"
            )
        return g

    # -- calls (each one a compiled executable; none can compile)

    def prefill_batch(self, prompt_len: int, n_requests: int) -> int:
        """The prefill batch size used for ``n_requests`` of prompt bucket ``prompt_len``
        admitted together (the largest compiled one that does not exceed it)."""
        return _largest_at_most(self.prefill_batches[prompt_len], n_requests)

    def prefill_chunk(self, state: SpecState, tokens, start, lengths, next_tokens, samp: SamplingArrays):
        """Prefill one chunk ``tokens [n, c]`` of ``n`` prompts at positions ``start [n]``
        into ``state`` (``n`` rows, donated; ``zeros(n)`` before the first chunk):
        ``(state, first_token [n])``, the first token valid for the rows whose prompt
        (``lengths``) ends in the chunk. ``next_tokens [n]``: each prompt's token after
        the chunk (see ``steps.prefill_impl``)."""
        n, c = tokens.shape
        return self._get(("prefill", n, c))(self.params, state, tokens, start, lengths, next_tokens, samp)

    def prefill(self, tokens, lengths, samp: SamplingArrays):
        """Prefill whole prompts ``tokens [n, p]`` (right-padded, ``p`` a prompt bucket)
        into a fresh ``n``-row state in one chunk: ``(row_state, first_token [n])``."""
        n, _ = tokens.shape
        zero = self.device_put_rows(np.zeros(n, np.int32))
        return self.prefill_chunk(self.zeros(n), tokens, zero, lengths, zero, samp)

    def zeros(self, b: int) -> SpecState:
        return self._get(("zeros", b))()

    def rezero(self, state: SpecState) -> SpecState:
        """A one-row ``state`` (donated) zeroed in place: what ``zeros(1)`` gives, without
        allocating."""
        if self._clear is None:
            self._clear = jax.device_put(np.bool_(True), self._replicated)
        return self._get(("rezero", 1))(state, self._clear)

    def insert(self, state: SpecState, rows_state: SpecState, rows) -> SpecState:
        """Rows ``rows [n]`` of ``state`` (donated) become ``rows_state``'s rows; a row
        index past the end is dropped (padding)."""
        b, n = state.seq_lens.shape[0], rows_state.seq_lens.shape[0]
        return self._get(("insert", b, n))(state, rows_state, rows)

    def _resize_targets(self, b: int) -> tuple[int, ...]:
        """The buckets a ``b``-row state has a resize graph to: its neighbours in
        ``batch_buckets`` only (a resize to a bucket further off goes through them), so
        the table holds 2(n - 1) resize graphs for n buckets where every pair would take
        n(n - 1): 8 graphs of 20 at five buckets, compiled on every cold start for a
        bucket change that happens a few times a run."""
        i = self.batch_buckets.index(b)
        return tuple(self.batch_buckets[j] for j in (i - 1, i + 1) if 0 <= j < len(self.batch_buckets))

    def gather(self, state: SpecState, rows: Sequence[int]) -> SpecState:
        """A bucket change: row i of the new ``len(rows)``-row state is row ``rows[i]`` of
        ``state`` (host indices). Between buckets that are not neighbours it goes bucket by
        bucket: growing, the old rows keep their places (new rows copy row 0) until the
        last hop applies ``rows``; shrinking, the first hop applies ``rows`` (padded with
        row 0) and the later ones keep the leading rows."""
        rows = np.asarray(rows, np.int32)
        b, target = state.seq_lens.shape[0], len(rows)
        if target not in self.batch_buckets or b not in self.batch_buckets or target == b:
            raise CompileAfterBuildError(f"resize {b}->{target}: needs two different batch buckets of {self.batch_buckets}")
        i, j = self.batch_buckets.index(b), self.batch_buckets.index(target)
        path = list(self.batch_buckets[i:j + 1] if j > i else self.batch_buckets[j:i + 1][::-1])
        for k, (src, dst) in enumerate(zip(path, path[1:])):
            if dst > src:  # growing: identity, then padding; the last hop applies rows
                hop = rows if dst == target else np.concatenate([np.arange(src), np.zeros(dst - src)])
            else:  # shrinking: the first hop applies rows, the later ones keep the leading rows
                hop = np.concatenate([rows, np.zeros(dst - target)]) if k == 0 else np.arange(dst)
            state = self._get(("gather", src, dst))(state, self.device_put_rows(hop.astype(np.int32)))
        return state

    def step(self, state: SpecState, samp: SamplingArrays, shape: SpeculativeConfig | None, greedy: bool, rows=None):
        """One step (plain when ``shape`` is None): ``(state, out_tokens [B, W], accept_length [B],
        finite [B] or None)``; the state is donated. ``rows``: the proposer's per-row data
        (``[B, proposer.row_width]``; None when it reads none). Under ``time_phases`` a
        speculative step runs as its two phases, each waited for and timed."""
        b = state.seq_lens.shape[0]
        if shape is None:
            return self._get(("step", b, None, greedy))(self.params, state, samp)
        # A graph it did not build is refused first (CompileAfterBuildError), then missing rows.
        graph = self._get(("step", b, shape, greedy) if not self.time_phases else ("draft", b, shape))
        if self.proposer.row_width and rows is None:
            raise ConfigError(f"proposer {self.proposer.describe()} reads per-row data: pass rows")
        if not self.time_phases:
            return graph(self.params, state, samp, rows)
        t = time.perf_counter()
        jax.block_until_ready(state)  # work queued before (prefill, insert, a plain step) is not drafting
        t0 = time.perf_counter()
        state, tree = self.draft_phase(state, samp, shape, rows)
        jax.block_until_ready((state, tree))
        t1 = time.perf_counter()
        out = jax.block_until_ready(self.verify_phase(state, tree, samp, shape, greedy))
        t2 = time.perf_counter()
        for phase, s in (("wait", t0 - t), ("draft", t1 - t0), ("verify", t2 - t1)):
            self.phase_seconds[phase] += s
        return out

    def time_step(self, b: int, shape: SpeculativeConfig | None, context: int = 0) -> float:
        """Seconds of one greedy step of ``shape`` (None: plain) on a fresh state of ``b``
        rows whose every row holds ``context`` committed positions (zeroed KV: what the
        attention costs does not depend on the values; a deferred draft counts as in
        sync), from launch to results ready (what a cost model calibrates on)."""
        from eagle_jax.spec.sampling import SamplingParams

        int_in("calibration context", context, 0, self.max_seq_len, hi_text=f"max_seq_len={self.max_seq_len}")
        state = self.zeros(b)
        if context:
            put = lambda: jax.device_put(np.full(b, context, np.int32), state.seq_lens.sharding)  # noqa: E731
            # Two buffers: the state is donated, and one buffer cannot be donated twice.
            state = dataclasses.replace(state, seq_lens=put(), draft_len=put() if state.deferred else None)
        state = jax.block_until_ready(state)
        samp = jax.block_until_ready(self.sampling([SamplingParams()] * b, b))
        width = self.proposer.row_width
        rows = jax.block_until_ready(self.device_put_rows(np.zeros((b, width), np.int32))) if width else None
        t0 = time.perf_counter()
        jax.block_until_ready(self.step(state, samp, shape, True, rows))
        return time.perf_counter() - t0

    def draft_phase(self, state: SpecState, samp: SamplingArrays, shape: SpeculativeConfig, rows=None):
        """The first half of a speculative step (compiled with ``time_phases``): ``(state,
        tree)``; the input state's draft cache is donated and the returned state holds the
        drafted one."""
        rest = dataclasses.replace(state, draft_cache=None)
        tree, dcache = self._get(("draft", state.seq_lens.shape[0], shape))(self.params, state.draft_cache, rest, samp, rows)
        return dataclasses.replace(state, draft_cache=dcache), tree

    def verify_phase(self, state: SpecState, tree, samp: SamplingArrays, shape: SpeculativeConfig, greedy: bool):
        return self._get(("verify", state.seq_lens.shape[0], shape, greedy))(self.params, state, tree, samp)

    def device_put_rows(self, x: np.ndarray):
        return jax.device_put(x, self._batch_sharding(x.shape[0], x.ndim))

    def sampling(self, params, b: int) -> SamplingArrays:
        s = SamplingArrays.build(params, b)
        return jax.device_put(s, self._samp_shardings(b))


class _GraphJob:
    """One graph of a step table, compiled in two halves: ``lower`` (trace and lower, in
    Python: one thread at a time) and ``compile`` (XLA, or a read from the persistent
    cache; any thread)."""

    def __init__(self, table: StepTable, fn, in_sh, out_sh, donate, args, output=None):
        self.table, self.fn, self.in_sh, self.out_sh, self.donate, self.args = table, fn, in_sh, out_sh, donate, args
        self.output = output

    def signature(self) -> str:
        """What the graph's program depends on besides the table's manifest: its
        arguments' shapes, dtypes and shardings, its in and out shardings, its donation,
        and the spec of an output its arguments do not determine (the executable cache's
        per-graph key)."""
        # The parameters (most leaves, in most graphs' arguments) are described once a table.
        args = tuple(self.table.params_signature if a is self.table.params else a for a in self.args)
        return f"{describe_tree(args)}\0{self.in_sh!r}\0{self.out_sh!r}\0{self.donate!r}\0{self.output!r}"

    def lower(self):
        """(lowered, trace seconds, lower seconds)."""
        # Traced under the mesh (the parts that run under shard_map take it from the
        # plan, ``table.plan.mesh``: the same mesh).
        with jax.set_mesh(self.table.mesh):
            t0 = time.perf_counter()
            traced = self.table._jit(self.fn, self.in_sh, self.out_sh, self.donate).trace(*self.args)
            t1 = time.perf_counter()
            lowered = traced.lower()
            t2 = time.perf_counter()
        return lowered, t1 - t0, t2 - t1

    @staticmethod
    def compile(lowered):
        """(compiled, seconds, read from the persistent cache)."""
        t0 = time.perf_counter()
        hits = _CacheEvents.hits()
        compiled = lowered.compile()
        return compiled, time.perf_counter() - t0, _CacheEvents.hits() > hits
