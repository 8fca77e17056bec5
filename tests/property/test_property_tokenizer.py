"""Property tests of the tokenizers over arbitrary Unicode: NUL, astral characters, combining marks,
special-token names inside plain text, very long strings, and lone surrogates (which a Python str
can hold but UTF-8 cannot encode: every tokenizer refuses them with ValueError).

Run long with VLLMLITE_HYPOTHESIS_EXAMPLES=N (see tests/property_util.py).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from property_util import examples, smollm2_tokenizer

from vllmlite.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer, Tokenizer, bytes_to_unicode

BYTES = ByteTokenizer()
SMOLLM2_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>")
SPECIAL_NAMES = (*BYTE_SPECIAL_TOKENS.values(), *SMOLLM2_SPECIALS)

# Characters hypothesis rarely picks on its own, weighted in: NUL and control bytes, combining marks,
# astral characters (emoji, 4-byte UTF-8), whitespace runs, and the byte-level BPE alphabet's
# stand-ins ("Ġ" is how GPT-2 spells a space inside its vocabulary).
_AWKWARD = st.one_of(
    st.sampled_from(["\x00", "\x01", "\x7f", "\r\n", "\t", " ", "  ", "\u200d", "\ufeff", "\ufffd", "Ġ", "Ċ"]),
    st.characters(categories=["Mn", "Mc", "Me"]),  # combining marks, alone or stacked
    st.characters(min_codepoint=0x10000),           # astral
)
TEXT = st.lists(st.one_of(st.text(max_size=8), _AWKWARD), max_size=30).map("".join)
LONG_TEXT = st.builds(lambda piece, times: piece * times, TEXT.filter(bool), st.integers(200, 3000))


def assert_round_trip(tokenizer: Tokenizer, text: str, expected: str | None = None) -> None:
    """decode(encode(text)) == text (or `expected`); ids in range; add_special_tokens only adds specials."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (text if expected is None else expected)
    # add_special_tokens only ever prepends/appends the tokenizer's own special ids
    with_specials = tokenizer.encode(text, add_special_tokens=True)
    starts = [k for k in range(len(with_specials) - len(ids) + 1) if with_specials[k:k + len(ids)] == ids]
    assert starts, "add_special_tokens changed the text's own ids"
    extra = with_specials[:starts[0]] + with_specials[starts[0] + len(ids):]
    assert set(extra) <= tokenizer.special_token_ids


def with_surrogate(text: str, surrogate: str, position: int) -> str:
    position %= len(text) + 1
    return text[:position] + surrogate + text[position:]


# ---- the byte tokenizer (the tiny test model's) ----

@settings(max_examples=examples(200))
@given(text=st.one_of(TEXT, st.text()))
@example(text="\x00")
@example(text="e\u0301\U0001f469\u200d\U0001f4bb")
def test_byte_tokenizer_round_trips_any_text(text):
    assert_round_trip(BYTES, text)
    assert BYTES.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))


@settings(max_examples=examples(10))
@given(text=LONG_TEXT)
def test_byte_tokenizer_round_trips_long_text(text):
    assert_round_trip(BYTES, text)


@settings(max_examples=examples(100))
@given(parts=st.lists(st.one_of(TEXT, st.sampled_from(SPECIAL_NAMES)), max_size=6))
def test_byte_tokenizer_never_makes_special_ids_from_text(parts):
    text = "".join(parts)
    ids = BYTES.encode(text, add_special_tokens=False)
    assert all(i < 256 for i in ids)  # "<|bos|>" in text is seven bytes, not BOS
    assert BYTES.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=examples(100))
@given(text=TEXT, surrogate=st.characters(categories=["Cs"]), position=st.integers(0, 1 << 16))
def test_byte_tokenizer_refuses_lone_surrogates_with_value_error(text, surrogate, position):
    with pytest.raises(ValueError, match="surrogate"):
        BYTES.encode(with_surrogate(text, surrogate, position))


# ---- SmolLM2's byte-level BPE, built from its GGUF ----

@pytest.fixture(scope="module")
def smollm2():
    return smollm2_tokenizer()


def smollm2_expected(tokenizer, text: str) -> str:
    """What SmolLM2 round-trips `text` to. Its vocabulary lacks 21 of the 256 byte tokens (control
    bytes 04 06 13 14 16 1D; F1 and F2, which lead planes 4-11, unassigned; and bytes UTF-8 never
    uses); as in transformers and HF tokenizers, such bytes are dropped, so "\U00040000" (F1 80 80
    80) decodes to three U+FFFD. Text without them round-trips exactly."""
    missing = _missing_bytes(tokenizer)
    return bytes(b for b in text.encode("utf-8") if b not in missing).decode("utf-8", errors="replace")


def _missing_bytes(tokenizer) -> frozenset[int]:
    spelling = bytes_to_unicode()
    return frozenset(b for b in range(256) if tokenizer.token_to_id(spelling[b]) is None)


@pytest.mark.real_model
def test_smollm2_vocabulary_lacks_only_bytes_no_common_text_uses(smollm2):
    assert _missing_bytes(smollm2) == {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}


@pytest.mark.real_model
@settings(max_examples=examples(200))
@given(text=st.one_of(TEXT, st.text()))
@example(text="\x00")
@example(text="  hello\r\n\t world  \U0001f389e\u0301")
def test_smollm2_round_trips_any_text(smollm2, text):
    assert_round_trip(smollm2, text, smollm2_expected(smollm2, text))
    if not any(name in text for name in SMOLLM2_SPECIALS):
        assert not set(smollm2.encode(text, add_special_tokens=False)) & smollm2.special_token_ids


@pytest.mark.real_model
@settings(max_examples=examples(10))
@given(text=LONG_TEXT)
def test_smollm2_round_trips_long_text(smollm2, text):
    assert_round_trip(smollm2, text, smollm2_expected(smollm2, text))


@pytest.mark.real_model
@settings(max_examples=examples(100))
@given(parts=st.lists(st.one_of(TEXT, st.sampled_from(SMOLLM2_SPECIALS)), max_size=6))
def test_smollm2_special_token_text_maps_to_special_ids(smollm2, parts):
    """As today (and as HF): a special token's name inside plain text encodes to its id; decoding
    with skip_special_tokens drops exactly those names."""
    text = "".join(parts)
    ids = smollm2.encode(text, add_special_tokens=False)
    assert smollm2.decode(ids) == smollm2_expected(smollm2, text)
    specials = [smollm2.token_to_id(p) for p in parts if p in SMOLLM2_SPECIALS]
    assert [i for i in ids if i in smollm2.special_token_ids] == specials
    plain = "".join(p for p in parts if p not in SMOLLM2_SPECIALS)
    assert smollm2.decode(ids, skip_special_tokens=True) == smollm2_expected(smollm2, plain)


@pytest.mark.real_model
@settings(max_examples=examples(100))
@given(text=TEXT, surrogate=st.characters(categories=["Cs"]), position=st.integers(0, 1 << 16))
def test_smollm2_refuses_lone_surrogates_with_value_error(smollm2, text, surrogate, position):
    bad = with_surrogate(text, surrogate, position)
    with pytest.raises(ValueError, match="surrogate"):
        smollm2.encode(bad)
    with pytest.raises(ValueError, match="surrogate"):
        smollm2([text, bad])
