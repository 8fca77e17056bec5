"""The GGUF vocabulary builder: the `tokenizers.Tokenizer` that reproduces llama.cpp's tokenizer for a
GGUF file's `tokenizer.*` metadata (tokens, scores, merges, token types, pre-tokenizer, BOS/EOS), and
GPT-2's byte alphabet that byte-level vocabularies are spelled in.

llama.cpp is the reference (src/llama-vocab.cpp): byte-level BPE ("gpt2"), SentencePiece ("llama")
and Gemma 4's SentencePiece-style BPE ("gemma4") are built; other tokenizer models raise ValueError.
Knows the GGUF metadata keys and the `tokenizers` library; knows nothing of the Tokenizer interface
(hf.py wraps what this builds). Pre-tokenizer regexes live in gguf_pre_tokenizers.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from functools import lru_cache
from os import PathLike
from typing import Any, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from vllmlite.tokenizer.gguf_pre_tokenizers import pre_tokenizer_spec, split_pre_tokenizer
from vllmlite.utils.gguf_file import GGUFFile

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


class TokenType(IntEnum):
    """GGUF's `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")
_UNSUPPORTED_TOKENIZER_MODELS = {
    "bert": "WordPiece", "t5": "Unigram (UGM)", "rwkv": "RWKV", "plamo2": "PLaMo-2",
    "hybriddna": "hybrid DNA BPE", "whitespace": "whitespace words", "no_vocab": "no vocabulary",
    "none": "no vocabulary",
}


class GGUFVocabulary(NamedTuple):
    """What a GGUF file's metadata says of its tokenizer: the backend and its special tokens' text."""

    backend: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None


def gguf_vocabulary(fields: dict[str, Any]) -> GGUFVocabulary:
    """Build the tokenizer llama.cpp builds from a GGUF file's `tokenizer.*` metadata.

    `encode(text, add_special_tokens=False)` with special-token text read as plain text gives
    llama.cpp's `llama_tokenize(..., add_special=false, parse_special=false)`; with special tokens
    parsed it matches parse_special=true. Raises ValueError for a tokenizer model or pre-tokenizer
    llama.cpp's behaviour is not reproduced for, naming the supported ones.
    """
    model = fields.get("tokenizer.ggml.model")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    _check_unique(tokens)
    backend, add_bos = _model_backend(model, tokens, fields)
    token_types = fields.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    _add_gguf_added_tokens(backend, tokens, token_types, rstrip=_is_phi3(fields))

    def token_of(key: str, default: int | None = None) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{key}", default)
        return None if token_id is None or token_id >= len(tokens) else tokens[token_id]

    sentencepiece = model == "llama"  # llama.cpp's defaults when a SentencePiece file names no id
    bos = token_of("bos_token_id", 1 if sentencepiece else None)
    eos = token_of("eos_token_id", 2 if sentencepiece else None)
    unk, pad = token_of("unknown_token_id", 0 if sentencepiece else None), token_of("padding_token_id")
    for name in (bos, eos, unk, pad):
        if name is not None:  # transformers makes the named tokens special
            backend.add_special_tokens([AddedToken(name, special=True, normalized=False)])
    set_bos_eos(backend, bos, eos, add_bos, fields.get("tokenizer.ggml.add_eos_token", False))
    return GGUFVocabulary(backend, bos, eos, pad, fields.get("tokenizer.chat_template"))


def _model_backend(model: str | None, tokens: list[str], fields: dict[str, Any]) -> tuple[tokenizers.Tokenizer, bool]:
    """The backend for `tokenizer.ggml.model`, and whether llama.cpp adds BOS for it."""
    pre = fields.get("tokenizer.ggml.pre")
    if model == "llama":
        scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = tokens[fields.get("tokenizer.ggml.unknown_token_id", 0)]
        backend = _sentencepiece_bpe(tokens, scores, unk, fields.get("tokenizer.ggml.add_space_prefix", True))
        return backend, fields.get("tokenizer.ggml.add_bos_token", True)
    if model == "gemma4" or (model == "gpt2" and pre_tokenizer_spec(pre).sentencepiece_style):
        # llama.cpp forces BOS on for Gemma 4 whatever the file says
        return _sentencepiece_style_bpe(tokens, fields["tokenizer.ggml.merges"]), True
    if model == "gpt2":
        spec = pre_tokenizer_spec(pre)
        backend = _byte_level_bpe(tokens, fields["tokenizer.ggml.merges"], spec.ignore_merges)
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *split_pre_tokenizer(spec), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return backend, fields.get("tokenizer.ggml.add_bos_token", spec.add_bos)
    kind = _UNSUPPORTED_TOKENIZER_MODELS.get(model, "unknown")
    raise ValueError(
        f"GGUF tokenizer model {model!r} ({kind}) is not supported: supported tokenizer.ggml.model values "
        f"are {', '.join(map(repr, SUPPORTED_TOKENIZER_MODELS))}; use an HF directory with tokenizer.json")


