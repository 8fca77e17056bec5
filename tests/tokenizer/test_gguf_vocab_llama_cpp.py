"""GGUF vocabularies against llama.cpp's own tokenizer tests: each models/ggml-vocab-*.gguf that has
.inp/.out cases, read and compared as llama.cpp's tests/test-tokenizer-0.cpp does (cases split on
"\\n__ggml_vocab_test__\\n", ids from add_special=false, parse_special=false), plus the round trip
decode(encode(x)) == x. A vocabulary of a tokenizer type we do not build must be refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import skip_unless_ci
from llama_cpp_source import llama_cpp_source

from vllmlite.tokenizer import HFTokenizer, read_gguf_fields

# Every vocabulary with test cases in llama.cpp's tree, by the name in ggml-vocab-<name>.gguf.
EXACT = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm",
         "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
# Refused: bert-bge has cases, nomic-bert-moe none.
REFUSED = {"bert-bge": "'bert' \\(WordPiece\\) is not supported", "nomic-bert-moe": "'t5' \\(Unigram"}
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"
ADDS_BOS = {"llama-spm", "phi-3", "gemma-4", "llama-bpe", "command-r", "deepseek-coder", "deepseek-llm"}
# The token texts llama.cpp's vocabulary loader marks end of generation.
LLAMA_CPP_EOG = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                 "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                 "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<\uff5cend\u2581of\u2581sentence\uff5c>")


def vocab_path(name: str) -> Path:
    tree = llama_cpp_source()
    if tree is None:
        skip_unless_ci("llama.cpp's vocabulary files are not available")
    return tree / "models" / f"ggml-vocab-{name}.gguf"


def load_fields(name: str) -> dict:
    return read_gguf_fields(vocab_path(name), prefix="")  # all fields, as the loader reads them


def read_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """test-tokenizer-0.cpp's read_tests: .inp cut on the separator (the text after the last one is a
    case too, unless empty), .out one stripped line of space-separated ids per case."""
    raw = Path(f"{vocab}.inp").read_bytes().decode("utf-8")
    inputs, start = [], 0
    while start < len(raw):
        end = raw.find(CASE_SEPARATOR, start)
        if end < 0:
            inputs.append(raw[start:])
            break
        inputs.append(raw[start:end])
        start = end + len(CASE_SEPARATOR)
    lines = Path(f"{vocab}.out").read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{vocab}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(text, [int(token) for token in line.split()]) for text, line in zip(inputs, lines)]


def test_every_llama_cpp_vocabulary_with_cases_is_covered():
    with_cases = {path.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
                  for path in (vocab_path("x").parent).glob("ggml-vocab-*.gguf.inp")}
    assert with_cases == {*EXACT, "bert-bge"}


def test_case_reader_matches_llama_cpp_format():
    cases = read_cases(vocab_path("llama-spm"))
    assert len(cases) > 40
    assert ("", []) in cases  # an empty case tokenizes to nothing
    assert all("__ggml_vocab_test__" not in text for text, _ in cases)


@pytest.fixture(scope="module", params=EXACT)
def vocabulary(request) -> tuple[str, HFTokenizer]:
    """One vocabulary, read once for all its tests."""
    return request.param, HFTokenizer.from_gguf_fields(load_fields(request.param))


def test_vocabulary_tokenizes_like_llama_cpp(vocabulary):
    name, tok = vocabulary
    cases = read_cases(vocab_path(name))
    # parse_special=false: control tokens' text is plain text, user-defined tokens still cut it.
    got = [tok.encode_with_plain_spans(text, [(0, len(text))]) for text, _ in cases]
    wrong = [(text, want, ids) for (text, want), ids in zip(cases, got) if ids != want]
    first = "" if not wrong else f"; first: {wrong[0][0]!r} expected {wrong[0][1]} got {wrong[0][2]}"
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} cases differ{first}"


def test_vocabulary_round_trips_its_cases(vocabulary):
    name, tok = vocabulary
    texts = [text for text, _ in read_cases(vocab_path(name))]
    wrong = [text for text in texts if tok.decode(tok.encode(text), skip_special_tokens=True) != text]
    assert not wrong, f"{name}: {len(wrong)} of {len(texts)} cases do not round-trip; first: {wrong[0]!r}"


@pytest.mark.parametrize("name", ["aquila", "baichuan", "gpt-neox"])
def test_vocabulary_without_cases_builds_and_round_trips(name):
    # aquila and gpt-neox name no pre-tokenizer (llama.cpp's "default" regexes); baichuan is SentencePiece.
    tok = HFTokenizer.from_gguf_fields(load_fields(name))
    text = "Hello, y'all! 1314151 天～ 🦙\n\t  end"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and tok.decode(ids) == text


@pytest.mark.parametrize("name, message", REFUSED.items())
def test_unsupported_vocabulary_is_refused_naming_supported_models(name, message):
    with pytest.raises(ValueError, match=f"{message}.*supported tokenizer.ggml.model values are 'gpt2', 'llama'"):
        HFTokenizer.from_gguf_fields(load_fields(name))


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_sentencepiece_every_token_round_trips(name):
    # llama.cpp's tests/test-tokenizer-1-spm.cpp: each token's text, tokenized with special tokens
    # parsed, decodes back to that text. Byte tokens that are not UTF-8 alone are left out.
    tok = HFTokenizer.from_gguf_fields(load_fields(name))
    texts = [tok.decode([token_id]) for token_id in range(tok.vocab_size)]
    texts = [text for text in texts if "\ufffd" not in text]
    wrong = [text for text in texts if tok.decode(tok.encode(text, add_special_tokens=False)) != text]
    assert len(texts) > 31000
    assert not wrong, f"{name}: {len(wrong)} of {len(texts)} token texts do not round-trip; first: {wrong[0]!r}"


def test_vocabulary_adds_bos_as_llama_cpp_does(vocabulary):
    # SentencePiece adds BOS unless told not to, llama-bpe's family does too, Gemma 4 always; the
    # rest as tokenizer.ggml.add_bos_token says (command-r and deepseek-* set it).
    name, tok = vocabulary
    plain = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == ([tok.bos_token_id, *plain] if name in ADDS_BOS else plain)


def test_vocabulary_stops_at_llama_cpp_end_of_generation_tokens(vocabulary):
    name, tok = vocabulary
    eog = {tok.token_to_id(text) for text in LLAMA_CPP_EOG} & tok.special_token_ids
    assert eog | {tok.eos_token_id} <= tok.stop_token_ids


def test_phi_3_special_tokens_swallow_the_whitespace_after_them():
    # llama.cpp sets RSTRIP on Phi-3's special tokens (general.name "Phi3"), so a chat prompt's
    # newline after "<|user|>" is not tokenized; BOS and <|endoftext|> keep theirs.
    fields = load_fields("phi-3")
    tok = HFTokenizer.from_gguf_fields(fields)
    hi = tok.encode("Hi", add_special_tokens=False)
    assert tok.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", add_special_tokens=False) == [32010, *hi, 32007, 32001]
    assert tok.encode("<s> Hi", add_special_tokens=False) == [1, *tok.encode(" Hi", add_special_tokens=False)]
    plain = HFTokenizer.from_gguf_fields({key: value for key, value in fields.items() if key != "general.name"})
    assert plain.encode("<|user|>\nHi", add_special_tokens=False)[:2] == [32010, tok.encode("\n", add_special_tokens=False)[0]]
