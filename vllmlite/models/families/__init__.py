"""One module per model family: its config.json and GGUF metadata mapped to ModelConfig, and its
tensor names (HF and GGUF) mapped onto the shared weight layout (families/common.py).

A family module provides `hf_config(raw, name) -> ModelConfig`, `gguf_config(fields, name,
tensors) -> ModelConfig`, `HF_NAMES` and `GGUF_NAMES` (LayerNames), `GGUF_PERMUTES_QK` (whether
llama.cpp's converter permuted Q and K rows) and `finish(config, weights) -> (ModelConfig,
ModelWeights)` (load-time folds of constant multipliers into weights, or both as they are).
Optionally `HF_NORM_OFFSET`: added to every "*norm.weight" of a safetensors checkpoint (Gemma's RMSNorm
scales by 1 + weight; llama.cpp's converter has already added it in the GGUF).
"""
