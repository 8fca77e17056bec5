"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's output split into its
reasoning, sent as the message's `reasoning`, and the answer, sent as `content`.

One parser per choice reads the text as it streams; a tag cut across tokens (`</th` + `ink>`) is held
back until it is known, so the deltas add up to what the whole text gives. Owns the tag formats;
knows nothing of HTTP, the engine or tool calls (the caller parses calls in the content).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllmlite.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its reasoning. `opened_by_template`: the chat template already wrote
    the start tag (DeepSeek R1, Qwen3), so the output starts inside the reasoning and a start tag
    the model writes itself is dropped; else reasoning starts at a start tag, anywhere in the
    output, or only at its very beginning when `starts_output`."""

    start_tags: tuple[str, ...]
    end_tags: tuple[str, ...]
    opened_by_template: bool = False
    starts_output: bool = False
    thinking_switch: str | None = None  # the chat_template_kwargs flag that turns thinking off when false

    def is_special_in(self, tokenizer: Tokenizer) -> bool:
        """Whether a tag is a special token of `tokenizer` (Mistral's `[THINK]`): then the output
        must be decoded with its special tokens, or the parser never sees the tag."""
        return any(tokenizer.find_special_text(tag) is not None for tag in self.start_tags + self.end_tags)


_THINK = ReasoningFormat(("<think>",), ("</think>",), opened_by_template=True)
REASONING_FORMATS = {
    "deepseek_r1": _THINK,
    "qwen3": replace(_THINK, thinking_switch="enable_thinking"),
    # Granite 3.2 writes phrases, not tags; vLLM accepts "Here's" too.
    "granite": ReasoningFormat(("Here is my thought process:", "Here's my thought process:"),
                               ("Here is my response:", "Here's my response:"), starts_output=True),
    "mistral": ReasoningFormat(("[THINK]",), ("[/THINK]",)),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format `--reasoning-parser name` names (None: no parsing); ValueError listing the known
    names for any other."""
    if name is None:
        return None
    if name not in REASONING_FORMATS:
        raise ValueError(f"reasoning parser {name!r} is not known; choose one of {sorted(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]


@dataclass
class ReasoningDelta:
    """What one piece of output adds: to the reasoning, and to the answer."""

    reasoning: str = ""
    content: str = ""


class _Phase(enum.Enum):
    BEFORE = "before"        # no reasoning yet: text is content, a start tag opens reasoning
    REASONING = "reasoning"  # until an end tag
    CONTENT = "content"      # the answer: no more tags are read


class ReasoningParser:
    """Splits one choice's output as it arrives: `feed` each delta, then `finish` once.

    >>> parser = ReasoningParser(REASONING_FORMATS["deepseek_r1"])
    >>> parser.feed("Paris is in France.</th")
    ReasoningDelta(reasoning='Paris is in France.', content='')
    >>> parser.feed("ink>Paris.")
    ReasoningDelta(reasoning='', content='Paris.')
    """

    def __init__(self, spec: ReasoningFormat, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self._spec = spec
        self._pending = ""  # text held back: it may be the start of a tag
        self._dropped_start = False
        thinking = spec.thinking_switch is None or (template_kwargs or {}).get(spec.thinking_switch, True) is not False
        if not thinking:  # the template closed the reasoning itself (Qwen3's empty think block)
            self._phase = _Phase.CONTENT
        else:
            self._phase = _Phase.REASONING if spec.opened_by_template else _Phase.BEFORE
        self.has_reasoning = self._phase is _Phase.REASONING

    def feed(self, text: str) -> ReasoningDelta:
        """The reasoning and content that `text`, appended to the output so far, makes certain."""
        self._pending += text
        delta = ReasoningDelta()
        while self._pending and self._step(delta, final=False):
            pass
        return delta

    def finish(self) -> ReasoningDelta:
        """What was held back, at the end of the output (an unclosed reasoning stays reasoning)."""
        delta = ReasoningDelta()
        while self._pending and self._step(delta, final=True):
            pass
        return delta

    def _step(self, delta: ReasoningDelta, final: bool) -> bool:
        """Consume what can be decided of the pending text; False when the rest must wait."""
        if self._phase is _Phase.CONTENT:
            delta.content += self._take(len(self._pending))
            return False
        if self._phase is _Phase.BEFORE and self._spec.starts_output:
            return self._step_at_start(delta, final)
        tags = self._spec.start_tags if self._phase is _Phase.BEFORE else self._spec.end_tags
        if self._phase is _Phase.REASONING and self._spec.opened_by_template and not self._dropped_start:
            tags = tags + self._spec.start_tags
        found = _first_tag(self._pending, tags)
        if found is None:  # emit all but a tail that may begin a tag
            keep = 0 if final else _partial_tag_length(self._pending, tags)
            self._emit(delta, self._take(len(self._pending) - keep))
            return False
        index, tag = found
        self._emit(delta, self._take(index))
        self._take(len(tag))
        if tag in self._spec.start_tags and self._phase is _Phase.REASONING:
            self._dropped_start = True  # the model opened the block the template had opened
        else:
            self._phase = _Phase.REASONING if self._phase is _Phase.BEFORE else _Phase.CONTENT
            self.has_reasoning = True
        return True

    def _step_at_start(self, delta: ReasoningDelta, final: bool) -> bool:
        """A format whose reasoning, if any, opens the output: wait while the output could still be
        a start tag, then read on as reasoning or, for good, as content."""
        tag = next((t for t in self._spec.start_tags if self._pending.startswith(t)), None)
        if tag is not None:
            self._take(len(tag))
            self._phase, self.has_reasoning = _Phase.REASONING, True
            return True
        if not final and any(t.startswith(self._pending) for t in self._spec.start_tags):
            return False
        self._phase = _Phase.CONTENT
        return True

    def _emit(self, delta: ReasoningDelta, text: str) -> None:
        if self._phase is _Phase.REASONING:
            delta.reasoning += text
        else:
            delta.content += text

    def _take(self, length: int) -> str:
        taken, self._pending = self._pending[:length], self._pending[length:]
        return taken


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest (index, tag) of `tags` in `text`, the longest tag on a tie; None if none is."""
    found = [(text.find(tag), -len(tag), tag) for tag in tags if tag in text]
    if not found:
        return None
    index, _, tag = min(found)
    return index, tag


def _partial_tag_length(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (0 if none does).

    >>> _partial_tag_length("so </thi", ("</think>",))
    5
    """
    return max((n for tag in tags for n in range(1, min(len(tag), len(text) + 1)) if text.endswith(tag[:n])),
               default=0)


def split_reasoning(spec: ReasoningFormat, text: str,
                    template_kwargs: Mapping[str, Any] | None = None) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output; reasoning None when the output has none.

    >>> split_reasoning(REASONING_FORMATS["mistral"], "[THINK]2+2=4[/THINK]4")
    ('2+2=4', '4')
    """
    parser = ReasoningParser(spec, template_kwargs)
    head, tail = parser.feed(text), parser.finish()
    reasoning = head.reasoning + tail.reasoning
    return (reasoning if parser.has_reasoning else None), head.content + tail.content
