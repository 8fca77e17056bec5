"""vLLM's offline examples (examples/offline_inference/basic/{basic,generate,chat,embed}.py and
structured_outputs.py) run against vllmlite with only the import and the model name changed: each
test below walks its example's steps, with vLLM's calls, flags and defaults, on the tiny random model.
(Their code is theirs; these are our own tests of the same behaviour.)"""

from __future__ import annotations

import enum
import json
import re

import pydantic
import pytest

from vllmlite import LLM, EngineArgs, SamplingParams
from vllmlite.outputs import RequestOutput
from vllmlite.sampling_params import StructuredOutputsParams
from vllmlite.utils.argparse_utils import FlexibleArgumentParser

MODEL = "random"  # the examples' model names (opt-125m, Llama-3.2-1B-Instruct, e5-mistral, Qwen2.5-3B) -> ours
PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


def example_parser(engine_group: bool = False, **defaults) -> FlexibleArgumentParser:
    """The examples' parser: engine flags (generate.py puts them in a group), the sampling flags,
    and the model (and other engine defaults) the example sets."""
    parser = FlexibleArgumentParser()
    engine = parser.add_argument_group("Engine arguments") if engine_group else parser
    EngineArgs.add_cli_args(engine)
    engine.set_defaults(model=MODEL, **defaults)
    sampling = parser.add_argument_group("Sampling parameters")
    for flag, kind in (("--max-tokens", int), ("--temperature", float), ("--top-p", float), ("--top-k", int)):
        sampling.add_argument(flag, type=kind)
    return parser


def sampling_from(llm: LLM, args: dict) -> SamplingParams:
    """generate.py and chat.py: the LLM's default sampling params, with each flag that was given."""
    params = llm.get_default_sampling_params()
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        value = args.pop(name)
        if value is not None:
            setattr(params, name, value)
    return params


def test_basic(capsys):
    llm = LLM(model=MODEL)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in outputs)
    assert capsys.readouterr().out.count("Generated text:") == 4


@pytest.mark.parametrize("argv", [[], ["--max-tokens", "5", "--temperature", "0", "--max_model_len", "256"]])
def test_generate(argv):
    args = vars(example_parser(engine_group=True).parse_args(argv))
    max_tokens = args["max_tokens"]
    llm_args = dict(args)
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        llm_args.pop(name)
    llm = LLM(**llm_args)
    params = sampling_from(llm, args)
    outputs = llm.generate(PROMPTS, params)
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) <= (max_tokens or 16) for o in outputs)
    if argv:
        assert llm.engine.max_model_len == 256 and params.temperature == 0.0
        assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("with_template", [False, True])
def test_chat(tmp_path, capsys, with_template):
    template_path = tmp_path / "template.jinja"
    template_path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
    parser = example_parser()
    parser.add_argument("--chat-template-path", type=str)
    args = vars(parser.parse_args(["--max-tokens", "6", *(["--chat-template-path", str(template_path)]
                                                           if with_template else [])]))
    chat_template_path = args.pop("chat_template_path")
    params_args = {name: args.pop(name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
    llm = LLM(**args)
    params = sampling_from(llm, params_args)

    def print_outputs(outputs: list[RequestOutput], prompts: list) -> None:
        assert len(outputs) == len(prompts)
        for output in outputs:
            print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")

    print_outputs(llm.chat(CONVERSATION, params, use_tqdm=False), [CONVERSATION])
    conversations = [CONVERSATION for _ in range(10)]
    outputs = llm.chat(conversations, params, use_tqdm=True)
    print_outputs(outputs, conversations)
    assert len({o.prompt for o in outputs}) == 1 and outputs[0].prompt.endswith("<|im_start|>assistant\n")
    if chat_template_path is not None:
        with open(chat_template_path) as f:
            chat_template = f.read()
        outputs = llm.chat(conversations, params, use_tqdm=False, chat_template=chat_template)
        print_outputs(outputs, conversations)
        assert outputs[0].prompt.startswith("<system>You are a helpful assistant\n")
        assert outputs[0].prompt.endswith("<assistant>")
    assert "Processed prompts" in capsys.readouterr().err  # the batch's progress bar


def test_embed():
    args = example_parser(runner="pooling", enforce_eager=True, max_model_len=1024).parse_args([])
    llm_args = {name: value for name, value in vars(args).items()
                if name not in ("max_tokens", "temperature", "top_p", "top_k")}
    outputs = LLM(**llm_args).embed(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        embeds = output.outputs.embedding
        trimmed = (str(embeds[:16])[:-1] + ", ...]") if len(embeds) > 16 else embeds
        print(f"Prompt: {prompt!r} | Embeddings: {trimmed} (size={len(embeds)})")
        assert len(embeds) == 64 and sum(x * x for x in embeds) == pytest.approx(1.0)


class CarType(str, enum.Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(pydantic.BaseModel):
    brand: str
    model: str
    car_type: CarType


SQL = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


def test_structured_outputs():
    # The example's max_model_len=100 holds its prompts in BPE tokens; here a token is a byte.
    llm = LLM(model=MODEL, max_model_len=256)

    def generate(prompt: str, params: SamplingParams):
        return llm.generate(prompt, sampling_params=params)[0].outputs[0]

    choice = generate("Classify this sentiment: vLLM is wonderful!",
                      SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"])))
    assert choice.text in ("Positive", "Negative")
    regex = generate("Generate an email address for Alan Turing, who works in Enigma.End in .com and new line. "
                     "Example result:alan.turing@enigma.com\n",
                     SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"),
                                    stop=["\n"], max_tokens=50))
    # (the grammar's \w is Unicode's, marks included, wider than Python's: check the shape only)
    assert re.fullmatch(r"[^@\s]+@[^@\s]+\.com" if regex.finish_reason == "stop" else r"[^@\s]*(@[^@\s]*)?",
                        regex.text), regex
    car = generate("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
                   SamplingParams(structured_outputs=StructuredOutputsParams(json=CarDescription.model_json_schema()),
                                  max_tokens=50))
    if car.finish_reason == "stop":
        CarDescription.model_validate(json.loads(car.text))
    sql = generate("Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
                   SamplingParams(structured_outputs=StructuredOutputsParams(grammar=SQL), max_tokens=50))
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", sql.text)
