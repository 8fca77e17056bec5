"""Progress bars where a person waits, with tqdm: loading and converting weights, compiling kernels
(LLM.generate and the benchmarks use tqdm directly).

Owns one convention: a bar shows only when stderr is a terminal (tqdm's `disable=None`), so server
logs, pipes and CI stay clean; `TQDM_DISABLE=1` hides them on a terminal too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """`items`, with a bar named `desc` on a terminal."""
    return iter(tqdm(items, desc=desc, total=total, unit=unit, disable=None, dynamic_ncols=True))
