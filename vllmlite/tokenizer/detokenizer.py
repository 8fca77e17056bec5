"""Incremental detokenization of one request's output, with stop-string matching.

Turns sampled token ids into text deltas safe to stream: never half a UTF-8 character, never text
a stop string could still take back. Knows the `Tokenizer` interface only, not the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from vllmlite.tokenizer.base import Tokenizer

# Prompt tokens decoded as left context, so a decoder that treats the first token specially
# (SentencePiece's leading space) sees the output as a continuation (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
# A window holding more tokens than this past its prefix is cut (where that is clean) even though
# its text still ends in U+FFFD: a run of tokens that never closes a character (random weights'
# output, or a logit_bias forcing a lone byte token) would otherwise grow it, and every token's
# decode with it, to the whole output: O(n^2) work on the engine thread.
MAX_OPEN_TOKENS = 32
CUT_KEEP_TOKENS = 4   # tokens kept after a forced cut: room for a character still open (<= 3 bytes)


class DetokenizerDelta(NamedTuple):
    text: str  # new text safe to emit now
    stop_str: str | None  # the stop string matched in this call, if any (the caller finishes the request)
    num_tokens_used: int  # tokens of this call consumed up to and including the one completing the stop


class IncrementalDetokenizer:
    """Detokenize a growing token sequence in O(window) per token (vLLM's prefix/read offsets).

    Only a window of the latest ids is kept: `window[:read_offset]` is text already emitted, kept as
    left context (vLLM's prefix), `window[read_offset:]` is text not yet fully emitted, and
    `window_emitted` counts the characters of `decode(window)` already emitted. The window moves
    only at a clean boundary (decoded text not ending in U+FFFD, so no UTF-8 character is open),
    where decoding the two sides apart gives the same text as decoding them together. A run of
    tokens that never closes a character (garbage bytes) is cut once it passes MAX_OPEN_TOKENS, at
    a point where the same holds (`_cut`), so no window grows with the output.

    Invariant: every string emitted is final; with no stop string the emitted pieces plus `flush()`
    join to `tokenizer.decode(output_ids, skip_special_tokens)` for byte-level tokenizers.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.output_text = ""
        self.stop_str: str | None = None  # set once a stop string matched; nothing is emitted after
        self._window = list(_clean_prompt_context(tokenizer, prompt_token_ids, skip_special_tokens))
        self._read_offset = len(self._window)
        self._window_emitted = len(self._decode(self._window))
        self._held = ""  # decoded text withheld because it may begin a stop string

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Consume `token_ids` in order; return the text now safe to emit.

        On a stop match, the text ends before the stop string (or after it with
        include_stop_str_in_output), `stop_str` is set and `num_tokens_used` counts this call's
        tokens up to and including the one that completed it; later calls return an empty delta.
        """
        if self.is_stopped:
            return DetokenizerDelta("", None, 0)
        if not self.stop:   # nothing to match: all of them in one decode, not one (or two) a token
            if not len(token_ids):
                return self._emit("", None, 0)
            self._window.extend(map(int, token_ids))   # numpy ints from the sampler too
            return self._emit(self._decode_step(), None, len(token_ids))
        pieces = []
        for num_used, token_id in enumerate(token_ids, start=1):
            text, stop_str = self._add_one(token_id)
            pieces.append(text)
            if stop_str is not None:
                return self._emit("".join(pieces), stop_str, num_used)
        return self._emit("".join(pieces), None, len(token_ids))

    def finish(self, token_ids: Sequence[int]) -> str:
        """`add_tokens(token_ids)` then `flush()` for a request that has ended, with no stop strings: the
        text in one decode of the window (those two decode it up to three times; a final-only request
        sends its whole output here at once, and a burst's requests end together)."""
        if self.stop:
            raise ValueError("finish() is for detokenizers without stop strings")
        self._window.extend(map(int, token_ids))
        text = self._decode(self._window)
        released = text[self._window_emitted:]   # nothing is held back without stop strings
        self._window, self._read_offset, self._window_emitted = [], 0, 0
        self.output_text += released
        return released

    def flush(self) -> str:
        """Release everything held back; call once when the request finishes other than by a stop
        string. A trailing U+FFFD is final now, and held stop-prefix text is no stop after all."""
        if self.is_stopped:
            return ""
        text = self._decode(self._window)
        released = self._held + text[self._window_emitted:]
        self._window_emitted = len(text)
        self._held = ""
        self.output_text += released
        return released

    def _emit(self, text: str, stop_str: str | None, num_tokens_used: int) -> DetokenizerDelta:
        self.output_text += text
        return DetokenizerDelta(text, stop_str, num_tokens_used)

    def _add_one(self, token_id: int) -> tuple[str, str | None]:
        """Append one token; return (text safe to emit, the stop string it completed or None)."""
        self._window.append(int(token_id))  # numpy ints from the sampler too
        pending = self._held + self._decode_step()
        stop_match = _find_stop(pending, self.stop)
        if stop_match is not None:
            start, stop_str = stop_match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self.stop_str = stop_str
            self._held = ""
            return pending[:end], stop_str
        num_hold = _stop_prefix_len(pending, self.stop)
        self._held = pending[len(pending) - num_hold:]
        return pending[:len(pending) - num_hold], None

    def _decode_step(self) -> str:
        """New final text after the last appended token; moves the window at a clean boundary.

        A trailing run of U+FFFD may still become characters, but everything before it is final:
        e.g. bytes "a" E2 decode to "a" + U+FFFD; "a" is emitted and E2 waits for its next bytes.
        (A whole run, not one U+FFFD: byte-fallback decoders give one U+FFFD per pending byte.)
        """
        text = self._decode(self._window)
        final_len = len(text.rstrip(REPLACEMENT_CHAR))
        new_text = text[self._window_emitted:final_len]
        self._window_emitted = max(self._window_emitted, final_len)
        if final_len == len(text):
            # window [p p r r n] (p prefix, r unread, n new) -> [r r n], all of it now prefix.
            self._window = self._window[self._read_offset:]
            self._read_offset = len(self._window)
            self._window_emitted = len(self._decode(self._window))
        elif len(self._window) - self._read_offset > MAX_OPEN_TOKENS:
            new_text += self._cut(text)
        return new_text

    def _cut(self, text: str) -> str:
        """Drop all but the last CUT_KEEP_TOKENS (to 3 more) tokens of a long window whose text is
        still open, at the first cut where decoding the two sides apart gives `text` (the kept
        tokens' bytes then never join the dropped ones', so the dropped side's text, U+FFFD runs
        included, is final; a cut inside a malformed sequence decodes differently, hence the 4
        tries). Returns what of the dropped side's text was not yet emitted."""
        for keep in range(CUT_KEEP_TOKENS, CUT_KEEP_TOKENS + 4):
            cut = len(self._window) - keep
            left, right = self._decode(self._window[:cut]), self._decode(self._window[cut:])
            if right and left + right == text:
                break
        else:
            return ""
        released = left[self._window_emitted:]
        self._window = self._window[cut:]
        self._read_offset = 0
        self._window_emitted = max(self._window_emitted - len(left), 0)
        return released

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def _clean_prompt_context(
    tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """The last prompt tokens as left context, or none if they end inside a UTF-8 character (the
    output's first bytes must not complete a prompt character)."""
    context = [int(i) for i in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
    text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return [] if text.endswith(REPLACEMENT_CHAR) else context


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the stop occurrence in `text` that ends first; ties to the one
    starting first, then to the first listed. Ending first is what reading the text one character
    at a time would find, so the match does not depend on how many characters a token held:

    >>> _find_stop("abcd", ["abcd", "bc"])
    (1, 'bc')
    """
    found = []
    for order, stop_str in enumerate(stops):
        start = text.find(stop_str)
        if start >= 0:
            found.append((start + len(stop_str), start, order, stop_str))
    if not found:
        return None
    _, start, _, stop_str = min(found)
    return start, stop_str


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    >>> _stop_prefix_len("hello wor", ["world", "x"])
    3
    """
    longest = 0
    for stop_str in stops:
        for length in range(min(len(stop_str) - 1, len(text)), longest, -1):
            if text.endswith(stop_str[:length]):
                longest = length
                break
    return longest
