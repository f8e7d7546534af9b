"""Target and draft networks as Flax NNX modules: the family registry and common target
interface (target), the Llama family (llama), DeepSeek-V3 / Kimi-K2 (deepseek, with INT4
experts from quant) and the EAGLE-3 draft head (draft). Models know nothing of speculation
or requests."""
