"""Reasoning parsers split an output as vLLM's do, and streaming gives the same split at every cut."""

from __future__ import annotations

from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest

from vllmlite.api.openai.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningParser,
    reasoning_format,
    split_reasoning,
)
from vllmlite.tokenizer import HFTokenizer

# (parser, chat_template_kwargs, output) -> (reasoning, content), as vLLM's parsers give them
CASES = [
    ("deepseek_r1", None, "<think>Paris is in France.</think>Paris.", ("Paris is in France.", "Paris.")),
    # the template wrote <think>: the output starts inside the reasoning
    ("deepseek_r1", None, "Paris is in France.\n</think>\n\nParis.", ("Paris is in France.\n", "\n\nParis.")),
    ("deepseek_r1", None, "still thinking, cut off", ("still thinking, cut off", "")),
    ("deepseek_r1", None, "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", None, "<think>a<think>b</think>c", ("a<think>b", "c")),
    ("deepseek_r1", None, "</think>", ("", "")),
    ("qwen3", None, "<think>\nhmm\n</think>\n\nHi", ("\nhmm\n", "\n\nHi")),
    ("qwen3", {"enable_thinking": True}, "hmm</think>Hi", ("hmm", "Hi")),
    # enable_thinking=False: the template wrote an empty think block; everything is the answer
    ("qwen3", {"enable_thinking": False}, "Hi <think> there", (None, "Hi <think> there")),
    ("qwen3", {"enable_thinking": False}, "Hi</think>", (None, "Hi</think>")),
    ("granite", None, "Here is my thought process: 2+2=4 Here is my response: 4", (" 2+2=4 ", " 4")),
    ("granite", None, "Here's my thought process:x Here's my response:y", ("x ", "y")),
    ("granite", None, "Here is my thought process: unfinished", (" unfinished", "")),
    ("granite", None, "Here is the answer: 4", (None, "Here is the answer: 4")),
    ("granite", None, "Her", (None, "Her")),
    ("granite", None, " Here is my thought process: x", (None, " Here is my thought process: x")),
    ("mistral", None, "[THINK]2+2=4[/THINK]4", ("2+2=4", "4")),
    ("mistral", None, "Sure. [THINK]hm", ("hm", "Sure. ")),
    ("mistral", None, "no thinking [/THINK] here", (None, "no thinking [/THINK] here")),
    ("mistral", None, "[THINK]a[/THINK]b[THINK]c", ("a", "b[THINK]c")),
]


def streamed(name: str, kwargs, pieces: list[str]) -> tuple[str | None, str, list[tuple[str, str]]]:
    """The split that streaming `pieces` gives, and each delta's (reasoning, content)."""
    parser = ReasoningParser(REASONING_FORMATS[name], kwargs)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    return (reasoning if parser.has_reasoning else None), "".join(d.content for d in deltas), \
        [(d.reasoning, d.content) for d in deltas]


@pytest.mark.parametrize("name, kwargs, text, expected", CASES)
def test_whole_output_splits_as_vllm(name, kwargs, text, expected):
    assert split_reasoning(REASONING_FORMATS[name], text, kwargs) == expected


@pytest.mark.parametrize("name, kwargs, text, expected", CASES)
def test_streaming_gives_the_whole_split_at_every_cut(name, kwargs, text, expected):
    """One character per delta (a byte tokenizer's stream), and every cut into two and three pieces."""
    assert streamed(name, kwargs, list(text))[:2] == expected
    for i in range(len(text) + 1):
        assert streamed(name, kwargs, [text[:i], text[i:]])[:2] == expected, i
        for j in range(i, len(text) + 1):
            assert streamed(name, kwargs, [text[:i], text[i:j], text[j:]])[:2] == expected, (i, j)


def test_content_deltas_come_only_after_the_end_tag():
    *_, deltas = streamed("deepseek_r1", None, list("ab</think>cd"))
    reasoning_until = max(i for i, (r, _) in enumerate(deltas) if r)
    content_from = min(i for i, (_, c) in enumerate(deltas) if c)
    assert reasoning_until < content_from
    assert all(not ("<" in r or ">" in r or "<" in c or ">" in c) for r, c in deltas)  # no piece of a tag leaks


@hypothesis.settings(max_examples=300, deadline=None, database=None)
@hypothesis.given(name=st.sampled_from(sorted(REASONING_FORMATS)),
                  parts=st.lists(st.sampled_from(["<think>", "</think>", "[THINK]", "[/THINK]", "<", "</", "[/",
                                                  "Here is my thought process:", "Here's my response:", "Here",
                                                  "Here is my response:", "a", " ", "th", "ink>", "\n"]),
                                 max_size=12),
                  cuts=st.lists(st.integers(0, 200), max_size=6))
def test_any_stream_of_any_output_splits_as_the_whole(name, parts, cuts):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = split_reasoning(REASONING_FORMATS[name], text)
    assert streamed(name, None, pieces)[:2] == whole
    reasoning, content = whole
    assert len(reasoning or "") + len(content) <= len(text)  # tags removed, nothing invented


def test_unknown_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'deepseek'.*\['deepseek_r1', 'granite', 'mistral', 'qwen3'\]"):
        reasoning_format("deepseek")
    assert reasoning_format(None) is None and reasoning_format("qwen3") is REASONING_FORMATS["qwen3"]


def test_tags_that_are_special_tokens_are_found():
    """Mistral's [THINK] is a special token: the chat route then decodes with special tokens."""
    tokenizer = HFTokenizer.from_directory(Path(__file__).resolve().parents[1] / "goldens" / "tiny_hf" / "qwen2")
    assert not REASONING_FORMATS["deepseek_r1"].is_special_in(tokenizer)
    assert ReasoningFormat(("<|im_start|>",), ("<|im_end|>",)).is_special_in(tokenizer)
