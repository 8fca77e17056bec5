"""`LLM(...).get_tokenizer()` answers what vLLM user scripts ask of a Hugging Face tokenizer:
apply_chat_template as the server renders it, `tok(text)`, batch_decode, token pieces, special ids."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import import_or_skip_unless_ci
from paths import GOLDENS
from server_util import running_server

from vllmlite import LLM
from vllmlite.api.openai.protocol import ChatMessage
from vllmlite.api.openai.serving import ServingContext
from vllmlite.api.openai.serving_chat import render_messages
from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.sampling_params import SamplingParams

GOLDENS = GOLDENS / "smollm2_tokenizer.json"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi <|im_end|> there, héllo"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


def server_prompt_ids(llm: LLM, messages: list[dict], add_generation_prompt: bool,
                      special_tokens_in_messages: bool = False) -> list[int]:
    """The prompt ids the chat endpoint renders for `messages` (its own `render_messages`)."""
    ctx = ServingContext(AsyncLLMEngine(llm.engine), "test", special_tokens_in_messages)
    return render_messages(ctx, [ChatMessage.model_validate(m) for m in messages], add_generation_prompt)


@pytest.fixture(scope="module")
def random_llm() -> LLM:
    return LLM("random")


@pytest.fixture
def tok(random_llm):
    return random_llm.get_tokenizer()


# ---- apply_chat_template ----

@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_is_what_the_chat_endpoint_renders(random_llm, tok, add_generation_prompt):
    server_ids = server_prompt_ids(random_llm, CONVERSATION, add_generation_prompt)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert tok.decode(server_ids) == text
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt) == server_ids


def test_chat_template_over_http_matches_usage_and_tokenize(tiny_model, tok):
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    with running_server(tiny_model) as live:
        chat = httpx.post(live.base_url + "/chat/completions", timeout=60, json={
            "model": "random", "messages": CONVERSATION, "max_tokens": 1, "temperature": 0}).json()
        tokenized = httpx.post(live.url + "/tokenize", json={"messages": CONVERSATION}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert tokenized["tokens"] == ids


def test_chat_template_defaults_are_hf_ones(tok):
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)  # add_generation_prompt=False
    assert not text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(CONVERSATION)  # tokenize=True
    assert ids == tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert tok.bos_token_id not in ids  # the template decides BOS, encoding adds none
    as_dict = tok.apply_chat_template(CONVERSATION, return_dict=True, return_tensors=None)
    assert as_dict.input_ids == ids and as_dict["attention_mask"] == [1] * len(ids)


def test_llm_chat_prompt_is_apply_chat_template(random_llm, tok):
    (output,) = random_llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False)
    assert output.prompt_token_ids == tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)


def test_caller_chat_template_renders_in_the_sandbox(tok):
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    text = tok.apply_chat_template(CONVERSATION[2:], tokenize=False, chat_template=template)
    assert text == "<|bos|>a:Hello.|u:What is 2+2?|"
    # the byte tokenizer spells special names as plain bytes (it never maps text to special ids)
    assert tok.apply_chat_template(CONVERSATION[2:], chat_template=template) == list(text.encode("utf-8"))
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="failed to render"):
        tok.apply_chat_template(CONVERSATION, tokenize=False, chat_template=escape)


def test_extra_keywords_are_template_variables_as_in_hf(tok):
    template = "{% if enable_thinking is defined and not enable_thinking %}no thinking{% endif %}"
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, chat_template=template,
                                   enable_thinking=False) == "no thinking"
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, chat_template=template) == ""
    with pytest.raises(ValueError, match="'messages'"):  # what the renderer sets cannot be replaced
        tok.apply_chat_template(CONVERSATION, tokenize=False, messages=[])


def test_unsupported_chat_template_arguments_raise(tok):
    with pytest.raises(TypeError):  # HF's second positional argument is `tools`, not a flag
        tok.apply_chat_template(CONVERSATION, True)
    with pytest.raises(ValueError, match="return_tensors"):
        tok.apply_chat_template(CONVERSATION, return_tensors="pt")


# ---- tok(text), decode, pieces, special tokens ----

def test_call_returns_input_ids_and_attention_mask(tok):
    one = tok("héllo")
    assert one["input_ids"] == one.input_ids == [256, *"héllo".encode()]
    assert one.attention_mask == [1] * 7
    assert tok("hi", add_special_tokens=False).input_ids == [104, 105]
    batch = tok(["a", "", "héllo"])
    assert batch["input_ids"] == [[256, 97], [256], one.input_ids]
    assert batch.attention_mask == [[1, 1], [1], [1] * 7]
    with pytest.raises(AttributeError):
        _ = one.token_type_ids


def test_decode_keeps_special_tokens_by_default_as_hf(tok):
    sequences = [[256, 104, 105, 257], [0xE2, 0x82, 0xAC]]
    assert tok.decode(sequences[0]) == "<|bos|>hi<|eos|>"
    assert tok.batch_decode(sequences) == ["<|bos|>hi<|eos|>", "€"]
    assert tok.batch_decode(sequences, skip_special_tokens=True) == ["hi", "€"]


def test_convert_ids_to_tokens_round_trips(tok):
    ids = list(range(len(tok)))
    pieces = tok.convert_ids_to_tokens(ids)
    assert len(set(pieces)) == len(ids) == 258
    assert tok.convert_tokens_to_ids(pieces) == ids
    assert tok.convert_ids_to_tokens(104) == "h" and tok.convert_ids_to_tokens(257) == "<|eos|>"
    assert tok.convert_tokens_to_ids("<|bos|>") == 256
    assert tok.convert_tokens_to_ids("not a piece") is None
    with pytest.raises(ValueError, match="outside"):
        tok.convert_ids_to_tokens(258)


def test_special_tokens_are_the_models(random_llm, tok):
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|bos|>", 256, "<|eos|>", 257)
    assert tok.pad_token_id is None and tok.chat_template is None  # ChatML fallback
    assert tok.eos_token_id in random_llm.engine.tokenizer.stop_token_ids
    assert len(tok) == tok.vocab_size == random_llm.engine.model_config.vocab_size


# ---- the real default model (SmolLM2-135M-Instruct), against transformers' goldens ----

@pytest.fixture(scope="module")
def real_llm() -> LLM:
    import_or_skip_unless_ci("gguf")
    return LLM("default", max_model_len=512)


@pytest.fixture(scope="module")
def goldens() -> dict:
    return json.loads(GOLDENS.read_text(encoding="utf-8"))


@pytest.mark.real_model
def test_real_chat_template_matches_transformers_and_the_server(real_llm, goldens):
    tok = real_llm.get_tokenizer()
    for case in goldens["chat"]:
        flag = case["add_generation_prompt"]
        assert tok.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=flag) == case["text"]
        assert tok.apply_chat_template(case["messages"], add_generation_prompt=flag) == case["ids"]
    # The same text; HF's ids read the "<|im_end|>" a user wrote as the special token, the server's
    # read it as plain text unless told to trust messages (--special-tokens-in-messages).
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    hf_ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    server_ids = server_prompt_ids(real_llm, CONVERSATION, True)
    assert tok.decode(server_ids) == text and hf_ids == server_prompt_ids(real_llm, CONVERSATION, True, True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert server_ids.count(im_end) == hf_ids.count(im_end) - 1


@pytest.mark.real_model
def test_real_special_tokens_match_transformers(real_llm, goldens):
    tok, special = real_llm.get_tokenizer(), goldens["special"]
    for name in ("bos_token", "bos_token_id", "eos_token", "eos_token_id", "pad_token_id", "vocab_size"):
        assert getattr(tok, name) == special[name], name
    assert len(tok) == special["len_tokenizer"]
    assert tok.chat_template.startswith("{% for message in messages %}")


@pytest.mark.real_model
def test_real_token_pieces_are_byte_level_bpe(real_llm, goldens):
    tok = real_llm.get_tokenizer()
    ids = tok(" hello world", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["Ġhello", "Ġworld"]
    assert tok.convert_tokens_to_ids(["Ġhello", "Ġworld", "<|im_end|>"]) == [*ids, 2]
    case = goldens["decode"][0]
    assert tok.batch_decode([case["ids"]] * 2) == [case["text"]] * 2
