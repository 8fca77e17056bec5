"""SamplingParams: how one request wants its tokens chosen, validated at construction and on clone().

Owns the OpenAI/vLLM sampling knobs, their defaults and their bounds. Knows nothing of models or
numpy; `verify(vocab_size)` is the only check that needs the model, and `update_from_tokenizer()`
the only code that calls a tokenizer (its `encode`, to find the token ids of `bad_words`).
StructuredOutputsParams (vLLM's constraint on the output: a JSON schema, regex, choice or grammar)
lives in structured_output_params.py. BeamSearchParams (vLLM's knobs of `LLM.beam_search`) is here too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllmlite.structured_output_params import StructuredOutputsParams

# Per-request bounds, written once: SamplingParams enforces them, and the API's request models
# (api/openai/protocol_fields.py, protocol_responses.py) declare these same ones, so a request meets
# one rule at either layer. The API may hold a field tighter (its n, its max_tokens), never looser.
MAX_N = 128  # n and best_of: each one forks a sequence, so hostile input must not fork millions
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # logprobs, prompt_logprobs (and chat's top_logprobs): vLLM's bound
MAX_TEMPERATURE = 2.0  # temperature lives in [0, 2]
PENALTY_BOUND = 2.0  # presence_penalty and frequency_penalty live in [-2, 2]
LOGIT_BIAS_BOUND = 100.0
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam scores 2 * beam_width candidates, read as logprobs
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: a length to a larger power can overflow a float
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

# Fields of vLLM's SamplingParams that vllmlite does not implement: passing one is an error, so a
# script written for vLLM is told instead of silently getting different behaviour.
UNSUPPORTED_VLLM_FIELDS = frozenset({
    "guided_decoding", "logits_processors", "output_kind", "extra_args",
    "spaces_between_special_tokens", "skip_clone", "flat_logprobs", "skip_reading_prefix_cache",
    "output_text_buffer_length", "use_beam_search", "length_penalty", "early_stopping",
})
_BEAM_SEARCH_HINT = " (beam search is LLM.beam_search with BeamSearchParams, as in vLLM)"
_UNSUPPORTED_HINTS = MappingProxyType({"guided_decoding": " (use structured_outputs, its current name)",
                                        "use_beam_search": _BEAM_SEARCH_HINT, "length_penalty": _BEAM_SEARCH_HINT})


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Return `value` if it is an int (not a bool) in [lo, hi], else raise naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        low = "-inf" if lo is None else lo
        high = "inf" if hi is None else hi
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _optional_int(name: str, value: Any, lo: int, hi: int | None = None) -> int | None:
    return None if value is None else _int(name, value, lo, hi)


def _float(name: str, value: Any) -> float:
    """Return `value` as a finite float; ints are accepted (JSON `0`), bools and NaN/inf are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _float_in(name: str, value: Any, lo: float, hi: float) -> float:
    value = _float(name, value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    return value


def _stop_strings(value: Any) -> list[str]:
    """None, a str, or a list/tuple of str -> a list of non-empty str (at most 16)."""
    if value is None:
        return []
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(value).__name__}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    for s in strings:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r}")
        if not s:
            raise ValueError("stop must not contain empty strings")
    return list(strings)


