"""StructuredOutputsParams: a constraint on a request's output (vLLM's names), and its grammar text.

Owns the fields, their validation and the translation into an llguidance grammar (a structural tag's
is structural_tag.py's); knows nothing of tokenizers, models or requests. Compiling a grammar against
a vocabulary is structured_output.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vllmlite import json_text

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 16  # a schema (as JSON text), regex, grammar or all choices: bounds compile time

# vLLM fields this implementation refuses when set (they name other backends' features).
_UNSUPPORTED = ("disable_additional_properties", "whitespace_pattern")
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice`
    (the output is one of these strings), `grammar` (Lark, or GBNF/EBNF as llama.cpp writes it),
    `json_object=True` (any JSON object) or `structural_tag` (vLLM's JSON text: free text with
    tags that trigger constrained parts, or xgrammar's format objects; see structural_tag.py).

    >>> StructuredOutputsParams(choice=["yes", "no"]).kind
    'choice'
    >>> StructuredOutputsParams(regex="a", choice=["a"])
    Traceback (most recent call last):
    ...
    ValueError: structured_outputs takes exactly one of json, regex, choice, grammar, json_object, structural_tag; got regex, choice
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False           # one backend, nothing to fall back to: accepted, moot
    disable_any_whitespace: bool = False     # JSON: no whitespace between tokens of the JSON text
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The key verify() last passed: the engine loop re-verifies what the HTTP thread checked, free.
    _verified_key: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _UNSUPPORTED:
            if getattr(self, name):
                raise ValueError(f"structured_outputs.{name} is not supported by vllmlite")
        for name in ("disable_fallback", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a boolean")
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_kinds) or 'none'}")
        self._check_types()
        spec = getattr(self, self.kind)
        size = len(spec) if isinstance(spec, str) else len(json.dumps(spec))
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} has {size} characters; at most {MAX_SPEC_CHARS} "
                             "are accepted")

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the compile cache's key): a schema as a dict or
        as JSON text shares it. Key order is kept, never sorted: a schema's properties are written
        in the order it lists them, as in vLLM."""
        spec: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(spec, str):
            spec = _parse_json(spec)
        text = spec if isinstance(spec, str) else json.dumps(spec)
        return self.kind, text, self.disable_any_whitespace

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) for this constraint; ValueError for JSON text that
        does not parse. Other errors (a bad regex) show when it is verified or compiled."""
        import llguidance  # imported here: only requests with a constraint need it

        kind, spec, no_whitespace = self.key
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            options = {"whitespace_flexible": not no_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json is not a valid JSON schema: {error}") from None
        if kind == "structural_tag":
            from vllmlite.structural_tag import structural_tag_grammar

            try:
                return structural_tag_grammar(spec, flexible_whitespace=not no_whitespace)
            except ValueError as error:
                raise ValueError(f"structured_outputs.structural_tag is invalid: {error}") from None
        fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
        try:
            return llguidance.grammar_from(fmt, spec)
        except ValueError as error:
            raise ValueError(f"structured_outputs.{kind} is invalid: {error}") from None

    def verify(self) -> None:
        """Raise ValueError (a client's error, with llguidance's message) unless the constraint
        compiles. Needs no tokenizer; pure, so the HTTP thread may call it."""
        import llguidance

        key = self.key
        if key == self._verified_key:
            return
        error = llguidance.LLMatcher.validate_grammar(self.grammar_text())
        if error:
            raise ValueError(f"structured_outputs.{self.kind} is invalid: {error.strip()}")
        self._verified_key = key


def _parse_json(text: str) -> Any:
    try:
        return json_text.loads(text)
    except json_text.JSONTextError as error:
        raise ValueError(f"structured_outputs.json {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
