"""Real models' chat templates (every one llama.cpp ships) render in our sandbox exactly as
transformers renders them, for every conversation in tests/goldens/chat_templates.json (made by
tools/make_template_goldens.py); where transformers raises, we refuse with a ValueError too. The
goldens hold the expected text of issue 32's families, and a SHA-256 of it for the others."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

import pytest
from conftest import skip_unless_ci
from llama_cpp_source import llama_cpp_source
from paths import GOLDENS

from vllmlite.tokenizer import chat_template
from vllmlite.tokenizer.chat_template import render_chat_template

GOLDEN = json.loads((GOLDENS / "chat_templates.json").read_text(encoding="utf-8"))


class _FrozenDatetime(datetime):
    """The clock the goldens were rendered at (strftime_now writes today's date)."""

    @classmethod
    def now(cls, tz=None):
        return cls.fromisoformat(GOLDEN["fixed_now"])


def _template(name: str) -> str:
    source = llama_cpp_source()
    if source is None:
        skip_unless_ci("llama.cpp's templates are not available")
    text = (source / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN["templates"][name]["sha256"], \
        "the template changed since the goldens were made: run tools/make_template_goldens.py"
    return text


def _render(template: str, case: dict, variables: dict) -> str:
    conversation = GOLDEN["conversations"][case["conversation"]]
    return render_chat_template(template, conversation["messages"], case["add_generation_prompt"],
                                GOLDEN["bos_token"], GOLDEN["eos_token"], conversation["tools"], variables)


FULL = sorted(name for name, entry in GOLDEN["templates"].items() if "cases" in entry)
DIGESTED = sorted(name for name, entry in GOLDEN["templates"].items() if "results_sha256" in entry)


def _result(template: str, case: dict, variables: dict) -> str | None:
    """Our rendering, or None where the sandbox refuses (as a ValueError, never anything else)."""
    try:
        return _render(template, case, variables)
    except ValueError as error:
        assert "chat template failed to render" in str(error)
        return None


@pytest.mark.parametrize("name", FULL)
def test_issue_32_template_renders_as_transformers(name, monkeypatch):
    monkeypatch.setattr(chat_template, "datetime", _FrozenDatetime)
    template = _template(name)
    mismatches, num_rendered = [], 0
    for case in GOLDEN["templates"][name]["cases"]:
        for variables in case["variants"]:
            got = _result(template, case, variables)
            num_rendered += got is not None
            if got != case.get("text"):  # no text: transformers raised, and so must we
                mismatches.append(((case["conversation"], case["add_generation_prompt"], variables), got,
                                   case.get("text", case.get("error"))))
    assert num_rendered > 0 and mismatches == []


@pytest.mark.parametrize("name", DIGESTED)
def test_every_other_llama_cpp_template_renders_as_transformers(name, monkeypatch):
    """The same cases; the goldens hold one SHA-256 over all the results (to stay small), so a
    mismatch names only the template."""
    monkeypatch.setattr(chat_template, "datetime", _FrozenDatetime)
    template = _template(name)
    entry = GOLDEN["templates"][name]
    results = [_result(template, {"conversation": conversation, "add_generation_prompt": add}, variables)
               for conversation in entry["conversations"] for add in (True, False) for variables in entry["variants"]]
    assert hashlib.sha256(json.dumps(results, ensure_ascii=False).encode()).hexdigest() == entry["results_sha256"]


def test_goldens_cover_issue_32_families():
    """Each family has a plain conversation rendered, thinking templates are checked with
    enable_thinking on and off, and templates with a tools section with a call and its result."""
    templates = {name: GOLDEN["templates"][name] for name in FULL}
    assert len(templates) == 23 and len(DIGESTED) >= 47
    for name, entry in templates.items():
        rendered = {c["conversation"] for c in entry["cases"] if "text" in c}
        assert rendered & {"plain", "system", "tools"}, name
    thinking = [n for n, e in templates.items() if any(any(c["variants"]) for c in e["cases"])]
    assert {"Qwen-Qwen3-0.6B", "Qwen3.5-4B", "HuggingFaceTB-SmolLM3-3B", "google-gemma-4-31B-it"} <= set(thinking)
    with_tools = {n for n, e in templates.items() if any(c["conversation"] == "tools" for c in e["cases"])}
    assert {"meta-llama-Llama-3.1-8B-Instruct", "Qwen3-Coder", "mistralai-Mistral-Nemo-Instruct-2407",
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "openai-gpt-oss-120b"} <= with_tools
