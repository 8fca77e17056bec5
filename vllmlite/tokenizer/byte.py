"""ByteTokenizer: raw UTF-8 bytes plus BOS and EOS, the vocabulary of the seeded random test model.

Knows nothing of HF or GGUF vocabularies.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from vllmlite.tokenizer.base import Tokenizer, format_token_bytes

BYTE_SPECIAL_TOKENS = MappingProxyType({256: "<|bos|>", 257: "<|eos|>"})  # ByteTokenizer's id -> name


class ByteTokenizer(Tokenizer):
    """Raw UTF-8 bytes for the seeded random test model: ids 0..255 are bytes, 256 BOS, 257 EOS.

    Encoding never produces special ids from text (text is only bytes). Decoding joins bytes and
    special names, then decodes UTF-8 with errors="replace". A byte's vocabulary piece is the
    character with that code point, as in HF's ByT5 tokenizer: 0xE2 -> "â".
    """

    def __init__(self) -> None:
        self.vocab_size = 258
        self.bos_token_id = 256
        self.eos_token_id = 257
        self.pad_token_id = None
        self.stop_token_ids = frozenset({257})
        self.special_token_ids = frozenset(BYTE_SPECIAL_TOKENS)
        self.chat_template = None  # render_chat_template falls back to ChatML

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        prefix = [self.bos_token_id] if add_special_tokens else []
        return prefix + list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return b"".join(self._token_bytes(i, skip_special_tokens) for i in token_ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return format_token_bytes(self._token_bytes(token_id, skip_special=False))

    def id_to_token(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return chr(token_id)
        return self._token_bytes(token_id, skip_special=False).decode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        if len(token) == 1 and ord(token) < 256:
            return ord(token)
        return next((i for i, name in BYTE_SPECIAL_TOKENS.items() if name == token), None)

    def _token_bytes(self, token_id: int, skip_special: bool) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        if token_id in BYTE_SPECIAL_TOKENS:
            return b"" if skip_special else BYTE_SPECIAL_TOKENS[token_id].encode("utf-8")
        raise ValueError(f"token id {token_id} is outside the byte vocabulary (size {self.vocab_size})")
