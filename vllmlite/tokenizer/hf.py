"""HFTokenizer: a Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` interface, loaded from an
HF directory (tokenizer.json and its configs) or built from GGUF metadata (gguf_vocab.py).

Owns special and stop tokens, special-token text read as plain text where asked, and token bytes
for logprob display. Knows nothing of models, requests or incremental detokenization.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders

from vllmlite.tokenizer.base import Tokenizer, format_token_bytes
from vllmlite.tokenizer.gguf_vocab import SPIECE_SPACE, gguf_vocabulary, set_bos_eos, unicode_to_bytes

# Token names llama.cpp treats as end of generation (its EOG detection). Any of these that is a
# special token of the vocabulary stops generation, besides EOS: chat turns often end with one.
END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<turn|>", "<eos>",
    "[EOT]", "[EOS]", "<|flush|>", "<|calls|>", "<｜end▁of▁sentence｜>",
)
_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus the config HF keeps beside it (special tokens, template)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_stop_token_ids: Sequence[int] = (),
        pad_token: str | None = None,
    ):
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        self.pad_token_id = None if pad_token is None else backend.token_to_id(pad_token)
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._added_token_ids = frozenset(added)
        end_of_turn = {backend.token_to_id(name) for name in END_OF_TURN_TOKENS}
        stops = (end_of_turn & self.special_token_ids) | set(extra_stop_token_ids)
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        self.stop_token_ids = frozenset(stops)
        self._is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # The backend refuses a str it cannot turn into UTF-8 with "TextInputSequence must be
            # str"; name the real problem (the character and its position) instead.
            if isinstance(text, str):
                text.encode("utf-8")
            raise

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def encode_with_plain_spans(self, text: str, plain_spans: Sequence[tuple[int, int]],
                                add_special_tokens: bool = False) -> list[int]:
        # As the backend itself does, cut the text at special-token text, but only where none of it
        # lies in a span; encode each piece between with special tokens read as text. With nothing
        # special in the spans the pieces are the backend's own, so the ids are encode()'s.
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if any(lo < match.end() and match.start() < hi for lo, hi in plain_spans):
                continue
            ids += self._plain_backend.encode(text[start:match.start()], add_special_tokens=False).ids
            ids.append(self.backend.token_to_id(match.group()))
            start = match.end()
        ids += self._plain_backend.encode(text[start:], add_special_tokens=False).ids
        if not add_special_tokens:
            return ids
        before, after = self._added_around
        return before + ids + after

    def find_special_text(self, text: str) -> str | None:
        match = self._special_pattern.search(text)
        return None if match is None else match.group()

    @functools.cached_property
    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids `encode(..., add_special_tokens=True)` puts before and after the text's own."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        start = full.index(plain[0])
        return full[:start], full[start + len(plain):]

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern:
        """Any special token's text, longest first where one is a prefix of another."""
        names = sorted((self.backend.id_to_token(i) for i in self.special_token_ids), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names)) or "(?!)")

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special-token text as plain text."""
        plain = copy.deepcopy(self.backend)
        plain.encode_special_tokens = True
        return plain

    def id_to_token(self, token_id: int) -> str:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        piece = self.id_to_token(token_id)
        if not self._is_byte_level and token_id not in self._added_token_ids:
            # As llama.cpp's token_to_piece: decode() would drop a SentencePiece leading space.
            data = self._token_bytes(piece)
            if data is not None:
                return data.decode("utf-8") if data.isascii() else format_token_bytes(data)
            if SPIECE_SPACE in piece:
                return piece.replace(SPIECE_SPACE, " ")
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text or token_id in self._added_token_ids:
            return text
        data = self._token_bytes(piece)
        return text if data is None else format_token_bytes(data)

    def _token_bytes(self, piece: str) -> bytes | None:
        """Raw bytes of a vocabulary piece when the vocabulary spells bytes, else None."""
        if self._is_byte_level:
            inverse = unicode_to_bytes()
            if all(char in inverse for char in piece):
                return bytes(inverse[char] for char in piece)
        match = _BYTE_FALLBACK_TOKEN.match(piece)
        return bytes([int(match.group(1), 16)]) if match else None

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> HFTokenizer:
        """The tokenizer llama.cpp builds from a GGUF file's `tokenizer.*` metadata (see
        `gguf_vocabulary`: byte-level BPE, SentencePiece and Gemma 4 BPE; ValueError for others)."""
        vocab = gguf_vocabulary(fields)
        return cls(vocab.backend, vocab.bos_token, vocab.eos_token, vocab.chat_template, pad_token=vocab.pad_token)

    @classmethod
    def from_directory(cls, path: str | Path) -> HFTokenizer:
        """Load an HF checkpoint's tokenizer.json, tokenizer_config.json and chat template.

        BOS/EOS/PAD come from tokenizer_config (strings or `{"content": ...}` dicts). As in
        transformers, an explicit `add_bos_token`/`add_eos_token` there rewrites the
        post-processor; otherwise tokenizer.json's own post-processor decides. Extra EOS ids from
        generation_config.json also stop generation.
        """
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        if "add_bos_token" in config or "add_eos_token" in config:
            set_bos_eos(backend, bos, eos, config.get("add_bos_token", False),
                        config.get("add_eos_token", False))
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        extra_stops = [generation_eos] if isinstance(generation_eos, int) else generation_eos
        return cls(backend, bos, eos, _directory_chat_template(path, config), extra_stops,
                   pad_token=_token_content(config.get("pad_token")))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _directory_chat_template(path: Path, config: dict) -> str | None:
    """chat_template.jinja if present, else tokenizer_config's string or its "default" named one."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
