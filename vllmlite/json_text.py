"""JSON text a client wrote (a request body, a schema, a tool call's arguments), parsed safely: its
nesting is measured without recursion before any recursive parser sees it, and a key given twice in
one object is refused instead of the last one silently winning.

Owns the depth bound and the two refusals (JSONTextError); knows nothing of HTTP or of what the
text means.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

# Deeper than any real schema, request or arguments object; shallower than the recursion limits of
# Python's json module (about 1,000 frames) and of llguidance's schema parser (128 with its root).
MAX_JSON_DEPTH = 100

_ESCAPE = re.compile(r"\\.", re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPENING = (ord("["), ord("{"))


class JSONTextError(ValueError):
    """JSON text refused before or while parsing: nested too deep, or a key twice in one object. The
    message completes a sentence about the text ("... nests 5000 levels deep")."""


def nesting_depth(text: str) -> int:
    """How deeply arrays and objects nest in `text`, measured without parsing it (linear, no
    recursion), so text of any depth can be measured. Brackets inside strings do not count.

    >>> nesting_depth('{"a": [1, {"b": "]]\\\\"[["}]}'), nesting_depth('"[["'), nesting_depth("[" * 5000)
    (3, 0, 5000)
    """
    unescaped = _ESCAPE.sub("", text)  # every quote left delimits a string: strings are the odd parts
    brackets = _NOT_BRACKET.sub("", "".join(unescaped.split('"')[::2]))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), np.uint8)  # [num_brackets]
    steps = np.isin(codes, _OPENING).astype(np.int32) * 2 - 1  # [num_brackets]: +1 opens, -1 closes
    return int(np.cumsum(steps, dtype=np.int32).max())


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)` for text a client wrote: JSONTextError if it nests deeper than `max_depth`
    or repeats a key in one object; json.JSONDecodeError (a ValueError) if it is not JSON; bytes must
    be UTF-8 (UnicodeDecodeError, a ValueError, if not).

    >>> loads('{"role": "user", "n": [1, 2]}')
    {'role': 'user', 'n': [1, 2]}
    >>> try:
    ...     loads('{"role": "user", "role": "system"}')
    ... except JSONTextError as error:
    ...     print(error)
    has the key 'role' twice in one object
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    # Nesting never exceeds the number of opening brackets: most bodies need no scan.
    depth = 0 if text.count("[") + text.count("{") <= max_depth else nesting_depth(text)
    if depth > max_depth:
        raise JSONTextError(f"nests {depth} levels deep; at most {max_depth} are accepted")
    return json.loads(text, object_pairs_hook=_unique_keys)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise JSONTextError(f"has the key {repeated!r} twice in one object")
    return value
