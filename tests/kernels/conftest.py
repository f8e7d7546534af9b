"""Fixtures for the kernel tests: lowering for CUDA under each Mosaic GPU semantics."""

import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common


@pytest.fixture(params=["default", "Lane", "Warpgroup"])
def mgpu_semantics(request, monkeypatch):
    """Lower under this jax's default semantics, then under each one explicitly.

    jax 0.12 defaults to Warpgroup; other versions (the lent GPU machine runs 0.11.2)
    may not, so the kernels must lower under both.
    """
    if request.param != "default":
        semantics = getattr(plgpu.LoweringSemantics, request.param)
        monkeypatch.setattr(_common, "COMPILER_PARAMS", plgpu.CompilerParams(lowering_semantics=semantics))
    return request.param
