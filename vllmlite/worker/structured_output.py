"""Structured output with llguidance: grammars compiled off the step thread and cached, one grammar
state per sample, and the allowed-token masks the sampler applies.

Knows llguidance, numpy and the Tokenizer classes; knows nothing of the scheduler or the model. The
grammar state advances only on tokens a sample keeps (the scheduler calls `accept`), so a rejected
speculative guess never reaches it: the masks of guess positions come from a walk along the guesses
that is rolled back at once (`LLMatcher.rollback`). A sample whose grammar is complete (nothing may
follow) finishes with "stop", even under ignore_eos; max_tokens may still cut a document short.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np

from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

GRAMMAR_CACHE_SIZE = 64
# Tokens `GrammarCompiler.check` walks: llguidance builds lexer states and parser rows lazily, so a
# grammar past one of its limits (a regex of a million states, a row of 6,000 alternatives) passes
# validation and fails only once tokens arrive, mostly at the first.
NUM_PROBE_TOKENS = 8


def make_llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of our vocabulary: an HF tokenizer through its tokenizer.json text, the byte
    tokenizer through its 256 byte tokens and two special ones. Every stop token (EOS, end of turn)
    is an end the grammar may allow once it is complete."""
    eos = sorted(tokenizer.stop_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)), eos_token=eos)
    raise ValueError(f"structured output does not support the {type(tokenizer).__name__}")


class _ByteVocabulary:
    """What llguidance.TokenizerWrapper reads: each token's bytes, the special ids, an encoder."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.tokens = [tokenizer.decode([i]).encode() if i in tokenizer.special_token_ids else bytes([i])
                       for i in range(tokenizer.vocab_size)]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class GrammarCompiler:
    """Compiles constraints into llguidance matchers on one background thread, so the engine loop
    never waits for a large schema; keeps the last GRAMMAR_CACHE_SIZE by `params.key`. A cached
    matcher is never advanced: each sample gets `deep_copy()` of it (a few microseconds)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._llg_tokenizer: llguidance.LLTokenizer | None = None  # built on the worker, once
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllmlite-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled (pristine) matcher; it raises ValueError if the grammar is bad."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
            self._cache.move_to_end(key)
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError (the client's, a one-line message) unless the grammar compiles against
        this vocabulary and takes its first NUM_PROBE_TOKENS tokens (each the lowest allowed one that
        does not end it) within llguidance's limits. Compiles through the cache, walks a copy:
        thread-safe, so the HTTP side may call it before the request is queued."""
        state = self.new_state(self.submit(params).result())
        bitmask = llguidance.numpy.allocate_token_bitmask(1, state.vocab_size)  # [1, words] int32
        stop_token_ids = list(self._tokenizer.stop_token_ids)
        for _ in range(NUM_PROBE_TOKENS):
            llguidance.numpy.fill_next_token_bitmask(state.matcher, bitmask, 0)
            allowed = unpack_bitmask(bitmask, state.vocab_size)[0]  # [vocab] bool
            allowed[[t for t in stop_token_ids if t < state.vocab_size]] = False
            if state.matcher.is_error() or state.is_terminated or not allowed.any():
                break
            state.accept(int(allowed.argmax()))
        if state.matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} breaks a limit of the grammar engine within its "
                             f"first tokens: {state.error}")

    def new_state(self, compiled: llguidance.LLMatcher) -> GrammarState:
        """A fresh grammar state for one sample, from a compiled matcher `submit` produced."""
        return GrammarState(compiled.deep_copy(), self._llg_tokenizer.vocab_size)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._llg_tokenizer is None:
            self._llg_tokenizer = make_llg_tokenizer(self._tokenizer, self._vocab_size)
        matcher = llguidance.LLMatcher(self._llg_tokenizer, params.grammar_text(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {matcher.get_error()}")
        return matcher


class GrammarState:
    """One sample's position in its grammar: advanced by the tokens it keeps, never by guesses."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar's vocabulary: tokens past it are never allowed

    def accept(self, token_id: int) -> bool:
        """Advance over a kept token; False if the grammar forbids it or has failed (the state is then
        an error). A grammar fails when it breaks one of llguidance's limits: every state compiled
        from the same spec shares the lexer, so later ones start failed (and are refused at admission)
        and allow only EOS, which they must not take as the grammar's end."""
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no token but EOS: the sample ends here."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the grammar failed, in one line: llguidance's message without its state dump."""
        return self.matcher.get_error().split("\n", 1)[0]


class GrammarMasker:
    """Allowed-token masks for a batch of rows, computed by llguidance's executor (it releases the
    GIL); rows without a grammar allow everything."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()

    def masks(self, entries: list[tuple[GrammarState | None, list[int]]]) -> np.ndarray | None:
        """One entry per sequence: its grammar (or None) and the guesses that follow its last token.
        An entry covers 1 + len(guesses) rows: row j allows what the grammar allows after the first
        j guesses. Rows after a guess the grammar forbids allow everything (verification stops at
        that guess anyway). Returns the rows packed as llguidance fills them ([rows, words] int32, bit
        t % 32 of word t // 32 is token t: sampling.unpack_bitmask), or None if no entry has a grammar.

        entries [(g, [5, 7]), (None, [])] -> 4 rows: g now, g after 5, g after 5 7, all True.
        """
        if all(state is None for state, _ in entries):
            return None
        num_rows = sum(1 + len(guesses) for _, guesses in entries)
        bitmask = llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)  # [rows, words] int32, all set
        plain, row, starts = [], 0, []
        for state, guesses in entries:
            if state is not None:
                if guesses:
                    _fill_along_guesses(state.matcher, guesses, bitmask, row)
                else:
                    plain.append((state.matcher, row))
                starts.append((row, 1 + len(guesses), state.vocab_size))
            row += 1 + len(guesses)
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        for start, num_rows, grammar_vocab_size in starts:   # tokens past the grammar's vocabulary: never
            word, bit = divmod(grammar_vocab_size, 32)
            rows = slice(start, start + num_rows)
            if bit:
                bitmask[rows, word] &= np.array((1 << bit) - 1, dtype=np.uint32).view(np.int32)
                word += 1
            bitmask[rows, word:] = 0
        return bitmask


def _fill_along_guesses(matcher: llguidance.LLMatcher, guesses: list[int], bitmask: np.ndarray, row: int) -> None:
    """Rows row .. row + len(guesses) of `bitmask`: the mask now, then after each guess in turn,
    up to the first guess the grammar forbids; then the matcher is rolled back to where it was.

    guesses [5, 9] where 9 is forbidden after 5: rows row (now) and row + 1 (after 5) are filled,
    row + 2 keeps its all-allowed bits, the matcher consumes 5 and rolls it back.
    """
    num_consumed = 0
    for j in range(len(guesses) + 1):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row + j)
        if j == len(guesses) or matcher.try_consume_tokens([guesses[j]]) != 1:
            break
        num_consumed += 1
    if num_consumed and not matcher.rollback(num_consumed):
        raise RuntimeError(f"the grammar could not roll back {num_consumed} guesses: {matcher.get_error()}")


def unpack_bitmask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """A grammar mask as [rows, vocab] bool: given so, or packed as llguidance fills it ([rows,
    words] int32; bit t % 32 of word t // 32 is token t)."""
    if mask.dtype == np.bool_:
        return mask
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
