#!/usr/bin/env python
"""SmolLM2's body weight products alone: the packed CPU kernel against XLA's dot.

The 210 matrices of SmolLM2-135M's 30 layers (random float32 weights of their shapes),
multiplied by 1, 4 and 8 rows in one jitted graph each, the two implementations timed in
alternation (medians of 7). Which build runs follows ``EAGLE_JAX_CPU_MARCH`` (``native``
by default; ``haswell`` times the AVX2 path, ``x86-64`` the generic one on this CPU).

    EAGLE_JAX_CPU_MARCH=haswell python scripts/bench_cpu_matmul.py [--rows 1 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.kernels import cpu_matmul

# q, k, v, o, gate, up, down of one SmolLM2-135M layer, [in, out]
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    use, line = cpu_matmul.status("cpu")
    if not use:
        raise SystemExit(f"the packed kernel is not available: {line}")
    print(f"-march={cpu_matmul.march()}: {line}")
    rng = np.random.default_rng(0)
    dense = [[rng.standard_normal(s, dtype=np.float32) for s in SHAPES] for _ in range(LAYERS)]
    packed = [[cpu_matmul.pack(w) for w in layer] for layer in dense]
    dense = [[jnp.asarray(w) for w in layer] for layer in dense]
    nbytes = 4 * LAYERS * sum(a * b for a, b in SHAPES)

    def body(ws, x, mm):
        acc = jnp.float32(0)
        for layer in ws:
            for w in layer:
                k = w.shape[1] if w.ndim == 3 else w.shape[0]  # packed [P, K, nb] or [K, N]
                xin = x if k == x.shape[1] else jnp.tile(x, (1, -(-k // x.shape[1])))[:, :k]  # down_proj's 1536 inputs
                acc = acc + mm(xin, w).sum()
        return acc

    fp = jax.jit(lambda ws, x: body(ws, x, cpu_matmul.packed_matmul))
    fx = jax.jit(lambda ws, x: body(ws, x, jnp.dot))
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, 576), dtype=np.float32))
        fp(packed, x).block_until_ready()
        fx(dense, x).block_until_ready()
        runs = {"packed": [], "xla": []}
        for _ in range(args.repeats):
            for name, f, ws in (("packed", fp, packed), ("xla", fx, dense)):
                t0 = time.perf_counter()
                f(ws, x).block_until_ready()
                runs[name].append(time.perf_counter() - t0)
        p, q = statistics.median(runs["packed"]), statistics.median(runs["xla"])
        print(f"rows {m}: packed {p * 1e3:.1f} ms ({nbytes / p / 1e9:.1f} GB/s), XLA {q * 1e3:.1f} ms "
              f"({nbytes / q / 1e9:.1f} GB/s), packed/XLA {p / q:.2f}")


if __name__ == "__main__":
    main()
