"""One adapter per grammar backend for bench.grammar_backends: each builds its view of a vocabulary,
compiles a JSON schema or a regex, and fills a [1, vocab / 32] int32 bitmask (bit t of word t // 32
is token t) for a matcher it advances token by token.

Knows the backends' APIs and the byte-level BPE alphabet; times nothing. Each imports its library
when constructed, so a missing one raises ImportError there.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Protocol

import numpy as np

from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import HFTokenizer
from vllmlite.worker.structured_output import make_llg_tokenizer


class GrammarBackend(Protocol):
    """What every adapter provides. `compiled` may be shared by many matchers and is never advanced."""

    name: str
    dist: str  # the distribution's name, for its version and requirements

    def vocabulary(self, tokenizer: HFTokenizer, vocab_size: int) -> Any: ...
    def compile(self, vocabulary: Any, kind: str, spec: dict | str) -> Any: ...  # kind "json" or "regex"
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: np.ndarray) -> None: ...  # bitmask [1, words] int32
    def consume(self, matcher: Any, token_id: int) -> bool: ...


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a vocabulary entry uses -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [*map(chr, printable), *(chr(256 + i) for i in range(len(others)))]
    return dict(zip(chars, printable + others))


def token_bytes(tokenizer: HFTokenizer) -> dict[int, bytes]:
    """Every non-special token's bytes (the default model's tokenizer is byte-level BPE)."""
    decoder = _byte_decoder()
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)  # {text: id}
    return {i: bytes(decoder[c] for c in text) for text, i in vocab.items() if i not in tokenizer.special_token_ids}


class LLGuidance:
    """llguidance as vllmlite uses it: make_llg_tokenizer, JSON schemas with flexible whitespace."""

    name, dist = "llguidance", "llguidance"

    def __init__(self) -> None:
        self.llg = importlib.import_module("llguidance")
        self.llg_numpy = importlib.import_module("llguidance.numpy")

    def vocabulary(self, tokenizer: HFTokenizer, vocab_size: int):
        return make_llg_tokenizer(tokenizer, vocab_size)

    def compile(self, vocabulary, kind: str, spec: dict | str):
        grammar = StructuredOutputsParams(**{kind: spec}).grammar_text()  # exactly the server's grammar
        matcher = self.llg.LLMatcher(vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        self.llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)

    def consume(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)


class OutlinesCore:
    """outlines-core: the schema becomes a regex, the regex a token-level automaton (an Index)."""

    name, dist = "outlines-core", "outlines-core"

    def __init__(self) -> None:
        self.oc = importlib.import_module("outlines_core")

    def vocabulary(self, tokenizer: HFTokenizer, vocab_size: int):
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in token_bytes(tokenizer).items():
            by_bytes.setdefault(data, []).append(token_id)
        return self.oc.Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile(self, vocabulary, kind: str, spec: dict | str):
        regex = spec if kind == "regex" else self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        return self.oc.Index(regex, vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        matcher.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def consume(self, matcher, token_id: int) -> bool:
        try:
            matcher.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        return True


class XGrammar:
    """xgrammar: a pushdown automaton with a per-state cache of context-independent tokens."""

    name, dist = "xgrammar", "xgrammar"

    def __init__(self) -> None:
        self.xgr = importlib.import_module("xgrammar")
        self.torch = importlib.import_module("torch")  # xgrammar's masks are torch tensors

    def vocabulary(self, tokenizer: HFTokenizer, vocab_size: int):
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)  # {text: id}
        encoded = [""] * vocab_size
        for text, token_id in vocab.items():
            encoded[token_id] = text
        info = self.xgr.TokenizerInfo(encoded, vocab_type=self.xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=sorted(tokenizer.stop_token_ids))
        # One thread, as the others compile; no cache, so every compile is cold.
        return self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, vocabulary, kind: str, spec: dict | str):
        if kind == "regex":
            return vocabulary.compile_regex(spec)
        return vocabulary.compile_json_schema(json.dumps(spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(self.torch.from_numpy(bitmask))  # a view: writes into bitmask

    def consume(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)


class LMFormatEnforcer:
    """lm-format-enforcer (pure Python): a character-level parser walked over a prefix tree of the
    vocabulary. Its state is the token sequence so far; its answer a list of ids, packed here."""

    name, dist = "lm-format-enforcer", "lm-format-enforcer"

    def __init__(self) -> None:
        self.lmfe = importlib.import_module("lmformatenforcer")

    def vocabulary(self, tokenizer: HFTokenizer, vocab_size: int):
        # As its transformers integration does: decode after a "0" token to keep a leading space.
        zero = tokenizer.encode("0", add_special_tokens=False)[-1]
        regular = []
        for token_id in range(vocab_size):
            if token_id not in tokenizer.special_token_ids:
                text = tokenizer.decode([zero, token_id])[1:]
                regular.append((token_id, text, len(text) > len(tokenizer.decode([token_id]))))
        return self.lmfe.TokenEnforcerTokenizerData(regular, lambda ids: tokenizer.decode(ids).rstrip("\ufffd"),
                                                    sorted(tokenizer.stop_token_ids), False, vocab_size)

    def compile(self, vocabulary, kind: str, spec: dict | str):
        parser = (self.lmfe.JsonSchemaParser(spec) if kind == "json" else self.lmfe.RegexParser(spec))
        return vocabulary, parser

    def matcher(self, compiled):
        vocabulary, parser = compiled
        return self.lmfe.TokenEnforcer(vocabulary, parser), []

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        enforcer, token_ids = matcher
        allowed = np.zeros(bitmask.shape[1] * 32, dtype=bool)  # [32 * words]
        allowed[enforcer.get_allowed_tokens(token_ids).allowed_tokens] = True
        bitmask[0] = np.packbits(allowed, bitorder="little").view(np.int32)

    def consume(self, matcher, token_id: int) -> bool:
        matcher[1].append(token_id)  # the next mask checks it
        return True


BACKENDS: dict[str, type[GrammarBackend]] = {
    # xgrammar before lm-format-enforcer: that one imports torch whenever it can, so after it
    # torch_loaded_by_import would say nothing.
    "llguidance": LLGuidance, "outlines-core": OutlinesCore, "xgrammar": XGrammar,
    "lm-format-enforcer": LMFormatEnforcer,
}
