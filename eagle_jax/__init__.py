"""EAGLE-3 speculative decoding in JAX / Flax NNX / Pallas.

The serving API at the top level: ``from eagle_jax import Engine, EngineConfig,
SamplingParams`` (imported on first use, so ``import eagle_jax`` stays cheap)."""

_API = {
    "Engine": "eagle_jax.serving.engine",
    "EngineConfig": "eagle_jax.serving.config",
    "Completion": "eagle_jax.serving.requests",
    "SamplingParams": "eagle_jax.spec.sampling",
    "SpeculativeConfig": "eagle_jax.spec.config",
}

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'eagle_jax' has no attribute {name!r}")
