"""Reading and converting model checkpoints (GGUF import; Hugging Face loading in ``hf``)."""

from eagle_jax.checkpoint.gguf_import import import_gguf

__all__ = ["import_gguf"]
