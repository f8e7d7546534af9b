"""Draft training data: the target's own responses to chat prompts, then the target's
features over each (prompt, response) sequence.

Two stages, each with a file format a researcher can inspect or replace:

1. ``regenerate`` -> ``conversations.jsonl``: one JSON object per line,
   ``{"prompt_ids": [...], "response_ids": [...], "finish_reason": ..., "temperature": ...,
   "id": ...}``. The target answers every prompt itself (EAGLE-3's recipe: the draft learns
   the target's distribution, not a dataset's). Answers stream to the file as they finish
   (``ConversationWriter``), so a killed run keeps them: ``read_answered`` reads them back,
   dropping a line torn by the kill, and a resumed run asks only for the missing ids.
   Whether an answer is sampled, and its seed, come from its prompt's id
   (``answer_params``), so a resumed run asks for the same answers an uninterrupted one
   would.
2. ``extract_features`` / ``write_features`` -> a ``FeatureSet``: per sequence the
   tokens, the prompt length (the loss covers only the response: ``FeatureSet.loss_mask``),
   the target's fused-layer features and its final normed hidden state (from which
   training recomputes the target's distribution over the draft vocabulary), and the
   target's argmax. Stored as ``.npy`` files (no pickle). ``write_features`` writes them
   shard by shard into memory-mapped files, so memory does not grow with the data and a
   killed run resumes at the first unfinished shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleJaxError, InputError
from eagle_jax.models.llama import BoundModules, LlamaModel, PrefixMask
from eagle_jax.models.target import init_from_spec
from eagle_jax.runtime.plan import bind_for_inference, resolve_plan, xla_plan
from eagle_jax.spec.sampling import SamplingParams
from eagle_jax.validate import is_int

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Conversation:
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str = "stop"
    temperature: float = 0.0
    id: str | int | None = None  # the prompt record's id (what a resumed run skips)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        if d["id"] is None:
            del d["id"]
        return json.dumps(d)


def _parse_conversation(line: str, where: str, vocab_size: int | None) -> Conversation:
    try:
        obj = json.loads(line)
        rid = obj.get("id")
        if rid is not None and not (isinstance(rid, str) or is_int(rid)):
            raise TypeError(f"id {rid!r} is not a string or an integer")
        conv = Conversation(
            prompt_ids=[int(t) for t in obj["prompt_ids"]],
            response_ids=[int(t) for t in obj["response_ids"]],
            finish_reason=str(obj.get("finish_reason", "stop")),
            temperature=float(obj.get("temperature", 0.0)),
            id=rid,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{where}: not a conversation record ({e})") from e
    if not conv.prompt_ids or not conv.response_ids:
        raise InputError(f"{where}: empty prompt_ids or response_ids")
    if vocab_size is not None:
        bad = [t for t in conv.prompt_ids + conv.response_ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"{where}: token id {bad[0]} outside [0, {vocab_size})")
    return conv


def read_conversations(path: Path, vocab_size: int | None = None) -> list[Conversation]:
    """Read ``conversations.jsonl``; errors name the line. Token ids are range-checked
    against ``vocab_size`` when given."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse_conversation(line, f"{path}:{n}", vocab_size))
    if not out:
        raise InputError(f"{path}: no conversations")
    return out


def id_key(rid) -> tuple[str, Any]:
    # 1 and "1" are different ids, as they are in JSON.
    return (type(rid).__name__, rid)


def read_answered(path: Path, vocab_size: int | None = None) -> tuple[dict[tuple[str, Any], Conversation], bool]:
    """The answers a (possibly killed) run has written to ``path``, by id key
    (``id_key``), and whether a torn last line was dropped.

    Every record is written as one line ending in a newline, so a last line without one
    was cut off by the kill: it is dropped and the file truncated to the line before it,
    so appending resumes on a clean line. Any other unreadable line is an error naming
    it, as is a record without an id (not written by a resumable run) or a repeated id.
    """
    if not path.is_file():
        return {}, False
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    torn = end < len(data)
    if torn:
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    out: dict[tuple[str, Any], Conversation] = {}
    for n, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{n}: not valid UTF-8 ({e})") from e
        if not line.strip():
            continue
        conv = _parse_conversation(line, f"{path}:{n}", vocab_size)
        if conv.id is None:
            raise InputError(f"{path}:{n}: record has no id, so it cannot be matched to a prompt to resume")
        if id_key(conv.id) in out:
            raise InputError(f"{path}:{n}: id {conv.id!r} answered twice")
        out[id_key(conv.id)] = conv
    return out, torn


