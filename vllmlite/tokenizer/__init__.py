"""Tokenizers: the `Tokenizer` interface, HF `tokenizers` (GGUF metadata or an HF directory) and bytes.

Owns text <-> token ids, special and stop tokens, the model's chat template string, and the HF
tokenizer methods user scripts call. Knows nothing of models, requests or incremental
detokenization (see detokenizer.py).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache
from numbers import Integral
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from vllmlite.tokenizer.chat_template import render_chat_template

if TYPE_CHECKING:
    import gguf

# Token names llama.cpp treats as end of generation (its EOG detection). Any of these that is a
# special token of the vocabulary stops generation, besides EOS: chat turns often end with one.
END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)

# GGUF token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits transformers uses per `tokenizer.ggml.pre`; any other value (such as
# "smollm" or "gpt2") keeps GPT-2's regex inside `pre_tokenizers.ByteLevel`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = MappingProxyType({
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
})

_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class BatchEncoding(dict):
    """What `tokenizer(text)` returns, as HF's BatchEncoding: `enc["input_ids"]` or `enc.input_ids`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer(ABC):
    """What the engine and the server need from a tokenizer, plus the Hugging Face tokenizer surface
    that vLLM user scripts call on `LLM.get_tokenizer()` (same names, signatures and defaults).

    Invariants: every id in `special_token_ids` and `stop_token_ids` is < `vocab_size`;
    `stop_token_ids` contains `eos_token_id` when that is not None. `vocab_size` counts added tokens
    too (HF's `len(tokenizer)`; HF's own `vocab_size` leaves out added tokens beyond the base vocab).
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    stop_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    chat_template: str | None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text inside it maps to the special ids. BOS is
        prepended only when `add_special_tokens` and the tokenizer's own config adds it.
        Text UTF-8 cannot encode (a lone surrogate such as "\ud800") raises UnicodeEncodeError,
        a ValueError."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; bytes that are not valid UTF-8 become U+FFFD."""

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """One token's text for logprob display, special tokens kept. A token whose bytes are not
        valid UTF-8 on their own reads `bytes:\\xe2\\x80` (literal backslashes, lowercase hex)."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's piece for `token_id` (e.g. "Ġhello" in byte-level BPE); ValueError if
        the id is outside the vocabulary."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary piece `token`, None if the vocabulary has no such piece."""

    def apply_chat_template(
        self,
        conversation: list[dict],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        return_dict: bool = False,
        return_tensors: None = None,
        tools: list[dict] | None = None,
    ) -> str | list[int] | BatchEncoding:
        """The prompt text for `conversation` under the model's template (ChatML when it has none),
        as the server renders it; with `tokenize` (HF's default) its ids, encoded without adding
        special tokens, since the template already writes BOS where the model wants it.

        `chat_template` renders the caller's own template instead, in the same jinja sandbox. `tools`
        reach a template that has a tools section (HF's convention). Arguments are keyword-only.
        """
        if return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r} is not supported: token ids are python lists")
        text = render_chat_template(
            chat_template if chat_template is not None else self.chat_template,
            conversation, add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
        )
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, add_special_tokens=False)

    def encode_with_plain_spans(self, text: str, plain_spans: Sequence[tuple[int, int]],
                                add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` in which special-token text inside `plain_spans` ((start, end)
        character offsets) is read as plain text, never as the special token.

        Equal to `encode(text, add_special_tokens)` when no special-token text lies in a span.
        A tokenizer that never reads special tokens from text (ByteTokenizer) needs nothing more.
        """
        return self.encode(text, add_special_tokens)

    def find_special_text(self, text: str) -> str | None:
        """The first special token's text found in `text`, or None."""
        return None

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> BatchEncoding:
        """`input_ids` and an all-ones `attention_mask`: lists for one text, lists of lists for a batch."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def __len__(self) -> int:
        return self.vocab_size

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary pieces: one for one id, a list for a list."""
        if isinstance(ids, Integral):
            return self.id_to_token(int(ids))
        return [self.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Ids of vocabulary pieces: one for one piece, a list for a list. An unknown piece gives
        None (HF gives `unk_token_id`, which is None too when the tokenizer has no unknown token)."""
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(token) for token in tokens]

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)


def format_token_bytes(data: bytes) -> str:
    """`data` as UTF-8 text, or the `bytes:\\x..` form when it is not valid UTF-8.

    >>> format_token_bytes(b"hi"), format_token_bytes(b"\\xe2\\x80")
    ('hi', 'bytes:\\\\xe2\\\\x80')
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    num_extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + num_extra)
            num_extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of `bytes_to_unicode`."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


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
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text or token_id in self._added_token_ids:
            return text
        data = self._token_bytes(self.backend.id_to_token(token_id))
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
        """Build the tokenizer transformers builds from a GGUF file's `tokenizer.*` metadata.

        Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported: SentencePiece
        ("llama"), unigram ("t5") and others raise ValueError rather than produce wrong ids.
        """
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported yet: only byte-level BPE ('gpt2') "
                "vocabularies are; use an HF directory with tokenizer.json for this model"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        backend = _byte_level_bpe(tokens, fields["tokenizer.ggml.merges"])
        _add_gguf_added_tokens(backend, tokens, fields.get("tokenizer.ggml.token_type") or ())
        split = GGUF_PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre"))
        if split is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])

        def token_of(key: str) -> str | None:
            token_id = fields.get(f"tokenizer.ggml.{key}")
            return None if token_id is None else tokens[token_id]

        bos, eos, pad = token_of("bos_token_id"), token_of("eos_token_id"), token_of("padding_token_id")
        for name in (bos, eos, token_of("unknown_token_id"), pad):
            if name is not None:  # transformers makes the named tokens special
                backend.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        _set_bos_eos(backend, bos, eos, fields.get("tokenizer.ggml.add_bos_token", False),
                     fields.get("tokenizer.ggml.add_eos_token", False))
        return cls(backend, bos, eos, fields.get("tokenizer.chat_template"), pad_token=pad)

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
            _set_bos_eos(backend, bos, eos, config.get("add_bos_token", False),
                         config.get("add_eos_token", False))
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        extra_stops = [generation_eos] if isinstance(generation_eos, int) else generation_eos
        return cls(backend, bos, eos, _directory_chat_template(path, config), extra_stops,
                   pad_token=_token_content(config.get("pad_token")))


def read_gguf_fields(reader: gguf.GGUFReader, prefix: str = "tokenizer.") -> dict[str, Any]:
    """The GGUF metadata under `prefix` as python values (str, int, bool, list).

    `ReaderField.contents()` turns SmolLM2's 49k tokens into strings in ~20 ms (building the
    GGUFReader itself is the slow part: it parses every array element up front).
    """
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith(prefix)}


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> tokenizers.Tokenizer:
    """GPT2Tokenizer as transformers builds it from a GGUF: tokens outside the byte alphabet are
    respelled through it, GPT-2's split regex, no prefix space, byte-level decoder."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ")) for merge in merges]
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: Sequence[int]) -> None:
    """CONTROL tokens become special added tokens (unless spelled outside the byte alphabet, a
    llama.cpp mislabel transformers skips); USER_DEFINED ones in the vocab become plain added ones."""
    alphabet = set(bytes_to_unicode().values())
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED and token in vocab]
    if user_defined:
        backend.add_tokens(user_defined)


def _set_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """transformers' `update_post_processor`: `[bos] $A [eos]` as the flags say."""
    add_bos, add_eos = bool(add_bos) and bos is not None, bool(add_eos) and eos is not None
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    special = [(bos, backend.token_to_id(bos))] if add_bos else []
    special += [(eos, backend.token_to_id(eos))] if add_eos else []
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


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
