"""Property tests of stop strings in the output processor: whatever the token boundaries and however
the tokens are grouped into steps, a request's final text is its text up to the first stop string
(with it when include_stop_str_in_output), its token ids end with the token that completed it, the
streamed deltas join to the final text and no reported text is ever taken back.

"First" is the stop string that completes first reading the text in order (ties: the one starting
earlier, then the one listed first): a definition that does not depend on how text was split.
The seam is the OutputProcessor over requests whose tokens the test appends. The text is cut into
tokens at arbitrary byte offsets (a tokenizer whose vocabulary is exactly those pieces), so a token
may hold several characters, part of one, or a stop string and more; the engine's part (finishing
a request on a stop-string hit, or on max_tokens before detokenizing) is played by the test as the
engine plays it.

Run long with VLLMLITE_HYPOTHESIS_EXAMPLES=N (see tests/property_util.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from hypothesis import example, given, settings
from hypothesis import strategies as st
from property_util import examples

from vllmlite.core.request import FinishReason, Request, RequestStatus
from vllmlite.engine.output_processor import OutputProcessor
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import ByteTokenizer
from vllmlite.worker.sampling import make_generator

ALPHABET = "ab é€😀"  # few letters, so stop strings occur; 1- to 4-byte characters


class PieceTokenizer(ByteTokenizer):
    """Token i is the byte string pieces[i]; decoding joins the bytes and decodes UTF-8 (U+FFFD
    for invalid bytes), as a byte-level BPE does. No special tokens."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        super().__init__()
        self.pieces = list(pieces)
        self.vocab_size = len(self.pieces)
        self.bos_token_id = self.eos_token_id = None
        self.stop_token_ids = self.special_token_ids = frozenset()

    def _token_bytes(self, token_id: int, skip_special: bool) -> bytes:
        return self.pieces[token_id]


def cut(data: bytes, offsets: Sequence[int]) -> list[bytes]:
    """`data` cut at the given offsets (any order, repeats and out-of-range ones ignored)."""
    bounds = [0, *sorted({o for o in offsets if 0 < o < len(data)}), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """(start, end, stop string) of the stop completing first in `text`, or None."""
    found = [(text.find(s) + len(s), text.find(s), order, s) for order, s in enumerate(stops) if s in text]
    if not found:
        return None
    end, start, _, stop_str = min(found)
    return start, end, stop_str


def run_steps(pieces: list[bytes], stops: list[str], include: bool,
              group_sizes: list[int]) -> tuple[Request, list[str]]:
    """Generate the tokens `pieces` over steps of `group_sizes` tokens (after a one-token prompt);
    returns the request and each reported text (one per output), checking deltas as it goes."""
    tokenizer = PieceTokenizer([b"Q: ", *pieces])
    ids = list(range(1, tokenizer.vocab_size))
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=len(ids))
    request = Request(request_id="r", prompt_token_ids=[0], sampling_params=params, max_tokens=len(ids),
                      generator=make_generator(0), status=RequestStatus.RUNNING)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, params, [request])
    sizes = iter(group_sizes)
    reported = [""]
    while not request.is_finished:
        step = ids[request.num_output_tokens:][:next(sizes, len(ids))]
        for token_id in step:
            request.append_token(token_id)
        if request.num_output_tokens == len(ids):
            request.finish(FinishReason.LENGTH)  # the scheduler ends it on max_tokens before detokenizing
        for hit in processor.detokenize([request]):
            hit.request.finish(FinishReason.STOP, hit.stop_str)  # the engine finishes it
        [output] = processor.make_outputs()
        [completion] = output.outputs
        assert completion.text == reported[-1] + completion.delta_text  # never taken back
        assert output.finished == request.is_finished
        reported.append(completion.text)
    assert processor.num_unfinished_requests == 0
    return request, reported


@settings(max_examples=examples(300))
@given(
    text=st.text(ALPHABET, min_size=1, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    offsets=st.lists(st.integers(1, 120), max_size=40),
    group_sizes=st.lists(st.integers(1, 6), max_size=60),
)
@example(text="abcd", stops=["abcd", "bc"], include=False, offsets=[], group_sizes=[])  # ends first, starts later
@example(text="abcd", stops=["abcd", "bc"], include=False, offsets=[1, 2, 3], group_sizes=[])
def test_stop_string_output_does_not_depend_on_token_boundaries(text, stops, include, offsets, group_sizes):
    data = text.encode()
    pieces = cut(data, offsets)
    request, reported = run_steps(pieces, stops, include, group_sizes)
    match = first_stop(text, stops)
    if match is None:
        expected_text, num_tokens, reason, stop_reason = text, len(pieces), FinishReason.LENGTH, None
    else:
        start, end, stop_str = match
        expected_text = text[:end] if include else text[:start]
        # the token holding the stop string's last byte is the last one kept
        ends = list(accumulate(len(p) for p in pieces))
        num_tokens = next(i for i, e in enumerate(ends, 1) if e >= len(text[:end].encode()))
        reason, stop_reason = FinishReason.STOP, stop_str
    assert reported[-1] == expected_text
    assert all(expected_text.startswith(r) for r in reported)
    assert request.output_token_ids == list(range(1, num_tokens + 1))  # tokens past the stop dropped
    assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)


@settings(max_examples=examples(100))
@given(
    before=st.text(ALPHABET, max_size=12), stop=st.text(ALPHABET, min_size=1, max_size=5),
    after=st.text(ALPHABET, max_size=12), offsets=st.lists(st.integers(1, 120), max_size=40),
    group_sizes=st.lists(st.integers(1, 6), max_size=60),
)
def test_a_single_stop_string_cuts_at_its_first_occurrence(before, stop, after, offsets, group_sizes):
    text = before + stop + after
    _, reported = run_steps(cut(text.encode(), offsets), [stop], False, group_sizes)
    assert reported[-1] == text[:text.find(stop)]