def write_conversations(path: Path, convs: Iterable[Conversation]) -> None:
    """Write ``convs`` to ``path`` whole: a temporary file, synced, then renamed over it,
    so a kill leaves either the old file or the new one."""
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(c.to_json() + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class ConversationWriter:
    """Appends answers to ``conversations.jsonl`` as they finish.

    Each record is one ``write`` of a whole line followed by a flush, so a killed
    process loses no finished answer (the OS has it); ``fsync`` runs every
    ``fsync_every_s`` seconds and on close, bounding what a power loss could take.
    """

    def __init__(self, path: Path, *, fsync_every_s: float = 10.0):
        self._f = open(path, "a", encoding="utf-8")
        self._every = fsync_every_s
        self._last_sync = time.monotonic()

    def add(self, conv: Conversation) -> None:
        if conv.id is None:
            raise ValueError("a streamed conversation needs the id of its prompt record")
        self._f.write(conv.to_json() + "\n")
        self._f.flush()
        if time.monotonic() - self._last_sync >= self._every:
            os.fsync(self._f.fileno())
            self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self) -> "ConversationWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def answer_params(
    rid, *, seed: int, sampled_fraction: float, temperature: float, max_new_tokens: int
) -> SamplingParams:
    """How the target answers the prompt with id ``rid``: sampled at ``temperature``
    for a ``sampled_fraction`` of ids, greedy for the rest.

    Both the choice and the sampling seed are hashed from (``seed``, the id), never from
    the prompt's position in this run, so a resumed run (which asks only for the missing
    ids) gives each prompt the answer an uninterrupted run would have."""
    digest = hashlib.sha256(json.dumps([seed, rid]).encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2**64
    if u < sampled_fraction:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=int.from_bytes(digest[8:12], "little"))
    return SamplingParams(max_new_tokens=max_new_tokens)


