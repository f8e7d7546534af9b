"""Load a Hugging Face model directory (config.json + safetensors) into the target
implementation its ``architectures`` names (``eagle_jax.models.target`` registry).

Weights are read with ``safetensors`` only (never pickle). Each NNX parameter has one
Hugging Face tensor name and a flag saying whether the PyTorch ``[out, in]`` layout must
be transposed to our ``[in, out]``. Every tensor is checked for presence and shape before
anything is built, so a bad checkpoint fails with the tensor's name, not halfway through.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from eagle_jax.models.config import ModelConfig, read_config_json
from eagle_jax.errors import CheckpointError
from eagle_jax.models.llama import NameMap, param_name_map  # noqa: F401  (re-exported: doctor and tests use them from here)
from eagle_jax.models.registry import family_for
from eagle_jax.models.target import TargetModel, checkpoint_shapes

log = logging.getLogger(__name__)


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype() -> jnp.dtype:
    """float32 on CPU (XLA CPU has no fast bf16 matrix-vector), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def resolve_dtype(dtype: str | jnp.dtype | None) -> jnp.dtype:
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise CheckpointError(f"dtype={dtype!r} is not supported; valid: {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def safetensors_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (single file or sharded)."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must be an object")
        files = {}
        for name, shard in weight_map.items():
            # The index is untrusted: a shard must be a plain file name inside the directory.
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise CheckpointError(f"{index}: tensor {name!r} maps to invalid shard {shard!r}")
            if not (path / shard).is_file():
                raise CheckpointError(f"{index}: shard {shard} (for {name}) not found in {path}")
            files[name] = path / shard
        return files
    if single.is_file():
        try:
            with safe_open(single, framework="flax") as f:
                return {name: single for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{single} is not a readable safetensors file: {e}") from e
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


def check_shapes(files: dict[str, Path], wanted: dict[str, tuple[int, ...]]) -> None:
    """Every wanted tensor present with its expected shape, from the file headers alone."""
    missing = sorted(n for n in wanted if n not in files)
    if missing:
        raise CheckpointError(
            f"checkpoint lacks tensor(s): {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="numpy") as f:
                for name in names:
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != wanted[name]:
                        raise CheckpointError(f"{file.name}: tensor {name} has shape {shape}, expected {wanted[name]}")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is corrupt or truncated: {e}") from e


def read_tensors(files: dict[str, Path], wanted: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Read the wanted tensors (name -> expected shape in the file), checking every shape first."""
    check_shapes(files, wanted)
    out: dict[str, np.ndarray] = {}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        try:
            # numpy, not flax: a flax read makes each tensor a device array only for
            # np.asarray to copy it back (about half a second of a SmolLM2 start-up).
            with safe_open(file, framework="numpy") as f:
                for name in names:
                    out[name] = np.asarray(f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is corrupt or truncated: {e}") from e
    return out


def packed_shape_records(wanted: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """For each compressed-tensors ``*.weight_packed`` tensor, its ``*.weight_shape`` record
    and the ``(out, in)`` it must hold (eight 4-bit values per int32 word)."""
    suffix = ".weight_packed"
    return {
        n[: -len(suffix)] + ".weight_shape": (shape[0], shape[1] * 8)
        for n, shape in wanted.items() if n.endswith(suffix)
    }


def check_packed_shapes(tensors: dict[str, np.ndarray], records: dict[str, tuple[int, int]]) -> None:
    """A packed weight whose recorded original shape differs from the model's is a wrong
    checkpoint (a different width, or packing this reader does not expect): refused."""
    for name, expected in records.items():
        got = tuple(int(v) for v in np.asarray(tensors.pop(name)).reshape(-1))
        if got != expected:
            raise CheckpointError(f"tensor {name} records shape {got}; the model expects {expected}")


class SliceReader:
    """Reads one parameter's shard straight from the safetensors files: the block of the
    parameter ``index`` names (slices in our layout), transposed from PyTorch's
    ``[out, in]`` where the name map says so, experts stacked from their own tensors.
    safetensors reads a slice from the memory-mapped file without reading the rest."""

    def __init__(self, handles: dict, files: dict[str, Path], name, transpose: bool, dtype):
        self.handles, self.files, self.transpose, self.dtype = handles, files, transpose, np.dtype(dtype)
        self.names = name if isinstance(name, tuple) else (name,)
        self.stacked = isinstance(name, tuple)

    def _one(self, name: str, index: tuple) -> np.ndarray:
        f = self.handles[self.files[name]]
        idx = tuple(reversed(index)) if self.transpose else index
        try:
            arr = f.get_slice(name)[idx] if idx else f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.files[name]}: tensor {name} could not be read: {e}") from e
        arr = np.asarray(arr)
        if np.issubdtype(self.dtype, np.integer) and arr.dtype != self.dtype:
            # Packed integer weights are bits, not values: a cast would corrupt them.
            raise CheckpointError(f"tensor {name} has dtype {arr.dtype}; expected {self.dtype.name}")
        return arr.T if self.transpose else arr

    def __call__(self, index: tuple) -> np.ndarray:
        index = tuple(index)
        if self.stacked:
            experts = range(len(self.names))[index[0]] if index else range(len(self.names))
            arr = np.stack([self._one(self.names[e], index[1:]) for e in experts])
        else:
            arr = self._one(self.names[0], index)
        return np.ascontiguousarray(arr, dtype=self.dtype)


def load_model(
    path: str | Path, *, dtype: str | jnp.dtype | None = None, config: ModelConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> TargetModel:
    """Load a target model from a Hugging Face directory.

    The implementation comes from config.json's ``architectures`` through the target
    registry; an unknown architecture or an unsupported field is a ``ConfigError`` that
    names config.json and the field.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      dtype: parameter dtype; default float32 on CPU, bfloat16 on GPU.
      config: override the config read from the directory (e.g. other feature layers).
      mesh: a mesh of more than one device loads every parameter straight into the
        sharding the target's rules give it on that mesh (``sharding.model_axis_rules``):
        each device's block is read from the files on its own (``SliceReader``), so the
        host never holds more than one block of one tensor, where the plain load holds
        the whole checkpoint. A mesh the model cannot use is a ``ConfigError`` here.
    """
    path = Path(path)
    raw = read_config_json(path, "checkpoint")
    family = family_for(raw, str(path / "config.json"))
    cfg = config or family.config_from_hf(raw)
    dtype = resolve_dtype(dtype)
    abstract = nnx.eval_shape(lambda: family.module(cfg, dtype=dtype))
    graphdef, state = nnx.split(abstract)
    names = family.param_names(cfg)
    flat = dict(nnx.to_flat_state(state))
    unmapped = [p for p in flat if p not in names]
    if unmapped:  # a programming error, not a user one: the map must cover the model
        raise RuntimeError(f"no checkpoint name for model parameter(s) {unmapped}")
    wanted = checkpoint_shapes(names, {p: flat[p].shape for p in names})
    shape_records = packed_shape_records(wanted)
    files = safetensors_files(path)
    if mesh is not None and mesh.size > 1:
        model = _load_sliced(abstract, graphdef, flat, names, wanted, shape_records, files, mesh)
        log.info("loaded %s (%s, %d layers, dtype %s) sliced onto mesh %s", path, cfg.architecture,
                 cfg.num_hidden_layers, jnp.dtype(dtype).name, dict(mesh.shape))
        return model
    tensors = read_tensors(files, {**wanted, **{n: (2,) for n in shape_records}})
    check_packed_shapes(tensors, shape_records)
    for p, (name, transpose) in names.items():
        parts = [tensors[n].T if transpose else tensors[n] for n in (name if isinstance(name, tuple) else (name,))]
        arr = np.stack(parts) if isinstance(name, tuple) else parts[0]
        if jnp.issubdtype(flat[p].dtype, jnp.integer) and arr.dtype != flat[p].dtype:
            # Packed integer weights are bits, not values: a cast would corrupt them.
            first = name[0] if isinstance(name, tuple) else name
            raise CheckpointError(f"tensor {first} has dtype {arr.dtype}; expected {jnp.dtype(flat[p].dtype).name}")
        # Each parameter keeps the dtype its module gave it: the compute dtype, or float32
        # where the module asks for it (a MoE router), or an integer type (packed weights).
        flat[p].set_value(jnp.asarray(np.ascontiguousarray(arr), dtype=flat[p].dtype))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    log.info("loaded %s (%s, %d layers, dtype %s)", path, cfg.architecture, cfg.num_hidden_layers, jnp.dtype(dtype).name)
    return model


def _load_sliced(abstract, graphdef, flat, names, wanted, shape_records, files, mesh) -> TargetModel:
    """``load_model`` onto a mesh: headers checked first, then every parameter built by
    ``jax.make_array_from_callback`` from the blocks its sharding asks for."""
    import contextlib

    from jax.sharding import NamedSharding

    from eagle_jax.runtime.sharding import model_axis_rules
    from eagle_jax.models.target import partition_spec

    rules = model_axis_rules(abstract.axis_sizes(), mesh, what="target")
    check_shapes(files, wanted)
    check_packed_shapes(read_tensors(files, {n: (2,) for n in shape_records}), shape_records)
    with contextlib.ExitStack() as stack:
        handles = {}
        for file in sorted(set(files.values())):
            try:
                handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file} is corrupt or truncated: {e}") from e
        for p, (name, transpose) in names.items():
            v = flat[p]
            axes = v.get_metadata().get("logical_axes")
            sharding = NamedSharding(mesh, partition_spec(tuple(axes), rules))
            reader = SliceReader(handles, files, name, transpose, v.dtype)
            v.set_value(jax.make_array_from_callback(tuple(v.shape), sharding, reader))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