def _token_id_list(name: str, value: Any) -> list[int]:
    """None or a list/tuple of non-negative ints -> a list of int."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")
    return [_int(name, token_id, lo=0) for token_id in value]


def _allowed_token_ids(value: Any) -> list[int] | None:
    """None (every token allowed) or a non-empty list of non-negative ints."""
    if value is None:
        return None
    token_ids = _token_id_list("allowed_token_ids", value)
    if not token_ids:
        raise ValueError("allowed_token_ids must not be empty (None allows every token)")
    return token_ids


def _bad_words(value: Any) -> list[str] | None:
    """None, a str, or a list/tuple of str -> None or a list of str with some non-space character."""
    if value is None:
        return None
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {type(value).__name__}")
    for word in words:
        if not isinstance(word, str):
            raise ValueError(f"bad_words must contain only strings, got {word!r}")
        if not word.strip():
            raise ValueError(f"bad_words must not contain empty or blank strings, got {word!r}")
    return list(words)


def _logit_bias_key(key: Any) -> int:
    """JSON object keys arrive as strings: "42" -> 42. Only plain non-negative digits pass."""
    if isinstance(key, str):
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return int(key)
    return _int("logit_bias", key, lo=0)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {value!r}")
    bias: dict[int, float] = {}
    for key, item in value.items():
        token_id = _logit_bias_key(key)
        if token_id in bias:
            raise ValueError(f"logit_bias has token id {token_id} twice")
        bias[token_id] = _float_in("logit_bias", item, -LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND)
    return bias


@dataclass
class SamplingParams:
    """Validated, normalized sampling knobs with vLLM's names and defaults.

    Fields may be assigned after construction, as in vLLM (`params.max_tokens = 64`); the engine
    takes its own copy with `clone()`, which validates and normalizes again, so a bad assignment is
    rejected when the request is added and later assignments never reach a running request.
    After validation: `stop` and `stop_token_ids` are lists (possibly empty), `top_k` is None (off:
    vLLM's 0 and -1 both mean that) or >= 1, `logit_bias` is None or a dict with int keys,
    `allowed_token_ids` and `bad_words` are None or non-empty lists, every float field is a float.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Set by update_from_tokenizer(), never by the caller.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # Runs before the generated __init__, so an unknown keyword gets a message that names it.
        init_fields = {f.name for f in dataclasses.fields(cls) if f.init}
        for name in kwargs:
            if name in UNSUPPORTED_VLLM_FIELDS:
                hint = _UNSUPPORTED_HINTS.get(name, "")
                raise TypeError(f"SamplingParams: {name} is a vLLM field that vllmlite does not support{hint}")
            if name not in init_fields:
                raise TypeError(f"SamplingParams got an unexpected keyword argument {name!r}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_penalties()
        self._validate_filters()
        self._validate_stops()
        self._validate_outputs()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    def _validate_counts(self) -> None:
        self.n = _int("n", self.n, 1, MAX_N)
        self.best_of = _optional_int("best_of", self.best_of, 1, MAX_N)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        self.seed = _optional_int("seed", self.seed, SEED_MIN, SEED_MAX)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _float_in(name, getattr(self, name), -PENALTY_BOUND, PENALTY_BOUND))
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.logit_bias = _logit_bias(self.logit_bias)

    def _validate_filters(self) -> None:
        self.temperature = _float_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _float_in("min_p", self.min_p, 0.0, 1.0)
        if self.top_k is not None:
            top_k = _int("top_k", self.top_k)
            if top_k < -1:
                raise ValueError(f"top_k must be None, -1, 0 or >= 1, got {top_k}")
            self.top_k = None if top_k in (0, -1) else top_k  # vLLM spells "off" as 0 or -1
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _bad_words(self.bad_words)

    def _validate_stops(self) -> None:
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            setattr(self, name, _bool(name, getattr(self, name)))
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True; set detokenize=True "
                             "to use stop")

    def _validate_outputs(self) -> None:
        self.max_tokens = _optional_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.logprobs = _optional_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.prompt_logprobs = _optional_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self.truncate_prompt_tokens = _optional_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)

    def clone(self) -> SamplingParams:
        """An independent copy, validated and normalized again (fields may have been assigned since
        construction); raises ValueError naming the first bad field. Bad words are not tokenized."""
        return dataclasses.replace(self)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Find the token ids of `bad_words` with `tokenizer.encode`, by vLLM's rule.

        Each word is encoded as written (leading spaces stripped) and with one leading space; the
        spaced form counts only if it starts with a different token and has as many tokens (a word
        in mid-text). Byte tokenizer: "ab" -> [[97, 98]] ([32, 97, 98] is longer, so dropped).
        """
        token_ids: list[list[int]] = []
        for word in self.bad_words or ():
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            token_ids.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        self._bad_words_token_ids = token_ids or None

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """One token id sequence per forbidden form of a bad word; None until update_from_tokenizer()."""
        return self._bad_words_token_ids

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError if a token id (stop_token_ids, logit_bias key, allowed_token_ids, or a
        tokenized bad word) is outside the vocab, or if the structured output constraint (a JSON
        schema, regex or grammar) does not compile."""
        if self.structured_outputs is not None:
            self.structured_outputs.verify()
        vocab_size = _int("vocab_size", vocab_size, 1)
        bad_word_ids = [t for ids in self._bad_words_token_ids or () for t in ids]
        for name, token_ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {}),
                                ("allowed_token_ids", self.allowed_token_ids or ()), ("bad_words", bad_word_ids)):
            for token_id in token_ids:
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"{name}: token id {token_id} is outside the vocabulary [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below 1e-5, as in vLLM) means argmax: top-k/p and min-p are moot."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits and nothing else: no penalty, bias, token filter, minimum length
        or logprobs (the sampler would change or report something then)."""
        return (self.is_greedy and not self.needs_penalties and not self.logit_bias and self.allowed_token_ids is None
                and not self.bad_words and self.min_tokens == 0 and self.logprobs is None)

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine samples for this request: best_of if set, else n."""
        return self.n if self.best_of is None else self.best_of


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: the knobs of `LLM.beam_search`, validated at construction.

    `beam_width` beams are kept; each step scores 2 * beam_width candidates per beam (so at most
    MAX_BEAM_WIDTH, as the logprobs bound allows). `length_penalty` divides a beam's cumulative
    logprob by its length to that power (vllmlite.beam_search.get_beam_search_score), at most 10 either
    way (vLLM sets no bound; 4096 ** 10 is still a float, 3 ** 1000 is not). `temperature`
    is accepted as vLLM takes it; candidates are ranked by the model's raw logprobs, as vLLM's engine
    reports them, so it does not change the result. `include_stop_str_in_output` keeps the EOS token
    in a finished beam's tokens.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.beam_width = _int("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.temperature = _float_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.length_penalty = _float_in("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)
