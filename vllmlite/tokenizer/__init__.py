"""Tokenizers: the `Tokenizer` interface (base.py) and its implementations, HF `tokenizers` loaded from
an HF directory or built from GGUF metadata (hf.py, gguf_vocab.py) and raw bytes (byte.py).

This module only re-exports their public names: `from vllmlite.tokenizer import HFTokenizer`.
Chat templates are in chat_template.py, incremental detokenization in detokenizer.py.
"""

from vllmlite.tokenizer.base import BatchEncoding, Tokenizer, format_token_bytes
from vllmlite.tokenizer.byte import BYTE_SPECIAL_TOKENS, ByteTokenizer
from vllmlite.tokenizer.gguf_pre_tokenizers import GGUF_PRE_TOKENIZERS, UNSUPPORTED_PRE_TOKENIZERS
from vllmlite.tokenizer.gguf_vocab import (
    SUPPORTED_TOKENIZER_MODELS,
    GGUFVocabulary,
    TokenType,
    bytes_to_unicode,
    gguf_vocabulary,
    read_gguf_fields,
    unicode_to_bytes,
)
from vllmlite.tokenizer.hf import END_OF_TURN_TOKENS, HFTokenizer

__all__ = [
    "BYTE_SPECIAL_TOKENS", "END_OF_TURN_TOKENS", "GGUF_PRE_TOKENIZERS", "SUPPORTED_TOKENIZER_MODELS",
    "UNSUPPORTED_PRE_TOKENIZERS", "BatchEncoding", "ByteTokenizer", "GGUFVocabulary", "HFTokenizer", "TokenType",
    "Tokenizer", "bytes_to_unicode", "format_token_bytes", "gguf_vocabulary", "read_gguf_fields", "unicode_to_bytes",
]
