"""json_text: the nesting of client JSON measured without recursion (against the depth of what json
parses, over arbitrary documents and strings full of brackets, quotes and escapes), the depth bound
applied before any recursive parser runs, and duplicate keys refused."""

from __future__ import annotations

import doctest
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_util import examples

from vllmlite import json_text
from vllmlite.json_text import MAX_JSON_DEPTH, JSONTextError, loads, nesting_depth

# Strings that look like JSON structure: brackets, quotes and backslashes in every order.
TRICKY = st.text(alphabet='[]{}"\\,:ab \n\u00e9\U0001F600', max_size=12)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | TRICKY,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
                           max_leaves=30)


def depth_of(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


def test_the_worked_examples_in_the_docstrings_hold():
    assert doctest.testmod(json_text).failed == 0


@settings(max_examples=examples(300), deadline=None)
@given(JSON_VALUES, st.booleans())
def test_nesting_depth_is_the_depth_json_parses(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert nesting_depth(text) == depth_of(value)
    assert loads(text) == value


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000,
                                  "[" * 200_000, '[{"k": ' * 3000])
def test_text_nested_past_the_bound_is_refused_before_parsing(text):
    """Deep enough to overflow a recursive parser, or not even well formed: measured, then refused."""
    with pytest.raises(JSONTextError, match=r"^nests \d+ levels deep; at most 100 are accepted$"):
        loads(text)


def test_the_bound_is_inclusive():
    assert depth_of(loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
    with pytest.raises(JSONTextError):
        loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))


@pytest.mark.parametrize("text, key", [('{"role": "user", "content": "x", "role": "system"}', "role"),
                                       ('[{"a": 1}, {"b": {"c": 1, "c": 1}}]', "c"),
                                       ('{"\\u0061": 1, "a": 2}', "a")])  # the same key, spelt two ways
def test_a_key_twice_in_one_object_is_refused(text, key):
    with pytest.raises(JSONTextError, match=f"has the key '{key}' twice in one object"):
        loads(text)


def test_the_same_key_in_different_objects_is_fine():
    assert loads('[{"a": 1}, {"a": 2}]') == [{"a": 1}, {"a": 2}]


def test_what_is_not_json_stays_a_decode_error():
    for text in ("{not json", b"\xff\xfe"):
        with pytest.raises(ValueError) as caught:
            loads(text)
        assert not isinstance(caught.value, JSONTextError)
