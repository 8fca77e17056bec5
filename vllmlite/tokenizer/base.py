"""The `Tokenizer` interface: what the engine and the server need of a tokenizer, and the Hugging Face
tokenizer surface user scripts call (`tokenizer(text)`, `batch_decode`, `apply_chat_template`, ...).

Owns the methods every tokenizer shares, written once on top of the abstract ones. Knows no
vocabulary format: HF (hf.py), GGUF (gguf_vocab.py) and bytes (byte.py) implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from numbers import Integral
from typing import Any

from vllmlite.tokenizer.chat_template import render_chat_template


class BatchEncoding(dict):
    """What `tokenizer(text)` returns, as HF's BatchEncoding: `enc["input_ids"]` or `enc.input_ids`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer(ABC):
    """What the engine and the server need from a tokenizer, plus the Hugging Face tokenizer surface
    that vLLM user scripts call on `LLM.get_tokenizer()` (same names, signatures and defaults).

    Invariants: every id in `special_token_ids` and `stop_token_ids` is < `vocab_size`;
    `stop_token_ids` contains `eos_token_id` when that is not None. `vocab_size` counts added tokens
    too (HF's `len(tokenizer)`; HF's own `vocab_size` leaves out added tokens beyond the base vocab).
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    stop_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    chat_template: str | None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text inside it maps to the special ids. BOS is
        prepended only when `add_special_tokens` and the tokenizer's own config adds it.
        Text UTF-8 cannot encode (a lone surrogate such as "\ud800") raises UnicodeEncodeError,
        a ValueError."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; bytes that are not valid UTF-8 become U+FFFD."""

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """One token's text for logprob display, special tokens kept. A token whose bytes are not
        valid UTF-8 on their own reads `bytes:\\xe2\\x80` (literal backslashes, lowercase hex)."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's piece for `token_id` (e.g. "Ġhello" in byte-level BPE); ValueError if
        the id is outside the vocabulary."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary piece `token`, None if the vocabulary has no such piece."""

    def apply_chat_template(
        self,
        conversation: list[dict],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        return_dict: bool = False,
        return_tensors: None = None,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int] | BatchEncoding:
        """The prompt text for `conversation` under the model's template (ChatML when it has none),
        as the server renders it; with `tokenize` (HF's default) its ids, encoded without adding
        special tokens, since the template already writes BOS where the model wants it.

        `chat_template` renders the caller's own template instead, in the same jinja sandbox. `tools`
        reach a template that has a tools section (HF's convention); other keywords are variables the
        template may read (e.g. `enable_thinking=False`), as in HF. Arguments are keyword-only.
        """
        if return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r} is not supported: token ids are python lists")
        text = render_chat_template(
            chat_template if chat_template is not None else self.chat_template,
            conversation, add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
            variables=template_kwargs,
        )
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, add_special_tokens=False)

    def encode_with_plain_spans(self, text: str, plain_spans: Sequence[tuple[int, int]],
                                add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` in which special-token text inside `plain_spans` ((start, end)
        character offsets) is read as plain text, never as the special token.

        Equal to `encode(text, add_special_tokens)` when no special-token text lies in a span.
        A tokenizer that never reads special tokens from text (ByteTokenizer) needs nothing more.
        """
        return self.encode(text, add_special_tokens)

    def find_special_text(self, text: str) -> str | None:
        """The first special token's text found in `text`, or None."""
        return None

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> BatchEncoding:
        """`input_ids` and an all-ones `attention_mask`: lists for one text, lists of lists for a batch."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def __len__(self) -> int:
        return self.vocab_size

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary pieces: one for one id, a list for a list."""
        if isinstance(ids, Integral):
            return self.id_to_token(int(ids))
        return [self.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Ids of vocabulary pieces: one for one piece, a list for a list. An unknown piece gives
        None (HF gives `unk_token_id`, which is None too when the tokenizer has no unknown token)."""
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(token) for token in tokens]

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)


def format_token_bytes(data: bytes) -> str:
    """`data` as UTF-8 text, or the `bytes:\\x..` form when it is not valid UTF-8.

    >>> format_token_bytes(b"hi"), format_token_bytes(b"\\xe2\\x80")
    ('hi', 'bytes:\\\\xe2\\\\x80')
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)
