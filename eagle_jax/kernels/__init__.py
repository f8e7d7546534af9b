"""Compute kernels below the models: the packed CPU matmul and prefix attention (C++
sources compiled on first use) and their sharded wrappers. Pallas GPU kernels live in the
separate top-level package ``pallas_kernels``."""
