"""The GGUF vocabulary builder: the byte-level BPE `tokenizers.Tokenizer` transformers builds from a GGUF
file's `tokenizer.*` metadata (tokens, merges, token types, pre-tokenizer, BOS/EOS), and GPT-2's byte
alphabet that byte-level vocabularies are spelled in.

Knows the GGUF metadata keys and the `tokenizers` library; knows nothing of the Tokenizer interface
(hf.py wraps what this builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

if TYPE_CHECKING:
    import gguf

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


class GGUFVocabulary(NamedTuple):
    """What a GGUF file's metadata says of its tokenizer: the backend and its special tokens' text."""

    backend: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None


def gguf_vocabulary(fields: dict[str, Any]) -> GGUFVocabulary:
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
    set_bos_eos(backend, bos, eos, fields.get("tokenizer.ggml.add_bos_token", False),
                fields.get("tokenizer.ggml.add_eos_token", False))
    return GGUFVocabulary(backend, bos, eos, pad, fields.get("tokenizer.chat_template"))


def read_gguf_fields(reader: gguf.GGUFReader, prefix: str = "tokenizer.") -> dict[str, Any]:
    """The GGUF metadata under `prefix` as python values (str, int, bool, list).

    `ReaderField.contents()` turns SmolLM2's 49k tokens into strings in ~20 ms (building the
    GGUFReader itself is the slow part: it parses every array element up front).
    """
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith(prefix)}


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


def set_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """transformers' `update_post_processor`: `[bos] $A [eos]` as the flags say."""
    add_bos, add_eos = bool(add_bos) and bos is not None, bool(add_eos) and eos is not None
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    special = [(bos, backend.token_to_id(bos))] if add_bos else []
    special += [(eos, backend.token_to_id(eos))] if add_eos else []
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