def regenerate(
    engine,
    requests: Sequence[tuple[Any, list[int]]],
    *,
    max_new_tokens: int,
    sampled_fraction: float = 0.25,
    temperature: float = 0.7,
    seed: int = 0,
    on_answer: Callable[[Conversation], None] | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> list[Conversation]:
    """Have the target (a plain ``Engine``) answer every ``(id, prompt_ids)`` request;
    returns the answers in request order.

    Requests are fed to the engine's continuous batching a few at a time (its slots stay
    full while the queue stays short), and each answer is handed to ``on_answer`` as soon
    as it finishes, in finishing order (e.g. a ``ConversationWriter``).
    ``on_progress(done, total, new_tokens)`` follows each engine step that finished some.
    See ``answer_params`` for which answers are sampled.
    """
    params = [
        answer_params(rid, seed=seed, sampled_fraction=sampled_fraction, temperature=temperature, max_new_tokens=max_new_tokens)
        for rid, _ in requests
    ]
    # The queue holds one batch more than the slots: a freed slot is refilled at the next
    # step, and the host never encodes far ahead of what the device can take.
    ahead = 2 * engine.config.max_batch
    out: list[Conversation | None] = [None] * len(requests)
    nxt = done = n_tok = idle = 0
    while done < len(requests):
        while nxt < len(requests) and nxt - done < ahead:
            engine.add_request(list(requests[nxt][1]), params[nxt], request_id=nxt)
            nxt += 1
        engine.step()
        finished = engine.pop_finished()
        # A finished request leaves its slot at the next step, so an idle step or two can
        # pass before it is handed back; more means a request was lost.
        idle = idle + 1 if not finished and nxt == len(requests) and not engine.has_unfinished() else 0
        if idle > 2:
            raise EagleJaxError(f"the engine went idle with {len(requests) - done} requests unanswered")
        for c in finished:
            k = c.id
            if not c.token_ids:
                raise EagleJaxError(f"request {requests[k][0]!r} ended with no tokens ({c.finish_reason})")
            conv = Conversation(list(c.prompt_token_ids), list(c.token_ids), c.finish_reason, params[k].temperature, requests[k][0])
            out[k] = conv
            n_tok += len(conv.response_ids)
            done += 1
            if on_answer is not None:
                on_answer(conv)
        if finished and on_progress is not None:
            on_progress(done, len(requests), n_tok)
    return out  # type: ignore[return-value]  (every slot is filled: done == len(requests))


# ----------------------------------------------------------------------------- features

FEATURE_FILES = ("tokens", "lengths", "prompt_lengths", "features", "target_hidden", "target_argmax")
# Written by ``write_features`` beside the arrays: how far it got, and for what input.
PROGRESS_FILE = "progress.json"


@dataclasses.dataclass
class FeatureSet:
    """The target's view of N training sequences, padded to L.

    tokens [N, L] int32; lengths [N]; prompt_lengths [N] (tokens before the response);
    features [N, L, F] float16 (the target's fused-layer features, F = 3 * Ht);
    target_hidden [N, L, Ht] float16 (final normed hidden; ``@ lm_head`` gives the target's
    logits); target_argmax [N, L] int32 (the target's greedy next token at each position).
    Positions at or past a row's length are padding (zero in sets ``write_features`` made).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    features: np.ndarray
    target_hidden: np.ndarray
    target_argmax: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def loss_mask(self) -> np.ndarray:
        """[N, L] bool, True exactly on response tokens: ``prompt_length <= j < length``.

        These are the positions whose tokens training predicts (``ttt_loss`` counts a label
        at position j only in that range). Everything before the response, the system
        prompt, earlier turns (earlier assistant replies included) and the generation
        prompt, is context only."""
        j = np.arange(self.tokens.shape[1])
        return (j >= np.asarray(self.prompt_lengths)[:, None]) & (j < np.asarray(self.lengths)[:, None])

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name in FEATURE_FILES:
            np.save(path / f"{name}.npy", getattr(self, name), allow_pickle=False)

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True, finished_shards: bool = False) -> "FeatureSet":
        """Read a saved set (never unpickling); shapes are checked against each other.
        A set ``write_features`` has not finished is refused (its later rows are zeros),
        unless ``finished_shards``: then the rows of its finished shards are the set (the
        first rows, in the conversations' order; none finished is refused)."""
        path = Path(path)
        missing = [n for n in FEATURE_FILES if not (path / f"{n}.npy").is_file()]
        if missing:
            raise InputError(f"{path} is not a feature set: missing {', '.join(m + '.npy' for m in missing)}")
        rows = None
        if (path / PROGRESS_FILE).is_file():
            state = _read_progress(path / PROGRESS_FILE)
            if state.get("complete") is not True:
                done = state.get("shards_done")
                shard_size = (state.get("spec") or {}).get("shard_size")
                if not finished_shards:
                    raise InputError(
                        f"{path} is unfinished ({done} of {state.get('shards')} shards written): "
                        f"rerun `eagle-jax draft-data` with the same arguments to finish it"
                    )
                if not (isinstance(done, int) and isinstance(shard_size, int) and done > 0 and shard_size > 0):
                    raise InputError(f"{path} has no finished shard yet ({done} of {state.get('shards')})")
                rows = done * shard_size
        arrs = {n: np.load(path / f"{n}.npy", mmap_mode="r" if mmap else None, allow_pickle=False) for n in FEATURE_FILES}
        if rows is not None:
            arrs = {n: a[:rows] for n, a in arrs.items()}
        fs = cls(**arrs)
        fs.check()
        return fs

    def check(self) -> None:
        n, width = self.tokens.shape
        want = {
            "lengths": (n,), "prompt_lengths": (n,), "target_argmax": (n, width),
        }
        for name, shape in want.items():
            if getattr(self, name).shape != shape:
                raise InputError(f"feature set {name} has shape {getattr(self, name).shape}, expected {shape}")
        for name in ("features", "target_hidden"):
            if getattr(self, name).shape[:2] != (n, width):
                raise InputError(f"feature set {name} has shape {getattr(self, name).shape}, expected ({n}, {width}, ...)")
        lengths, plens = np.asarray(self.lengths), np.asarray(self.prompt_lengths)
        if (lengths < 2).any() or (lengths > width).any() or (plens < 1).any() or (plens >= lengths).any():
            raise InputError(f"feature set lengths must satisfy 1 <= prompt_length < length <= {width}")


def _forward_fn(target: LlamaModel, kernels: str = "inference"):
    """The target's forward over whole sequences: hidden states, features, argmax.

    ``kernels="inference"`` (the default): bound as the engine binds it (no gradient is
    needed here; ``runtime.plan.bind_for_inference``): on a CPU the packed-weight and
    prefill-attention kernels and the stacked layers, so the features are the ones the
    engine's prefill computes, at its speed. ``"xla"``: XLA's own kernels, unrolled."""
    if kernels == "inference":
        plan, _, bound = bind_for_inference(resolve_plan(), target)
    elif kernels == "xla":
        plan, bound = xla_plan(), BoundModules(target)  # an MoE target picks its formulation by the plan
    else:
        raise ValueError(f"kernels={kernels!r}; valid: inference, xla")

    @jax.jit
    def run(params, tokens):
        model = bound.modules(params)[0]
        b, width = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(width), (b, width))
        cache = init_from_spec(model.cache_spec(b, width))  # any target's cache (the seam)
        # Causal over an empty prefix: the prefill chunk's mask (the kernels' prefill path).
        mask = PrefixMask.causal(jnp.zeros((b,), jnp.int32), width)
        h, feats, _ = model(tokens, pos, cache, pos, mask, return_features=True, plan=plan)
        return h, feats, jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)

    return lambda tokens: run(bound.params, tokens)


