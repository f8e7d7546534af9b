"""Plumbing shared by the kernels: picking an implementation and launching Mosaic GPU.

Backend choice (checked on jax 0.12.0.1): ``pl.pallas_call`` without compiler params
lowers for CUDA through the *Triton* backend (which warns that it is deprecated and,
on a machine without a GPU, cannot even lower unless an abstract GPU device is set),
and passing ``plgpu.CompilerParams`` to ``pl.pallas_call`` fails (no lowering rule is
registered for it). The maintained Mosaic GPU backend is reached through
``plgpu.kernel`` (a ``mpmd_map`` under the hood), which lowers to the
``mosaic_gpu_v2`` custom call and runs Mosaic GPU's layout inference and dialect
lowering at lowering time, so a CPU-only machine catches most kernel errors. All
kernels here therefore use ``plgpu.kernel``; on CPU they run under Mosaic GPU's own
interpreter (``plgpu.InterpretGPUParams``), which simulates SMEM, TMA, barriers and
WGMMA (the generic ``interpret=True`` interpreter cannot bind ``plgpu.kernel``'s grid
axis names). The kernels set no lowering semantics, and are written (explicit layouts
on iotas and row loads) to lower under both Lane and Warpgroup semantics: jax 0.12
defaults to Warpgroup, the GPU machine's 0.11.2 may not.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Literal, Sequence

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

Impl = Literal["auto", "kernel", "reference"]

# Mosaic GPU maps a 1-D array onto the 128 threads of a warpgroup; shorter vectors fail
# layout inference, so per-row vectors held in registers are padded to this multiple.
LANES = 128


def lane_iota(lanes: int):
    """``arange(lanes)`` inside a Mosaic GPU kernel, one element per thread.

    The explicit layout lets both lowering semantics (``Lane``, ``Warpgroup``; the
    default differs between jax versions) place the vector and everything derived from it.
    """
    iota = jax.lax.broadcasted_iota(jax.numpy.int32, (lanes,), 0)
    return plgpu.layout_cast(iota, plgpu.Layout.WG_STRIDED((lanes,), 1))


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x``."""
    return -(-x // m) * m


def on_gpu() -> bool:
    """True when the default JAX backend is a GPU (where kernels compile natively)."""
    return jax.default_backend() == "gpu"


def resolve_impl(impl: Impl, interpret: bool | None) -> tuple[bool, Any]:
    """Decide ``(use_kernel, interpret_arg)`` for a wrapper call.

    ``auto``: the compiled kernel on GPU, the jnp reference elsewhere (interpreting a
    kernel on CPU is far slower than XLA). ``kernel``: the kernel, interpreted unless on
    GPU (``interpret`` overrides: ``False`` forces native lowering, which is how the
    CUDA lowering tests trace on a CPU-only machine). ``reference``: the jnp reference.
    """
    if impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"impl={impl!r}; expected 'auto', 'kernel' or 'reference'")
    if impl == "reference" or (impl == "auto" and not on_gpu()):
        return False, None
    if interpret is None:
        interpret = not on_gpu()
    return True, (plgpu.InterpretGPUParams() if interpret else None)


_KERNEL_PARAMS = inspect.signature(plgpu.kernel).parameters

# Compiler params for every kernel launch; None = this jax version's defaults. The default
# lowering semantics is Warpgroup on jax 0.12 and may be Lane on others, so the kernels
# are written to lower under both; the CUDA-lowering tests set this to check each.
COMPILER_PARAMS: Any = None


def mgpu_kernel(
    body: Callable[..., None],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    *,
    grid: tuple[int, ...],
    grid_names: tuple[str, ...],
    scratch: Sequence[Any] = (),
    interpret: Any = None,
) -> Callable[..., Any]:
    """``plgpu.kernel`` across jax 0.11.2 (the GPU machine) and 0.12.

    Newer versions renamed ``out_shape``/``scratch_shapes`` to ``out_type``/
    ``scratch_types`` (keeping the old names as deprecated aliases); pass whichever
    this version's signature has.
    ``interpret`` is passed only when set, so native launches need no interpreter API.
    """
    kwargs: dict[str, Any] = dict(grid=grid, grid_names=grid_names)
    new_names = "out_type" in _KERNEL_PARAMS
    kwargs["out_type" if new_names else "out_shape"] = tuple(out_shapes)
    if scratch:
        kwargs["scratch_types" if new_names else "scratch_shapes"] = tuple(scratch)
    if interpret is not None:
        kwargs["interpret"] = interpret
    if COMPILER_PARAMS is not None:
        kwargs["compiler_params"] = COMPILER_PARAMS
    return plgpu.kernel(body, **kwargs)
