"""Structural tags (vLLM's `structural_tag` constraint, in xgrammar's format) as one llguidance grammar.

Owns reading the two shapes vLLM accepts, the legacy `{"structures": [{begin, schema, end}],
"triggers": [...]}` and `{"format": {...}}` with xgrammar's format objects, and writing either as a
Lark grammar: JSON schemas inline (`%json`), EBNF/Lark grammars as named sub-grammars, free text as
lazy lexemes that end at a tag's end or trigger. Knows nothing of tokenizers or requests; a bad or
unsupported spec is a ValueError that says where.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 32  # nested format objects (sequence, or, tag, ...): a bound on recursion
TEXT_RULE = "TEXT: /(.|\\n)*/"
FORMAT_TYPES = ("const_string", "json_schema", "grammar", "regex", "sequence", "or", "tag", "any_text",
                "triggered_tags", "tags_with_separator")


def structural_tag_grammar(spec: str | dict, flexible_whitespace: bool = True) -> str:
    """The llguidance grammar (its JSON form) of a structural tag: JSON text or its dict.

    The legacy shape is xgrammar's `triggered_tags` with JSON-schema contents; free text, then a
    trigger starts a tag whose content must follow its schema, then free text again.

    >>> tag = {"type": "structural_tag", "triggers": ["<f="],
    ...        "structures": [{"begin": "<f=a>", "schema": {"type": "integer"}, "end": "</f>"}]}
    >>> print(json.loads(structural_tag_grammar(tag))["grammars"][0]["lark_grammar"])
    %llguidance {}
    start: ((r2))* TEXT
    TEXT: /(.|\\n)*/
    r0: %json {"type": "integer", "x-guidance": {"whitespace_flexible": true}}
    r1[lazy]: TEXT "<f="
    r2: r1 "a>" r0 ("</f>")
    <BLANKLINE>
    """
    tag = _load(spec)
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag type must be 'structural_tag', got {tag.get('type')!r}")
    fmt = _legacy_format(tag) if "structures" in tag else tag.get("format")
    writer = _LarkWriter(flexible_whitespace)
    start = writer.format(fmt, "format", is_tail=True, depth=0)
    lark = "\n".join(["%llguidance {}", f"start: {start}", TEXT_RULE, *writer.rules, ""])
    return json.dumps({"grammars": [{"lark_grammar": lark}, *writer.subgrammars]})


def _load(spec: str | dict) -> dict:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as error:
            raise ValueError(f"structural_tag is not valid JSON: {error}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be a JSON object")
    return spec


def _legacy_format(tag: dict) -> dict:
    """`{"structures": [...], "triggers": [...]}` as the `triggered_tags` format it means."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag structures must be a non-empty list")
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or set(structure) - {"begin", "schema", "end"}:
            raise ValueError(f"structural_tag structures[{i}] must be an object of begin, schema and end")
        tags.append({"type": "tag", "begin": structure.get("begin"), "end": structure.get("end"),
                     "content": {"type": "json_schema", "json_schema": structure.get("schema", True)}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _literal(text: str) -> str:
    """A Lark string literal: JSON's escapes are Lark's."""
    return json.dumps(text)


class _LarkWriter:
    """Writes format objects as Lark expressions, collecting the rules and sub-grammars they need."""

    def __init__(self, flexible_whitespace: bool) -> None:
        self.flexible_whitespace = flexible_whitespace
        self.rules: list[str] = []
        self.subgrammars: list[dict] = []

    def rule(self, body: str, attributes: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attributes}: {body}")
        return name

    def format(self, fmt: Any, where: str, is_tail: bool, depth: int) -> str:
        """`fmt` as a Lark expression. `is_tail`: nothing follows it in the output (free text may
        only come last, or inside a tag, where its end stops it)."""
        if depth > MAX_DEPTH:
            raise ValueError(f"structural_tag {where}: formats nest deeper than {MAX_DEPTH}")
        if not isinstance(fmt, dict) or fmt.get("type") not in FORMAT_TYPES:
            kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
            raise ValueError(f"structural_tag {where}: format type {kind!r} is not supported "
                             f"(supported: {', '.join(FORMAT_TYPES)})")
        return getattr(self, "_" + fmt["type"])(fmt, where, is_tail, depth + 1)

    def _const_string(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        return _literal(_string(fmt, "value", where))

    def _json_schema(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        schema = fmt.get("json_schema")
        if schema is True:
            schema = {}  # the schema `true`: any JSON value
        if not isinstance(schema, dict) or fmt.get("style", "json") != "json":
            raise ValueError(f"structural_tag {where}: json_schema must be a JSON schema object (style 'json')")
        schema = {**schema, "x-guidance": {"whitespace_flexible": self.flexible_whitespace,
                                            **schema.get("x-guidance", {})}}
        return self.rule("%json " + json.dumps(schema))

    def _grammar(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        from llguidance.gbnf_to_lark import any_to_lark  # imported here: only constrained requests need it

        name = f"g{len(self.subgrammars)}"
        self.subgrammars.append({"name": name, "lark_grammar": any_to_lark(_string(fmt, "grammar", where))})
        return "@" + name

    def _regex(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        import llguidance

        return "/" + llguidance.regex_to_lark(_string(fmt, "pattern", where)) + "/"

    def _sequence(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        elements = _elements(fmt, where)
        parts = [self.format(e, f"{where}.elements[{i}]", is_tail and i == len(elements) - 1, depth)
                 for i, e in enumerate(elements)]
        return "(" + " ".join(parts) + ")"

    def _or(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        elements = _elements(fmt, where)
        return "(" + " | ".join(self.format(e, f"{where}.elements[{i}]", is_tail, depth)
                                for i, e in enumerate(elements)) + ")"

    def _tag(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        begin = _string(fmt, "begin", where, empty=True)
        body = self._tag_body(fmt, where, depth)
        return f"({_literal(begin)} {body})" if begin else f"({body})"

    def _tag_body(self, fmt: dict, where: str, depth: int) -> str:
        """A tag's content and end (its begin is the caller's to write)."""
        ends = _ends(fmt, where)
        content = fmt.get("content")
        if isinstance(content, dict) and content.get("type") == "any_text":
            _no_excludes(content, f"{where}.content")
            # free text up to the first end: one lazy lexeme, so the text cannot run past it
            body = self.rule("TEXT (" + " | ".join(_literal(e) for e in ends) + ")", "[lazy]")
        else:
            inner = self.format(content, f"{where}.content", is_tail=False, depth=depth)
            end = "(" + " | ".join(_literal(e) for e in ends if e) + ")" if any(ends) else ""
            body = f"{inner} {end}".strip()
        return body

    def _any_text(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        _no_excludes(fmt, where)
        if not is_tail:
            raise ValueError(f"structural_tag {where}: any_text is supported as a tag's content or at the end "
                             "of the output, not before other formats")
        return "TEXT"

    def _triggered_tags(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        """Free text in which each trigger starts one of its tags (a lazy lexeme ends the text at the
        trigger), as llguidance's StructTag writes it; `at_least_one` puts a tag first,
        `stop_after_first` ends the output after one."""
        _no_excludes(fmt, where)
        if not is_tail:
            raise ValueError(f"structural_tag {where}: triggered_tags is supported at the end of the output only")
        triggers = fmt.get("triggers")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"structural_tag {where}: triggers must be a non-empty list of non-empty strings")
        tags = _tags(fmt, where)
        plain, triggered = [], []
        for i, tag in enumerate(tags):
            tag_where = f"{where}.tags[{i}]"
            begin = _string(tag, "begin", tag_where)
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structural_tag {tag_where}: begin {begin!r} starts with none of the triggers")
            body = self._tag_body(tag, tag_where, depth)
            plain.append(f"({_literal(begin)} {body})")
            rest = begin[len(trigger):]
            trigger_rule = self.rule(f"TEXT {_literal(trigger)}", "[lazy]")
            triggered.append(self.rule(f"{trigger_rule} {_literal(rest) + ' ' if rest else ''}{body}"))
        any_plain, any_triggered = "(" + " | ".join(plain) + ")", "(" + " | ".join(triggered) + ")"
        at_least_one, stop_after_first = _flag(fmt, "at_least_one", where), _flag(fmt, "stop_after_first", where)
        if stop_after_first:
            return any_plain if at_least_one else f"({any_triggered} | TEXT)"
        return f"{any_plain if at_least_one else ''} ({any_triggered})* TEXT".strip()

    def _tags_with_separator(self, fmt: dict, where: str, is_tail: bool, depth: int) -> str:
        """Tags and separators only, no other text: one or more (`at_least_one`), else zero or more;
        at most one with `stop_after_first`."""
        any_tag = "(" + " | ".join(self._tag(t, f"{where}.tags[{i}]", False, depth)
                                   for i, t in enumerate(_tags(fmt, where))) + ")"
        separator = fmt.get("separator", "")
        if not isinstance(separator, str):
            raise ValueError(f"structural_tag {where}: separator must be a string")
        if _flag(fmt, "stop_after_first", where):
            many = any_tag
        else:
            many = f"{any_tag} ({_literal(separator) + ' ' if separator else ''}{any_tag})*"
        return f"({many})" if _flag(fmt, "at_least_one", where) else f"({many})?"


def _string(fmt: dict, key: str, where: str, empty: bool = False) -> str:
    value = fmt.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise ValueError(f"structural_tag {where}.{key} must be a{'' if empty else ' non-empty'} string")
    return value


def _ends(fmt: dict, where: str) -> list[str]:
    """A tag's end: a string, or a list of strings any of which ends it."""
    end = fmt.get("end")
    ends = end if isinstance(end, list) else [end]
    if not ends or not all(isinstance(e, str) for e in ends):
        raise ValueError(f"structural_tag {where}.end must be a string or a list of strings")
    return ends


def _elements(fmt: dict, where: str) -> list:
    elements = fmt.get("elements")
    if not isinstance(elements, list) or not elements:
        raise ValueError(f"structural_tag {where}.elements must be a non-empty list")
    return elements


def _tags(fmt: dict, where: str) -> list[dict]:
    tags = fmt.get("tags")
    if not isinstance(tags, list) or not tags:
        raise ValueError(f"structural_tag {where}.tags must be a non-empty list")
    for i, tag in enumerate(tags):
        if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
            raise ValueError(f"structural_tag {where}.tags[{i}] must be a tag (begin, content, end)")
    return tags


def _flag(fmt: dict, key: str, where: str) -> bool:
    value = fmt.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"structural_tag {where}.{key} must be a boolean")
    return value


def _no_excludes(fmt: dict, where: str) -> None:
    if fmt.get("excludes") or fmt.get("excluded_str"):
        raise ValueError(f"structural_tag {where}: excludes are not supported")