def _batches(run, tokens: np.ndarray, lengths: np.ndarray, rows: Sequence[int], batch_size: int):
    """Run the target (``run = _forward_fn(target)``, made once per set so its compiled
    graphs are reused) over the sequences ``rows`` of ``tokens``; yields (rows of the
    batch, hidden, features, argmax) as host arrays, batch rows first.

    Rows are sorted by length and each batch runs at its longest length rounded up to a
    multiple of 64 (one compiled graph per such width), not at the padded width of the
    whole set: a short sequence costs what its own length costs. Causal attention makes
    a position's outputs independent of the padding after it. Features and hidden states
    must fit float16 at every real position: a value that would become inf raises.
    """
    f16_max = float(np.finfo(np.float16).max)
    order = sorted(rows, key=lambda i: int(lengths[i]))
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        width = min(tokens.shape[1], -(-int(lengths[idx].max()) // 64) * 64)
        chunk = np.zeros((batch_size, width), np.int32)
        chunk[: len(idx)] = tokens[idx, :width]
        h, f, a = (np.asarray(x)[: len(idx)] for x in run(jnp.asarray(chunk)))
        real = np.arange(width)[None, :] < lengths[idx][:, None]
        for name, x in (("features", f), ("target_hidden", h)):
            v = x[real]
            if not np.isfinite(v).all() or np.abs(v).max() >= f16_max:
                raise InputError(f"target {name} of sequences {sorted(idx)} do not fit float16")
        yield idx, h, f, a


def _layout(target: LlamaModel, convs: Sequence[Conversation], max_len: int | None):
    if target.config.feature_layer_ids is None:
        raise InputError("the target has no feature layers configured")
    seqs = [c.prompt_ids + c.response_ids for c in convs]
    if max_len is None:
        max_len = max(len(s) for s in seqs)
    seqs = [s[:max_len] for s in seqs]
    plens = np.array([len(c.prompt_ids) for c in convs], np.int32)
    lengths = np.array([len(s) for s in seqs], np.int32)
    if (plens >= lengths).any():
        i = int(np.argmax(plens >= lengths))
        raise InputError(f"conversation {i}: prompt of {plens[i]} tokens leaves no response within max_len={max_len}")
    tokens = np.zeros((len(convs), max_len), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    return tokens, lengths, plens


def extract_features(
    target: LlamaModel,
    convs: Sequence[Conversation],
    *,
    max_len: int,
    batch_size: int = 8,
    on_progress=None,
) -> FeatureSet:
    """Run the target over every (prompt + response) sequence, truncated to ``max_len``;
    the set is built in memory (``write_features`` streams a large one to disk).

    Features and hidden states are stored as float16; a value outside float16's range
    raises instead of silently becoming inf.
    """
    tokens, lengths, plens = _layout(target, convs, max_len)
    n = len(convs)
    h_dim = target.config.hidden_size
    f_dim = len(target.config.feature_layer_ids) * h_dim
    feats = np.zeros((n, max_len, f_dim), np.float16)
    hid = np.zeros((n, max_len, h_dim), np.float16)
    amax = np.zeros((n, max_len), np.int32)
    t0 = time.perf_counter()
    done = 0
    for idx, h, f, a in _batches(_forward_fn(target), tokens, lengths, range(n), batch_size):
        w = h.shape[1]
        feats[idx, :w], hid[idx, :w], amax[idx, :w] = f, h, a
        done += len(idx)
        if on_progress is not None:
            on_progress(done, n, time.perf_counter() - t0)
    return FeatureSet(tokens, lengths, plens, feats, hid, amax)


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path`` (a manifest or progress record); errors name the file."""
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise InputError(f"{path}: not {what}")
    return obj


def _read_progress(path: Path) -> dict:
    return read_json_object(path, "a progress record")


def _write_json_atomic(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def conversations_sha256(convs: Sequence[Conversation]) -> str:
    """Digest of the token sequences (in order): what a feature set was computed from."""
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.prompt_ids, c.response_ids]).encode())
        h.update(b"\n")
    return h.hexdigest()


def write_features(
    target: LlamaModel,
    convs: Sequence[Conversation],
    path: str | Path,
    *,
    batch_size: int = 8,
    shard_size: int = 256,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> FeatureSet:
    """``extract_features`` for a set of any size: streamed to ``path``, resumable.

    The arrays are ``.npy`` files created at their full size ([N, L, ...], L the longest
    sequence) and memory-mapped; sequences are computed ``shard_size`` rows at a time and
    written in place, so memory holds one batch, not the set. Only a row's real positions
    are written: the padding after them is never touched, so on file systems with sparse
    files (ext4, xfs, ...) the disk used follows the real tokens, not N * L.

    After each shard the maps are flushed and ``progress.json`` records the shards done
    and what they were computed from (the conversations' digest, the sizes). Called
    again on the same input, it continues at the first unfinished shard; on other input
    it starts over. ``FeatureSet.load`` refuses the set until the last shard is done.
    ``on_progress(rows_done, rows, response_tokens_done)`` follows each shard.
    Returns the finished set, memory-mapped.
    """
    path = Path(path)
    tokens, lengths, plens = _layout(target, convs, None)
    n, width = tokens.shape
    h_dim = target.config.hidden_size
    f_dim = len(target.config.feature_layer_ids) * h_dim
    shapes = {
        "tokens": ((n, width), np.int32), "lengths": ((n,), np.int32), "prompt_lengths": ((n,), np.int32),
        "features": ((n, width, f_dim), np.float16), "target_hidden": ((n, width, h_dim), np.float16),
        "target_argmax": ((n, width), np.int32),
    }
    n_shards = -(-n // shard_size)
    spec = {
        "rows": n, "width": width, "feature_width": f_dim, "hidden_size": h_dim, "shard_size": shard_size,
        "conversations_sha256": conversations_sha256(convs),
    }
    progress = path / PROGRESS_FILE
    path.mkdir(parents=True, exist_ok=True)
    state = _read_progress(progress) if progress.is_file() else None
    arrays: dict[str, np.memmap] = {}
    if state is not None and state.get("spec") == spec:
        for name, (shape, dtype) in shapes.items():
            f = path / f"{name}.npy"
            if not f.is_file():
                break
            a = np.lib.format.open_memmap(f, mode="r+")
            if a.shape != shape or a.dtype != dtype:
                break
            arrays[name] = a
    if len(arrays) == len(shapes):
        start = int(state["shards_done"])
        if start < n_shards:
            log.info("%s: resuming features at shard %d of %d", path, start + 1, n_shards)
    else:
        if state is not None:
            log.warning("%s: features were made from other conversations or sizes; starting them over", path)
        # No progress record while the files are being recreated: a kill here leaves a
        # directory that is started over, never one that looks partly done.
        progress.unlink(missing_ok=True)
        arrays = {
            name: np.lib.format.open_memmap(path / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
            for name, (shape, dtype) in shapes.items()
        }
        arrays["tokens"][:] = tokens
        arrays["lengths"][:] = lengths
        arrays["prompt_lengths"][:] = plens
        for a in arrays.values():
            a.flush()
        start = 0
        _write_json_atomic(progress, {"spec": spec, "shards": n_shards, "shards_done": 0, "complete": n_shards == 0})
    resp = lengths - plens
    run = _forward_fn(target)
    for k in range(start, n_shards):
        rows = range(k * shard_size, min(n, (k + 1) * shard_size))
        for idx, h, f, a in _batches(run, tokens, lengths, rows, batch_size):
            for j, i in enumerate(idx):
                m = int(lengths[i])
                arrays["features"][i, :m] = f[j, :m]
                arrays["target_hidden"][i, :m] = h[j, :m]
                arrays["target_argmax"][i, :m] = a[j, :m]
        for name in ("features", "target_hidden", "target_argmax"):
            arrays[name].flush()
        _write_json_atomic(progress, {"spec": spec, "shards": n_shards, "shards_done": k + 1, "complete": k + 1 == n_shards})
        if on_progress is not None:
            on_progress(rows.stop, n, int(resp[: rows.stop].sum()))
    del arrays  # unmap before reading back
    return FeatureSet.load(path)


# ----------------------------------------------------------------------------- answer shards

ANSWERS_FORMAT = "eagle-jax draft answers"
ANSWERS_VERSION = 1
ANSWERS_MANIFEST = "manifest.json"
# Enough answers per shard that a directory of 1.5 M tokens holds about 60 files, few
# enough that a kill loses minutes of a 2-core CPU's work (the shard in progress).
DEFAULT_SHARD_TOKENS = 25_000
_FINISH_CODES = ("stop", "length")
_SHARD_ARRAYS = ("index", "length", "tokens", "finish", "sampled", "prompt_crc")


def prompt_crc(prompt_ids: Sequence[int]) -> int:
    """crc32 of a prompt's token ids: a stored answer carries it, so an answer is never
    paired with a prompt that now tokenizes differently (another tokenizer or template)."""
    import zlib

    return zlib.crc32(np.asarray(prompt_ids, np.int32).tobytes())


@dataclasses.dataclass(frozen=True)
class StoredAnswer:
    """One answer in an ``AnswerStore``: the prompt is the record at ``index`` (0-based,
    blank lines not counted) of the store's prompt file."""

    index: int
    response_ids: list[int]
    finish_reason: str
    sampled: bool
    prompt_crc: int


def _write_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An ``.npz`` (``np.load`` reads it) with deflate level 9 and fixed timestamps, so
    equal arrays give equal bytes; written to a hidden temporary file, synced, then
    renamed over ``path``, so a kill leaves either no shard or a whole one."""
    import zipfile

    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
            for name, arr in arrays.items():
                info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                with zf.open(info, "w", force_zip64=True) as g:
                    np.lib.format.write_array(g, np.ascontiguousarray(arr), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class AnswerStore:
    """The target's answers to one prompt file, as compressed shards in a directory meant
    to be committed (``data/draft-answers/<model>/<prompt file>/``), so answers made in
    one session are kept by git and a later session, on another machine, continues.

    ``manifest.json`` names what the answers depend on (``identity``: the model's sha256,
    the prompt file's sha256, the generation settings) and lists every shard with its
    counts and sha256. A shard ``shard-NNNNN.npz`` holds, per answer, the prompt's record
    index in the prompt file (prompts are not stored: they are in the prompt file), the
    response token ids (uint16 when the vocabulary allows, concatenated), whether it
    stopped at an end token or the length cap, whether it was sampled, and the crc32 of
    the prompt's token ids (``prompt_crc``). No text, no features.

    Opening a store checks it whole: another identity is refused field by field, and a
    listed shard that is missing, or whose sha256 or contents do not match the manifest,
    is refused by name. Answers are buffered and written ``shard_tokens`` response
    tokens at a time (``add``/``flush``): the shard to a temporary file then renamed,
    then the manifest likewise, so a kill loses at most the shard in progress; a shard
    file the manifest does not list (a kill between the two renames) is ignored and
    overwritten. One process at a time: the directory is locked while open.
    """

    def __init__(self, path: str | Path, identity: dict | None, *, vocab_size: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, describe: dict | None = None, read_only: bool = False):
        import fcntl

        self.path = Path(path)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.read_only = read_only
        self.token_dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        self._lock = None
        if read_only:
            # Checked as it stands (e.g. the committed stores, by a test): the identity
            # is the manifest's own, and nothing is locked or written.
            if identity is None:
                m = read_json_object(self.manifest_path, "an answer-store manifest") if self.manifest_path.is_file() else None
                if m is None:
                    raise InputError(f"{self.path} has no {ANSWERS_MANIFEST}: not an answer store")
                identity = {k: m.get(k) for k in ("model_sha256", "prompt_file_sha256", "settings")}
        else:
            if identity is None:
                raise ValueError("a store opened for writing needs the identity of the answers it takes")
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self.path, os.O_RDONLY)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._unlock()
                raise InputError(f"{self.path} is being written by another process (draft-data running?)") from None
        self.identity = dict(identity)
        try:
            self.manifest = self._read_manifest(describe or {})
            self.answers: dict[int, StoredAnswer] = {}
            for entry in self.manifest["shards"]:
                self._load_shard(entry)
            if not read_only:
                for tmp in self.path.glob(".shard-*.tmp"):
                    tmp.unlink()  # a shard a kill cut off while it was written
        except BaseException:
            self._unlock()
            raise
        self._pending: list[StoredAnswer] = []
        self._pending_tokens = 0
        self._batch_size: int | None = None

    @property
    def manifest_path(self) -> Path:
        return self.path / ANSWERS_MANIFEST

    def _read_manifest(self, describe: dict) -> dict:
        if not self.manifest_path.is_file():
            if self.path.is_dir() and any(p.name.startswith("shard-") for p in self.path.iterdir()):
                raise InputError(f"{self.path} holds shards but no {ANSWERS_MANIFEST}: not a complete answer store")
            return {"format": ANSWERS_FORMAT, "version": ANSWERS_VERSION, **describe, **self.identity,
                    "answers": 0, "response_tokens": 0, "shards": []}
        m = read_json_object(self.manifest_path, "an answer-store manifest")
        if m.get("format") != ANSWERS_FORMAT or m.get("version") != ANSWERS_VERSION:
            raise InputError(f"{self.manifest_path}: not an answer store of version {ANSWERS_VERSION} "
                             f"(format {m.get('format')!r}, version {m.get('version')!r})")
        diffs = [f"{k}: {m.get(k)!r} there, {v!r} now" for k, v in self.identity.items() if m.get(k) != v]
        if diffs:
            raise InputError(
                f"{self.path} holds answers made with another model, prompt file or settings, so it cannot be added to ("
                + "; ".join(diffs) + "). Use the model, prompt file and settings its manifest names, or another --answers directory."
            )
        if not isinstance(m.get("shards"), list):
            raise InputError(f"{self.manifest_path}: 'shards' is not a list")
        return m

    def _load_shard(self, entry: dict) -> None:
        try:
            name, want_sha, n, ntok = entry["file"], entry["sha256"], int(entry["answers"]), int(entry["tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{self.manifest_path}: bad shard entry {entry!r}") from e
        f = self.path / name
        if Path(name).name != name or not f.is_file():
            raise InputError(f"{f}: shard listed in {self.manifest_path} is missing (restore it from git, e.g. `git checkout -- {f}`)")
        got = file_sha256(f)
        if got != want_sha:
            raise InputError(
                f"{f}: sha256 {got} does not match {want_sha} in {self.manifest_path}; refusing the changed or damaged "
                f"shard (restore it from git, e.g. `git checkout -- {f}`)"
            )
        try:
            with np.load(f, allow_pickle=False) as z:
                arrs = {k: z[k] for k in _SHARD_ARRAYS}
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"{f}: not an answer shard ({e})") from e
        lens = arrs["length"].astype(np.int64)
        ok = (
            all(arrs[k].shape == (n,) for k in ("index", "length", "finish", "sampled", "prompt_crc"))
            and arrs["tokens"].shape == (ntok,) and int(lens.sum()) == ntok and (lens > 0).all()
            and (arrs["finish"] < len(_FINISH_CODES)).all()
            and (arrs["tokens"].astype(np.int64) < self.vocab_size).all()
        )
        if not ok:
            raise InputError(f"{f}: contents do not match its manifest entry ({n} answers, {ntok} tokens) or are out of range")
        ends = np.cumsum(lens)
        toks = arrs["tokens"].astype(np.int64)
        for j in range(n):
            i = int(arrs["index"][j])
            if i in self.answers:
                raise InputError(f"{f}: answers prompt record {i} again (an earlier shard has it)")
            self.answers[i] = StoredAnswer(
                i, toks[ends[j] - lens[j]: ends[j]].tolist(), _FINISH_CODES[int(arrs["finish"][j])],
                bool(arrs["sampled"][j]), int(arrs["prompt_crc"][j]),
            )

    def add(self, index: int, conv: Conversation, *, batch_size: int | None = None) -> None:
        """Buffer the answer to prompt record ``index``; a full buffer is written as a shard."""
        if self.read_only:
            raise EagleJaxError(f"{self.path} was opened read-only")
        if index in self.answers or any(a.index == index for a in self._pending):
            raise EagleJaxError(f"{self.path}: prompt record {index} is answered already")
        if conv.finish_reason not in _FINISH_CODES:
            raise EagleJaxError(f"{self.path}: answer to record {index} ended with {conv.finish_reason!r}")
        self._pending.append(StoredAnswer(index, list(conv.response_ids), conv.finish_reason, conv.temperature > 0,
                                          prompt_crc(conv.prompt_ids)))
        self._pending_tokens += len(conv.response_ids)
        self._batch_size = batch_size
        if self._pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the buffered answers as the next shard, then the manifest."""
        if not self._pending:
            return
        pend = self._pending
        name = f"shard-{len(self.manifest['shards']):05d}.npz"
        arrays = {
            "index": np.array([a.index for a in pend], np.uint32),
            "length": np.array([len(a.response_ids) for a in pend], np.uint16 if self.identity.get("max_new_tokens", 0) < 1 << 16 else np.uint32),
            "tokens": np.array([t for a in pend for t in a.response_ids], self.token_dtype),
            "finish": np.array([_FINISH_CODES.index(a.finish_reason) for a in pend], np.uint8),
            "sampled": np.array([a.sampled for a in pend], np.uint8),
            "prompt_crc": np.array([a.prompt_crc for a in pend], np.uint32),
        }
        _write_npz_atomic(self.path / name, arrays)
        entry = {"file": name, "answers": len(pend), "tokens": int(arrays["tokens"].size),
                 "bytes": (self.path / name).stat().st_size, "sha256": file_sha256(self.path / name)}
        if self._batch_size is not None:
            entry["batch_size"] = self._batch_size
        self.manifest["shards"].append(entry)
        self.manifest["answers"] = int(self.manifest.get("answers", 0)) + len(pend)
        self.manifest["response_tokens"] = int(self.manifest.get("response_tokens", 0)) + entry["tokens"]
        _write_json_atomic(self.manifest_path, self.manifest)
        _fsync_dir(self.path)
        for a in pend:
            self.answers[a.index] = a
        self._pending, self._pending_tokens = [], 0

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor drops the lock
            self._lock = None

    def close(self) -> None:
        """Write what is buffered and unlock."""
        try:
            self.flush()
        finally:
            self._unlock()

    def __enter__(self) -> "AnswerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
