"""One module per model family: its config.json and GGUF metadata mapped to ModelConfig, and its
tensor names (HF and GGUF) mapped onto the shared weight layout (families/common.py).

A family module provides `hf_config(raw, name) -> ModelConfig`, `gguf_config(fields, name,
tensors) -> ModelConfig`, `HF_NAMES` and `GGUF_NAMES` (LayerNames), `GGUF_PERMUTES_QK` (whether
llama.cpp's converter permuted Q and K rows) and `finish(config, weights) -> ModelWeights` (exact
load-time folds, or the weights as they are).
"""
