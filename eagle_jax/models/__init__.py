"""Target and draft networks as Flax NNX modules: the target interface and the table
families register into (target), the built-in families by checkpoint name (registry),
the Llama family (llama), DeepSeek-V3 / Kimi-K2 (deepseek, with INT4 experts from quant)
and the EAGLE-3 draft head (draft). Models know nothing of speculation or requests; they
import only ``kernels`` and the base modules."""
