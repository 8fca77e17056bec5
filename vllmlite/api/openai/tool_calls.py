"""Tool calling in the Hermes format: tools described to the model, its calls parsed back, and the
grammar that enforces `tool_choice` "required" or a named function.

The model writes each call as vLLM's hermes parser reads it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template with a tools section renders `tools` itself; for one without (the default model's),
the tools go into the system message in the format above, past calls into the assistant's text and
tool results into user turns inside <tool_response> tags (as Qwen2.5's template writes them).
Owns that format; knows nothing of the engine or of HTTP.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllmlite import json_text
from vllmlite.api.openai.protocol_tools import ChatTool, FunctionCallOut, NamedToolChoice, ToolCallOut
from vllmlite.structured_output_params import StructuredOutputsParams

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schema(tool: ChatTool) -> dict:
    """The tool as OpenAI sends it, without unset fields (what a template or the prompt shows)."""
    return tool.model_dump(exclude_none=True)


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    return f"{CALL_START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_END}"


def parse_arguments(arguments: str) -> Any:
    """A call's JSON arguments as an object (what templates expect); the text itself if not JSON.
    Arguments nested too deep or repeating a key never get here: the request models refuse them
    (protocol_tools.check_arguments)."""
    try:
        return json_text.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def hermes_messages(messages: Sequence[dict], tools: Sequence[ChatTool] | None) -> list[dict]:
    """`messages` for a template without a tools section: the tools appended to the system message
    (one is added first if there is none), each assistant's calls written into its text, and each
    run of tool messages as one user turn of <tool_response> blocks.

    [user, assistant(calls), tool, tool] -> [system(tools), user, assistant(text), user(2 responses)]
    """
    result: list[dict] = []
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool_schema(t), ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] in ("system", "developer"):
            first, *messages = messages
            result.append({**first, "role": "system", "content": f"{first['content']}\n\n{prompt}"})
        else:
            result.append({"role": "system", "content": prompt})
    for message in messages:
        if message["role"] == "tool":
            block = f"{RESPONSE_START}\n{message['content']}\n{RESPONSE_END}"
            if result and result[-1].get("_tool_responses"):
                result[-1]["content"] += "\n" + block
            else:
                result.append({"role": "user", "content": block, "_tool_responses": True})
        elif message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], parse_arguments(c["function"]["arguments"]))
                     for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message["content"] else []) + calls)
            result.append({"role": message["role"], "content": text})
        else:
            result.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_responses"} for m in result]


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """`messages` for a template with a tools section: call arguments as objects, as HF renders them."""
    def with_objects(message: dict) -> dict:
        if not message.get("tool_calls"):
            return message
        calls = [{**c, "function": {**c["function"], "arguments": parse_arguments(c["function"]["arguments"])}}
                 for c in message["tool_calls"]]
        return {**message, "tool_calls": calls}
    return [with_objects(m) for m in messages]


def forced_call_grammar(tools: Sequence[ChatTool], choice: str | NamedToolChoice,
                        parallel: bool) -> StructuredOutputsParams:
    """The grammar of `tool_choice` "required" (a call of any tool; one or more if `parallel`) or a
    named function (calls of that tool only): nothing but calls, each one's arguments valid against
    its tool's parameters schema."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    call_schemas = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"const": t.function.name},
                                    "arguments": t.function.parameters or {"type": "object", "maxProperties": 0}}}
                    for t in tools]
    # Written as json.dumps writes it (the prompt's example): no whitespace for a model to loop on.
    body = json.dumps({"x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
                       "anyOf": call_schemas})
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (f"start: call{repeat}\n"
            f'call: "{CALL_START}\\n" body "\\n{CALL_END}"\n'
            f"body: %json {body}")
    return StructuredOutputsParams(grammar=lark)


@dataclass
class ParsedDelta:
    """What a piece of model text adds to the answer: plain content and complete calls."""

    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)


class ToolCallParser:
    """Splits a choice's text, fed in pieces as it streams, into content and tool calls; the same
    pieces give the same answer whether fed at once or one by one.

    A call is a <tool_call> block whose body is a JSON object naming a declared tool with object
    arguments; any other block stays text. Text that may begin a block, and whitespace that may
    only separate blocks, is held back until it is known; once a call is found, whitespace-only
    content is dropped. With `max_calls` 1 (parallel_tool_calls false) later calls are dropped.

    feed('Sure.\\n<tool_') -> content 'Sure.'; feed('call>\\n{"name": "f", "arguments": {}}\\n</tool_call>')
    -> one call f; finish() -> nothing ('\\n' before the call is dropped).
    """

    def __init__(self, tool_names: Sequence[str], max_calls: int | None = None) -> None:
        self._names = set(tool_names)
        self._max_calls = max_calls
        self._buffer = ""
        self._in_call = False
        self._held_space = ""  # whitespace content not yet sent: it may turn out to separate calls
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        delta = ParsedDelta()
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_START)
                if start < 0:
                    keep = _partial_suffix(self._buffer, CALL_START)
                    self._add_content(delta, self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return delta
                self._add_content(delta, self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_START):]
                self._in_call = True
            end = self._buffer.find(CALL_END)
            if end < 0:
                return delta
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END):]
            self._in_call = False
            call = self._parse_call(body)
            if call is None:
                self._add_content(delta, CALL_START + body + CALL_END)
            elif self._max_calls is None or self.num_calls < self._max_calls:
                delta.calls.append(call)
                self.num_calls += 1

    def finish(self) -> ParsedDelta:
        """The rest: an unfinished block and held text are content (held whitespace only if no call)."""
        rest = (CALL_START if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        delta = ParsedDelta()
        self._add_content(delta, rest)
        if not self.num_calls:
            delta.content += self._held_space
        self._held_space = ""
        return delta

    def _add_content(self, delta: ParsedDelta, text: str) -> None:
        if not text:
            return
        if text.isspace():
            self._held_space += text
            return
        stripped = text.rstrip()
        delta.content += self._held_space + stripped
        self._held_space = text[len(stripped):]

    def _parse_call(self, body: str) -> ToolCallOut | None:
        try:
            value = json_text.loads(body)
        except ValueError:  # not JSON, nested too deep, a key twice: the model's text, not a call
            return None
        if not isinstance(value, dict) or value.get("name") not in self._names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return ToolCallOut(id=new_call_id(), function=FunctionCallOut(
            name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be a tag arriving)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