def read_gguf_fields(source: str | PathLike[str] | GGUFFile, prefix: str = "tokenizer.") -> dict[str, Any]:
    """The metadata under `prefix` of a GGUF file (a path, or one already read) as Python values
    (str, int, float, bool, list)."""
    file = source if isinstance(source, GGUFFile) else GGUFFile(source)
    return {key: value for key, value in file.fields.items() if key.startswith(prefix)}


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


def _check_unique(tokens: list[str]) -> None:
    """llama.cpp refuses a vocabulary listing a token twice; so do we (one id would be unreachable)."""
    if len(set(tokens)) != len(tokens):
        seen: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if token in seen:
                raise ValueError(f"duplicate token in GGUF vocabulary: {token!r} has ids {seen[token]} and {index}")
            seen[token] = index


def _split_merge(merge: str) -> tuple[str, str]:
    """A GGUF merge "left right", cut at the first space after the first character as llama.cpp does
    (so a left side that is itself a space survives: "  x" -> (" ", "x"))."""
    cut = merge.find(" ", 1)
    return merge[:cut], merge[cut + 1:]


def _byte_level_bpe(tokens: list[str], merges: list[str], ignore_merges: bool) -> tokenizers.Tokenizer:
    """GPT-2 style BPE over byte-alphabet words. Tokens are kept as the file spells them: one spelled
    outside the alphabet (an added token stored as text, such as MPT's run of spaces) is reachable
    only as an added token, exactly as in llama.cpp, and the byte-level decoder passes it through."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=[_split_merge(m) for m in merges], dropout=None,
                                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                       ignore_merges=ignore_merges))
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: Sequence[float], unk: str,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """llama.cpp's `llm_tokenizer_spm`: spaces become "▁" (one prepended to each run of text when
    `add_space_prefix`), then adjacent pieces whose concatenation is a token merge, highest score
    first; a character no token covers becomes its <0xNN> byte tokens.

    As BPE: every split of a token into two tokens is a merge, ranked by the whole token's score.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()  # (-score, left id, right id) are unique, so the strings are never compared
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
                                       dropout=None, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # tokenizers normalizes each run of text between added tokens apart, so Prepend gives llama.cpp's
    # "a space before the first text and after every special token".
    space = normalizers.Replace(" ", SPIECE_SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), space]) if add_space_prefix else space
    backend.decoder = decoders.Sequence([
        decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])])
    return backend


def _sentencepiece_style_bpe(tokens: list[str], merges: list[str]) -> tokenizers.Tokenizer:
    """Gemma 4's BPE: ranked merges over raw UTF-8 with spaces spelled "▁", text cut only between
    newline runs and the rest, <0xNN> byte fallback (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=[_split_merge(m) for m in merges], dropout=None,
                                       byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: Sequence[int],
                           rstrip: bool) -> None:
    """llama.cpp cuts text at these before the model runs: CONTROL and UNKNOWN tokens only where
    special tokens are parsed (special added tokens), USER_DEFINED ones always (plain added ones).
    With `rstrip` each also swallows the whitespace after it, but for BOS, UNK and <|endoftext|>."""
    def added(token: str, special: bool) -> AddedToken:
        strip = rstrip and token not in ("<unk>", "<s>", "<|endoftext|>")
        return AddedToken(token, normalized=False, special=special, rstrip=strip)

    special = [added(token, True) for token, kind in zip(tokens, token_types)
               if kind in (TokenType.CONTROL, TokenType.UNKNOWN)]
    if special:
        backend.add_special_tokens(special)
    user_defined = [added(token, False) for token, kind in zip(tokens, token_types) if kind == TokenType.USER_DEFINED]
    if user_defined:
        backend.add_tokens(user_defined)


def _is_phi3(fields: dict[str, Any]) -> bool:
    """llama.cpp makes Phi-3's special tokens eat the whitespace after them (as its tokenizer.json
    does), recognising the model by `general.name`; absent when only `tokenizer.*` is given."""
    name = str(fields.get("general.name", "")).lower()
    return "phi-3" in name or "phi3" in name


def set_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """transformers' `update_post_processor`: `[bos] $A [eos]` as the flags say."""
    add_bos, add_eos = bool(add_bos) and bos is not None, bool(add_eos) and eos is not None
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    special = [(bos, backend.token_to_id(bos))] if add_bos else []
    special += [(eos, backend.token_to_id(eos))] if add_eos else []
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
