"""Small helpers where vLLM's users import them from (`vllm.utils.argparse_utils`); base modules."""
