"""Expected renderings of real models' chat templates, from transformers, for
tests/tokenizer/test_template_goldens.py.

Renders llama.cpp's copies of the templates (models/templates/*.jinja, see tests/llama_cpp_source.py)
with transformers' own renderer (`render_jinja_template`, what `apply_chat_template(...,
tokenize=False)` calls) for a fixed set of conversations, and writes the inputs and the expected
text (or the error transformers raised) to tests/goldens/chat_templates.json: in full for the
families of issue 32 (TEMPLATES); for every other template llama.cpp ships, one SHA-256 of all
its cases' results (`digest`), to keep the file small. The clock that
`strftime_now` reads is frozen at FIXED_NOW, as the test freezes ours. Runs only in the reference
venv; the test suite never needs transformers. Regenerate from the repo root with:

    /work/refenv/bin/python tools/make_template_goldens.py

Deterministic: two runs give byte-identical files.
"""

import datetime as datetime_module
import hashlib
import json
import sys
from pathlib import Path

import transformers
from transformers.utils import chat_template_utils

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
from llama_cpp_source import llama_cpp_source  # noqa: E402

OUT = REPO_ROOT / "tests" / "goldens" / "chat_templates.json"
FIXED_NOW = "2026-03-14T09:26:53"
BOS, EOS = "<|bos|>", "<|eos|>"

# The families of issue 32, as llama.cpp names their template files.
TEMPLATES = [
    "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen-QwQ-32B", "Qwen3-Coder", "Qwen3.5-4B",
    "google-gemma-2-2b-it", "google-gemma-4-31B-it", "microsoft-Phi-3.5-mini-instruct",
    "mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
    "mistralai-Ministral-3-14B-Reasoning-2512", "unsloth-mistral-Devstral-Small-2507",
    "HuggingFaceTB-SmolLM3-3B", "ibm-granite-granite-3.3-2B-Instruct", "ibm-granite-granite-4.0",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "openai-gpt-oss-120b",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
CALL = {"id": "call0A1b2", "type": "function",  # 9 characters: Mistral's templates insist
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
USER = {"role": "user", "content": "What's the capital of France? Say \"é\" & <b>."}
ANSWER = {"role": "assistant", "content": "Paris."}
USER_AGAIN = {"role": "user", "content": "And of Italy?"}

# name -> (messages, tools); the messages are what the server hands the renderer (content a
# string, an assistant's call arguments an object), so both renderers get identical inputs.
CONVERSATIONS = {
    "plain": ([USER], None),
    "system": ([SYSTEM, USER], None),
    "multi_turn": ([SYSTEM, USER, ANSWER, USER_AGAIN], None),
    "reasoning_history": ([USER, {"role": "assistant", "content": "Paris.", "reasoning": "The user asks; it is Paris."},
                           USER_AGAIN], None),
    "reasoning_last": ([USER, {"role": "assistant", "content": "Paris.", "reasoning": "It is Paris."}], None),
    "tools": ([SYSTEM, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [CALL]},
               {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": CALL["id"], "name": "get_weather"}],
              TOOLS),
    "reasoning_tools": ([{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "reasoning": "I should call get_weather.",
                          "tool_calls": [CALL]},
                         {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": CALL["id"]}], TOOLS),
}


class FrozenDatetime(datetime_module.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls.fromisoformat(FIXED_NOW)


def render(template: str, messages: list, tools: list | None, add_generation_prompt: bool, variables: dict) -> dict:
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[messages], tools=tools, chat_template=template,
            add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS, **variables)
    except Exception as error:  # the test expects our renderer to refuse the same case
        return {"error": f"{type(error).__name__}: {error}"}
    return {"text": rendered[0]}


def cases(template: str) -> list[dict]:
    """Every conversation (those with tools only where the template reads `tools`), with and
    without a generation prompt, and with enable_thinking unset, true and false where the template
    reads it; variable sets that render alike share one case."""
    variants = [{}, {"enable_thinking": True}, {"enable_thinking": False}] if "enable_thinking" in template else [{}]
    result = []
    for name, (messages, tools) in CONVERSATIONS.items():
        if tools and "tools" not in template:
            continue
        for add_generation_prompt in (True, False):
            by_result: dict[str, dict] = {}
            for variables in variants:
                rendered = render(template, messages, tools, add_generation_prompt, variables)
                case = by_result.setdefault(json.dumps(rendered), {
                    "conversation": name, "add_generation_prompt": add_generation_prompt, "variants": [], **rendered})
                case["variants"].append(variables)
            result.extend(by_result.values())
    return result


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digest(found: list[dict]) -> dict:
    """The cases of `found` as conversations x add_generation_prompt (true, false) x variants, and
    one SHA-256 over their results in that order (each one's text, or null where transformers
    raised); the test computes the same from our renderings."""
    results = {(c["conversation"], c["add_generation_prompt"], json.dumps(v)): c.get("text")
               for c in found for v in c["variants"]}
    conversations = list(dict.fromkeys(c["conversation"] for c in found))
    variants = list({json.dumps(v): v for c in found for v in c["variants"]}.values())
    ordered = [results[(name, add, json.dumps(v))] for name in conversations for add in (True, False) for v in variants]
    return {"conversations": conversations, "variants": variants,
            "results_sha256": sha256(json.dumps(ordered, ensure_ascii=False))}


def main() -> None:
    chat_template_utils.datetime = FrozenDatetime
    folder = llama_cpp_source() / "models" / "templates"
    templates = {}
    for path in sorted(folder.glob("*.jinja"), key=lambda p: (p.stem not in TEMPLATES, p.stem)):
        text = path.read_text(encoding="utf-8")
        found = cases(text)
        if path.stem in TEMPLATES:
            templates[path.stem] = {"sha256": sha256(text), "cases": found}
        else:
            templates[path.stem] = {"sha256": sha256(text), **digest(found)}
    golden = {"transformers": transformers.__version__, "fixed_now": FIXED_NOW, "bos_token": BOS, "eos_token": EOS,
              "conversations": {name: {"messages": m, "tools": t} for name, (m, t) in CONVERSATIONS.items()},
              "templates": templates}
    OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(templates)} templates, {sum('cases' in t for t in templates.values())} in full")


if __name__ == "__main__":
    main()
