"""The offline API as vLLM's example scripts use it (issue 33, second round): `from vllmlite import
EngineArgs`, `EngineArgs.add_cli_args` on a `FlexibleArgumentParser` whose parsed flags are `LLM`'s
keywords, `LLM.get_default_sampling_params()`, and `LLM.chat` with `chat_template` and
`chat_template_kwargs`, its outputs carrying the rendered prompt."""

from __future__ import annotations

import argparse

import pytest

import vllmlite
from vllmlite import LLM, EngineArgs, SamplingParams
from vllmlite.utils.argparse_utils import FlexibleArgumentParser

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
THINKING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random", num_blocks=256)


def parse(argv: list[str], group: bool = False) -> dict:
    """vLLM's example scripts: engine flags (on the parser or an argument group), a default model."""
    parser = FlexibleArgumentParser()
    target = parser.add_argument_group("Engine arguments") if group else parser
    assert EngineArgs.add_cli_args(target) is target
    target.set_defaults(model="random")
    parser.add_argument("--max-tokens", type=int)
    return vars(parser.parse_args(argv))


# --- 2. EngineArgs, its flags, FlexibleArgumentParser, get_default_sampling_params ------------------

def test_engine_args_is_exported_from_the_package():
    assert vllmlite.EngineArgs is EngineArgs and "EngineArgs" in vllmlite.__all__


@pytest.mark.parametrize("group", [False, True])
def test_parsed_engine_flags_are_llm_keywords(llm, group):
    args = parse(["--max_model_len", "64", "--num-blocks=128", "--no-enable-prefix-caching", "--max-tokens", "3"],
                 group)
    max_tokens = args.pop("max_tokens")
    flagged = LLM(**args)
    assert flagged.engine.max_model_len == 64 and flagged.engine.get_stats().scheduler.num_kv_blocks == 128
    assert not flagged.engine.config.cache.enable_prefix_caching
    params = flagged.get_default_sampling_params()
    params.max_tokens, params.temperature = max_tokens, 0.0
    (output,) = flagged.generate("Hello, my name is", params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 3 and output.prompt == "Hello, my name is"
    assert output.outputs[0].text == llm.generate("Hello, my name is", params, use_tqdm=False)[0].outputs[0].text


def test_defaults_of_the_flags_are_the_knobs_own():
    args = parse([])
    args.pop("max_tokens")
    assert EngineArgs(**args) == EngineArgs(model="random")
    namespace = argparse.Namespace(**args, max_tokens=None)
    assert EngineArgs.from_cli_args(namespace) == EngineArgs(model="random")


def test_a_bad_flag_value_is_a_usage_error_naming_why(capsys):
    with pytest.raises(SystemExit):
        parse(["--kv-cache-memory", "lots"])
    assert "kv-cache-memory" in capsys.readouterr().err


def test_vllms_runner_is_accepted_and_checked():
    assert LLM("random", num_blocks=64, runner="pooling").embed(["hi"], use_tqdm=False)[0].outputs.embedding
    with pytest.raises(ValueError, match="runner"):
        LLM("random", runner="draft-ish")


def test_default_sampling_params_are_a_fresh_default_object(llm):
    first, second = llm.get_default_sampling_params(), llm.get_default_sampling_params()
    assert first is not second and first == SamplingParams()
    first.max_tokens = 2
    assert second.max_tokens == SamplingParams().max_tokens


# --- 5. LLM.chat: chat_template, chat_template_kwargs, the rendered prompt ---------------------------

def test_chat_outputs_carry_the_rendered_prompt(llm):
    (output,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert output.prompt == tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert output.prompt_token_ids == tokenizer.encode(output.prompt, add_special_tokens=False)


def test_chat_renders_a_given_template_with_its_kwargs(llm):
    outputs = llm.chat([CONVERSATION, CONVERSATION[1:]], GREEDY, use_tqdm=False, chat_template=THINKING,
                       chat_template_kwargs={"enable_thinking": False})
    assert [o.prompt for o in outputs] == ["system: Be brief.\nuser: Hello\n<think></think>",
                                           "user: Hello\n<think></think>"]
    assert all(o.prompt_token_ids == list(o.prompt.encode()) for o in outputs)  # the byte tokenizer
    (plain,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=THINKING)
    assert plain.prompt == "system: Be brief.\nuser: Hello\n"
    with pytest.raises(ValueError, match="'messages'"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template_kwargs={"messages": []})
