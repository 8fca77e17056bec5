"""SamplingParams: how one request wants its tokens chosen, validated at construction.

Owns the OpenAI/vLLM sampling knobs, their defaults and their bounds. Knows nothing of models,
tokenizers or numpy; `verify(vocab_size)` is the only check that needs the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_N = 128  # n and best_of: each one forks a sequence, so hostile input must not fork millions
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
PENALTY_BOUND = 2.0  # presence_penalty and frequency_penalty live in [-2, 2]
LOGIT_BIAS_BOUND = 100.0
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


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


@dataclass(frozen=True)
class SamplingParams:
    """Validated, normalized sampling knobs with vLLM's defaults; immutable.

    To change a field, use `dataclasses.replace(params, max_tokens=...)`, which validates again.
    After construction: `stop` and `stop_token_ids` are lists (possibly empty), `top_k` is None
    or >= 1, `logit_bias` is None or a dict with int keys, every float field is a finite float.
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

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_penalties()
        self._validate_filters()
        self._validate_stops()
        self._validate_outputs()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalization inside a frozen dataclass

    def _validate_counts(self) -> None:
        self._set("n", _int("n", self.n, 1, MAX_N))
        best_of = _optional_int("best_of", self.best_of, 1, MAX_N)
        if best_of is not None and best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={best_of} and n={self.n}")
        self._set("best_of", best_of)
        self._set("seed", _optional_int("seed", self.seed, SEED_MIN, SEED_MAX))

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            self._set(name, _float_in(name, getattr(self, name), -PENALTY_BOUND, PENALTY_BOUND))
        repetition = _float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition}")
        self._set("repetition_penalty", repetition)
        self._set("logit_bias", _logit_bias(self.logit_bias))

    def _validate_filters(self) -> None:
        self._set("temperature", _float_in("temperature", self.temperature, 0.0, 2.0))
        top_p = _float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self._set("top_p", top_p)
        self._set("min_p", _float_in("min_p", self.min_p, 0.0, 1.0))
        top_k = self.top_k
        if top_k is not None:
            top_k = _int("top_k", top_k)
            if top_k < -1:
                raise ValueError(f"top_k must be None, -1, 0 or >= 1, got {top_k}")
            top_k = None if top_k in (0, -1) else top_k  # vLLM spells "off" as 0 or -1
        self._set("top_k", top_k)

    def _validate_stops(self) -> None:
        self._set("stop", _stop_strings(self.stop))
        self._set("stop_token_ids", _token_id_list("stop_token_ids", self.stop_token_ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            self._set(name, _bool(name, getattr(self, name)))

    def _validate_outputs(self) -> None:
        max_tokens = _optional_int("max_tokens", self.max_tokens, 1)
        min_tokens = _int("min_tokens", self.min_tokens, 0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")
        self._set("max_tokens", max_tokens)
        self._set("min_tokens", min_tokens)
        self._set("logprobs", _optional_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        prompt_logprobs = _optional_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self._set("prompt_logprobs", prompt_logprobs)

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError if a token id (logit_bias key, stop_token_ids) is outside the vocab."""
        vocab_size = _int("vocab_size", vocab_size, 1)
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"stop_token_ids: token id {token_id} is outside the vocabulary "
                                 f"[0, {vocab_size})")
        for token_id in self.logit_bias or {}:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is outside the vocabulary "
                                 f"[0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below 1e-5, as in vLLM) means argmax: top-k/p and min-p are moot."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine samples for this request: best_of if set, else n."""
        return self.n if self.best_of is None else self.best_of
