"""Model definitions and their weights: the Llama-family decoder, the loaders (GGUF, safetensors,
random) and where the default model comes from. Written against the kernel interface, never a backend."""
