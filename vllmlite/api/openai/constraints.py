"""Which output constraint a request asks for, from the request fields of OpenAI, vLLM and llama.cpp
users: `response_format`, `structured_outputs`, `guided_json/regex/choice/grammar`.

Owns mapping those fields onto one StructuredOutputsParams and the 400s for a bad or doubled
constraint. Knows nothing of tools (api/tool_calls.py adds their grammar) or of the engine.
"""

from __future__ import annotations

import json
import re

from vllmlite.api.errors import APIError, bad_request
from vllmlite.api.openai.protocol_fields import SamplingFields
from vllmlite.api.openai.protocol_tools import ResponseFormat
from vllmlite.structured_output_params import StructuredOutputsParams

# vLLM's older names and llama-server's -> the StructuredOutputsParams field each sets
GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                 ("guided_grammar", "grammar"), ("grammar", "grammar"), ("json_schema", "json"))


def is_constrained(req: SamplingFields) -> bool:
    """Whether the request may constrain its output (by any field, tools included): preparing it
    compiles a grammar."""
    return any(getattr(req, name, None) is not None
               for name in ("response_format", "structured_outputs", "tools", *(n for n, _ in GUIDED_FIELDS)))


def request_constraint(req: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
    """(the field that set it, the constraint), or None for free text. 400 when the constraint is
    invalid (llguidance's message) or when two fields each set one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    _check_structural_tag_shape(req.response_format)
    if req.response_format is not None and req.response_format.type != "text":
        found.append(("response_format", _from_response_format(req)))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", make_constraint("structured_outputs", **fields)))
    for name, kind in GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append((name, make_constraint(name, **{kind: value})))
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} each constrain the output; use one of them",
                          found[1][0])
    return found[0] if found else None


def _from_response_format(req: SamplingFields) -> StructuredOutputsParams:
    response_format = req.response_format
    if response_format.schema_ is not None:  # llama-server's {"type": "json_object", "schema": {...}}
        if response_format.json_schema is not None:
            raise bad_request("send the schema once: response_format.schema or response_format.json_schema",
                              "response_format.schema")
        return make_constraint("response_format.schema", json=response_format.schema_)
    if response_format.type == "json_object":
        return make_constraint("response_format", json_object=True)
    if response_format.type == "structural_tag":  # vLLM's
        fields = response_format.model_dump(include={"structures", "triggers", "format"}, exclude_none=True)
        return make_constraint("response_format", structural_tag=json.dumps({"type": "structural_tag", **fields}))
    if response_format.json_schema is None:
        raise bad_request("response_format.json_schema is required when response_format.type is 'json_schema'",
                          "response_format.json_schema")
    schema = response_format.json_schema.schema_
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return make_constraint("response_format", json_object=True)
    return make_constraint("response_format.json_schema.schema", json=schema)


def _check_structural_tag_shape(response_format: ResponseFormat | None) -> None:
    """A 400 unless a structural_tag response_format has `format`, or `structures` and `triggers` (vLLM's
    two shapes), and another type has none of them."""
    if response_format is None:
        return
    has_legacy = response_format.structures is not None or response_format.triggers is not None
    has_format = response_format.format is not None
    if response_format.type != "structural_tag" and (has_legacy or has_format):
        raise bad_request("response_format's structures, triggers and format belong to type 'structural_tag'",
                          "response_format")
    if response_format.type == "structural_tag" and has_legacy == has_format:
        raise bad_request("a structural_tag response_format takes `format`, or `structures` and `triggers`",
                          "response_format")


def make_constraint(param: str, **fields) -> StructuredOutputsParams:
    """StructuredOutputsParams(**fields), checked to compile; a 400 naming `param` if not."""
    try:
        constraint = StructuredOutputsParams(**fields)
        constraint.verify()
    except (TypeError, ValueError) as error:
        raise as_bad_request(error, param) from error
    return constraint


def as_bad_request(error: Exception, param: str) -> APIError:
    """A constraint's error as a 400 naming the request field it came from (its message names the
    engine's field: "structured_outputs.json is not a valid JSON schema" -> "guided_json is not...")."""
    message = str(error)
    if not param.startswith("structured_outputs"):
        message = re.sub(r"^structured_outputs(\.\w+)?", param, message)
    return bad_request(message, param)
