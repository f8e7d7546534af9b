"""Compute kernels below the models: the packed CPU matmul and prefix attention (C++
sources compiled on first use, bound through XLA FFI) and the sharded wrappers of the
Pallas kernels. Imports only ``eagle_jax.errors`` and ``pallas_kernels`` (the Pallas GPU
kernels, a separate top-level package)."""
