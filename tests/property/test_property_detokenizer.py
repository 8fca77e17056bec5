"""Property tests of the incremental detokenizer: for any token ids (specials, bytes that split or
break UTF-8 characters) fed in any grouping after any prompt, the emitted pieces plus `flush()`
join to the full decode of the same ids, both ways of skip_special_tokens; and no piece before the
flush ends in U+FFFD (it could still become a character).

Run long with VLLMLITE_HYPOTHESIS_EXAMPLES=N (see tests/property_util.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_util import examples, smollm2_tokenizer

from vllmlite.tokenizer import ByteTokenizer, Tokenizer
from vllmlite.tokenizer.detokenizer import IncrementalDetokenizer

BYTES = ByteTokenizer()

# Byte ids biased towards UTF-8 lead and continuation bytes, so characters are split and broken.
_UTF8_PIECES = st.sampled_from(list("aé€😀".encode()) + [0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0xF4, 0xFF])
BYTE_IDS = st.lists(st.one_of(st.integers(0, BYTES.vocab_size - 1), _UTF8_PIECES), max_size=40)


def assert_pieces_join_to_decode(tokenizer: Tokenizer, prompt: list[int], output: list[int],
                                 group_sizes: list[int], skip: bool) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces, start = [], 0
    for size in group_sizes:
        if start >= len(output):
            break
        group = output[start:start + size]
        delta = detok.add_tokens(group)
        assert delta.stop_str is None and delta.num_tokens_used == len(group)
        pieces.append(delta.text)
        start += size
    if start < len(output):
        pieces.append(detok.add_tokens(output[start:]).text)
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.output_text == tokenizer.decode(output, skip_special_tokens=skip)
    assert detok.flush() == ""  # nothing is released twice


@settings(max_examples=examples(300))
@given(prompt=BYTE_IDS, output=BYTE_IDS, group_sizes=st.lists(st.integers(1, 5), max_size=40), skip=st.booleans())
def test_byte_tokenizer_pieces_join_to_full_decode(prompt, output, group_sizes, skip):
    assert_pieces_join_to_decode(BYTES, prompt, output, group_sizes, skip)


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def smollm2_partial_ids(smollm2) -> list[int]:
    """Ids whose bytes are not UTF-8 on their own (pieces of characters), plus the specials."""
    return [i for i in range(600) if "\ufffd" in smollm2.decode([i]) or i in smollm2.special_token_ids]


@pytest.mark.real_model
@settings(max_examples=examples(150))
@given(data=st.data(), group_sizes=st.lists(st.integers(1, 5), max_size=40), skip=st.booleans())
def test_smollm2_pieces_join_to_full_decode(smollm2, smollm2_partial_ids, data, group_sizes, skip):
    ids = st.lists(st.one_of(st.integers(0, smollm2.vocab_size - 1), st.sampled_from(smollm2_partial_ids)),
                   max_size=30)
    assert_pieces_join_to_decode(smollm2, data.draw(ids), data.draw(ids), group_sizes, skip)


@pytest.mark.real_model
@settings(max_examples=examples(100))
@given(text=st.text(), group_sizes=st.lists(st.integers(1, 5), max_size=40))
def test_smollm2_streams_encoded_text_back_exactly(smollm2, text, group_sizes):
    output = smollm2.encode(text, add_special_tokens=False)
    assert_pieces_join_to_decode(smollm2, smollm2.encode("<|im_start|>assistant\n"), output, group_sizes, True)
