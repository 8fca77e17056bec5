"""Server details vLLM users meet: completions `logprobs` up to 20, `prompt_logprobs`,
`stream_options.continuous_usage_stats`, `return_tokens_as_token_ids`, echo's `text_offset`, and a
400 naming the field for every value we do not serve. Through the official `openai` client against a
live server (raw httpx where the client cannot send a value), checked against the offline engine."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from conftest import engine_on, greedy, run_to_completion
from server_util import running_server

from vllmlite.api.openai.serving_completions import TextOffsets
from vllmlite.tokenizer import ByteTokenizer

MODEL = "random"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
BOS = 256
TOKEN_ID = re.compile(r"token_id:(\d+)")


def offline(tiny_model, prompt_ids: list[int], **params):
    """The offline engine's output for one prompt (greedy, ignore_eos)."""
    (output,) = run_to_completion(engine_on(tiny_model), [(prompt_ids, greedy(**params))])
    return output


def parse_token_id(token: str) -> int:
    match = TOKEN_ID.fullmatch(token)
    assert match, token
    return int(match.group(1))


def assert_offsets_match_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Offsets start at 0, never decrease, stay inside `text`, and each whole-character token's text
    is found at its offset (a BOS the text leaves out and split UTF-8 bytes have no text there)."""
    assert len(tokens) == len(offsets) > 0
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text), offsets
    for token, offset in zip(tokens, offsets):
        if token.startswith("bytes:") or token == "<|bos|>" and not text.startswith("<|bos|>"):
            continue
        assert text[offset:offset + len(token)] == token, (token, offset, text)


# --- completions logprobs up to 20 -----------------------------------------------------------------

def test_completion_logprobs_20_gives_20_candidates_per_position(client, tiny_model):
    result = client.completions.create(model=MODEL, prompt="twenty", max_tokens=4, logprobs=20, **GREEDY)
    logprobs = result.choices[0].logprobs
    reference = offline(tiny_model, [BOS, *b"twenty"], max_tokens=4, logprobs=20).outputs[0]
    assert len(logprobs.top_logprobs) == len(logprobs.tokens) == len(reference.logprobs) == 4
    for token, value, top, position in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                           reference.logprobs):
        assert len(top) == 20 and token in top  # greedy: the sampled token is among the 20 best
        assert value == pytest.approx(max(top.values()))
        expected = {p.decoded_token: p.logprob for p in list(position.values())[:20]}
        assert top == pytest.approx(expected)


def test_streamed_logprobs_20_equal_the_whole_response(client):
    whole = client.completions.create(model=MODEL, prompt="twenty", max_tokens=5, logprobs=20, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="twenty", max_tokens=5, logprobs=20,
                                            stream=True, **GREEDY))
    streamed = [top for c in chunks for top in c.choices[0].logprobs.top_logprobs]
    assert streamed == whole.choices[0].logprobs.top_logprobs and all(len(top) == 20 for top in streamed)


# --- 400s naming the field ---------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
BAD_COMPLETIONS = [
    ({"logprobs": 21}, "logprobs", "20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "0"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs", "integer"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options", "stream"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats", "boolean"),
    ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids", "boolean"),
]
BAD_CHATS = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options", "stream"),
    ({"return_tokens_as_token_ids": "true"}, "return_tokens_as_token_ids", "boolean"),
]


@pytest.mark.parametrize("fields,param,hint", BAD_COMPLETIONS)
def test_bad_completion_detail_is_a_400_naming_the_field(client, fields, param, hint):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=fields)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param
    assert param.split(".")[-1] in error["message"] and hint in error["message"]


@pytest.mark.parametrize("fields,param,hint", BAD_CHATS)
def test_bad_chat_detail_is_a_400_naming_the_field(client, fields, param, hint):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body=fields)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param
    assert param.split(".")[-1] in error["message"] and hint in error["message"]


# --- prompt_logprobs ---------------------------------------------------------------------------------

def assert_prompt_logprobs_equal(served: list, reference: list, num_top: int) -> None:
    """The served JSON `[None, {"id": {logprob, rank, decoded_token}}, ...]` holds, per prompt token,
    the offline engine's `num_top` best candidates and the prompt token itself."""
    assert served[0] is None and reference[0] is None and len(served) == len(reference) > 1
    for position, expected in zip(served[1:], reference[1:]):
        kept = dict(list(expected.items())[:num_top])
        assert {int(k) for k in position} >= set(kept) and num_top <= len(position) <= num_top + 1
        for token_id, entry in position.items():
            logprob = expected[int(token_id)]
            assert entry == {"logprob": pytest.approx(logprob.logprob), "rank": logprob.rank,
                             "decoded_token": logprob.decoded_token}


@pytest.mark.parametrize("num_top", [0, 2, 20])
def test_completion_prompt_logprobs_match_the_offline_engine(client, tiny_model, num_top):
    result = client.completions.create(model=MODEL, prompt="prompt scores", max_tokens=2, n=2, temperature=0.0,
                                       extra_body={"prompt_logprobs": num_top, "ignore_eos": True})
    reference = offline(tiny_model, [BOS, *b"prompt scores"], max_tokens=2, prompt_logprobs=20)
    for choice in result.choices:  # vLLM repeats them on every choice of the prompt
        assert_prompt_logprobs_equal(choice.prompt_logprobs, reference.prompt_logprobs, num_top)
        assert all(len(p) == 1 for p in choice.prompt_logprobs[1:]) or num_top > 0


def test_chat_prompt_logprobs_are_on_the_response(server, client, tiny_model):
    result = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                            extra_body={"prompt_logprobs": 3})
    prompt_ids = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()["tokens"]
    reference = offline(tiny_model, prompt_ids, max_tokens=2, prompt_logprobs=3)
    assert_prompt_logprobs_equal(result.prompt_logprobs, reference.prompt_logprobs, 3)
    assert result.usage.prompt_tokens == len(prompt_ids)


def test_prompt_logprobs_absent_unless_asked(client):
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert result.choices[0].prompt_logprobs is None


def test_echo_and_prompt_logprobs_keep_their_own_sizes(client):
    result = client.completions.create(model=MODEL, prompt="sizes", max_tokens=1, echo=True, logprobs=4,
                                       extra_body={"prompt_logprobs": 1})
    choice = result.choices[0]
    assert all(1 <= len(p) <= 2 for p in choice.prompt_logprobs[1:])
    echoed = choice.logprobs.top_logprobs[1:len(choice.prompt_logprobs)]
    assert all(4 <= len(top) <= 5 for top in echoed)


# --- stream_options.continuous_usage_stats ---------------------------------------------------------------

def test_continuous_usage_counts_each_choices_tokens_and_ends_at_the_total(client):
    """As vLLM counts it: a chunk (one choice) carries its own prompt's tokens and its own choice's
    tokens so far; the final usage chunk is the whole response's."""
    kwargs = dict(model=MODEL, prompt=["usage one", "usage two!"], max_tokens=6, n=2, logprobs=0, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}, **kwargs))
    *content, final = chunks
    assert final.choices == [] and final.usage == whole.usage
    previous = dict.fromkeys(range(4), 0)
    for chunk in content:
        (choice,) = chunk.choices
        num_tokens = len(choice.logprobs.tokens)
        assert num_tokens >= 1 and chunk.usage.completion_tokens == previous[choice.index] + num_tokens
        assert chunk.usage.prompt_tokens == 1 + len(kwargs["prompt"][choice.index // 2])  # BOS + bytes
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        previous[choice.index] = chunk.usage.completion_tokens
    assert previous == dict.fromkeys(range(4), 6) and whole.usage.completion_tokens == 4 * 6


def test_continuous_usage_in_chat_starts_at_zero_with_the_role(client):
    kwargs = dict(model=MODEL, messages=USER, max_tokens=5, logprobs=True, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
    role, *content, final = chunks
    assert role.choices[0].delta.role == "assistant"
    assert role.usage.completion_tokens == 0 and role.usage.prompt_tokens == whole.usage.prompt_tokens
    previous = 0
    for chunk in content:
        assert chunk.choices and chunk.usage.completion_tokens == previous + len(chunk.choices[0].logprobs.content)
        previous = chunk.usage.completion_tokens
    assert content[-1].usage.completion_tokens == whole.usage.completion_tokens == 5
    assert final.choices == [] and final.usage == whole.usage


def test_without_continuous_usage_chunks_carry_no_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 3


# --- return_tokens_as_token_ids --------------------------------------------------------------------------

def test_completion_tokens_as_token_ids_parse_back_to_the_engines_ids(client, tiny_model):
    prompt_ids = [BOS, *b"ids"]
    result = client.completions.create(model=MODEL, prompt="ids", max_tokens=6, logprobs=3, echo=True,
                                       temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    logprobs = result.choices[0].logprobs
    reference = offline(tiny_model, prompt_ids, max_tokens=6).outputs[0]
    assert [parse_token_id(t) for t in logprobs.tokens] == prompt_ids + reference.token_ids
    assert len(logprobs.top_logprobs) == len(logprobs.tokens) == len(prompt_ids) + 6
    for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:]):
        assert token in top and all(TOKEN_ID.fullmatch(key) for key in top)
    assert result.choices[0].text == "ids" + reference.text  # the text itself is unchanged


def test_chat_tokens_as_token_ids_parse_back_to_the_engines_ids(server, client, tiny_model):
    result = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, logprobs=True,
                                            top_logprobs=2, temperature=0.0,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    prompt_ids = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()["tokens"]
    reference = offline(tiny_model, prompt_ids, max_tokens=5).outputs[0]
    content = result.choices[0].logprobs.content
    assert [parse_token_id(entry.token) for entry in content] == reference.token_ids
    for entry in content:
        token_id = parse_token_id(entry.token)
        assert entry.bytes == [token_id]  # the byte token's own byte, not the bytes of "token_id:.."
        assert len(entry.top_logprobs) == 2 and all(TOKEN_ID.fullmatch(t.token) for t in entry.top_logprobs)


def test_tokens_are_text_unless_asked(client):
    result = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=1, **GREEDY)
    assert not any(t.startswith("token_id:") for t in result.choices[0].logprobs.tokens)


# --- echo's text_offset --------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["abc", "héllo wörld", "a"])
def test_echo_offsets_skip_the_added_bos_and_match_the_text(client, prompt):
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, echo=True, logprobs=1, **GREEDY)
    choice = result.choices[0]
    logprobs = choice.logprobs
    num_prompt = 1 + len(prompt.encode())
    assert logprobs.tokens[0] == "<|bos|>" and logprobs.token_logprobs[0] is None
    assert logprobs.text_offset[:2] == [0, 0]  # the BOS is not in the echoed text
    assert logprobs.text_offset[num_prompt] == len(prompt)  # the first generated token starts after it
    assert choice.text.startswith(prompt) and len(logprobs.tokens) == num_prompt + 8
    assert_offsets_match_text(choice.text, logprobs.tokens, logprobs.text_offset)


def test_echo_of_token_ids_spells_the_bos_and_counts_it(client):
    result = client.completions.create(model=MODEL, prompt=[BOS, *b"xy"], max_tokens=3, echo=True, logprobs=0,
                                       **GREEDY)
    choice = result.choices[0]
    assert choice.text.startswith("<|bos|>xy")
    assert choice.logprobs.text_offset[:4] == [0, 7, 8, 9]
    assert_offsets_match_text(choice.text, choice.logprobs.tokens, choice.logprobs.text_offset)


def test_generated_offsets_follow_split_characters(client):
    """A character split over byte tokens starts where its first byte does; the next token after it."""
    tokenizer = ByteTokenizer()
    result = client.completions.create(model=MODEL, prompt="é", max_tokens=12, echo=True, logprobs=0, **GREEDY)
    choice = result.choices[0]
    offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
    assert tokens[1:3] == [tokenizer.token_text(0xC3), tokenizer.token_text(0xA9)] and offsets[:4] == [0, 0, 0, 1]
    assert_offsets_match_text(choice.text, tokens, offsets)


@pytest.mark.parametrize("token_ids,skip_special,expected", [
    ([BOS, 97, 0xC3, 0xA9, 98], True, [0, 0, 1, 1, 2]),   # "aéb": the BOS has width 0
    ([BOS, 97, 98], False, [0, 7, 8]),                    # "<|bos|>ab": spelled, it counts
    ([97, 0xE2, 98, 99], True, [0, 1, 2, 3]),             # "a\ufffdbc": an invalid byte owns its U+FFFD
    ([0xF0, 0x9F, 0x98, 0x80, 97], True, [0, 0, 0, 0, 1]),  # a 4-byte character, then "a"
])
def test_text_offsets_follow_the_decoded_text(token_ids, skip_special, expected):
    offsets = TextOffsets(ByteTokenizer(), (), skip_special)
    assert [offsets.next(t) for t in token_ids] == expected


def test_text_offsets_continue_after_the_prompt_context():
    offsets = TextOffsets(ByteTokenizer(), [BOS, *b"prompt"], skip_special_tokens=True, start=6)
    assert [offsets.next(t) for t in [*b"abcdefgh", 0xC3, 0xA9, 0x21]] == [6, 7, 8, 9, 10, 11, 12, 13, 14, 14, 15]


def test_streamed_echo_logprobs_equal_the_whole_response(client):
    kwargs = dict(model=MODEL, prompt=["stream é", "two"], max_tokens=6, echo=True, logprobs=2, **GREEDY)
    whole = client.completions.create(**kwargs)
    for choice in whole.choices:
        parts = [c for chunk in client.completions.create(stream=True, **kwargs)
                 for c in chunk.choices if c.index == choice.index]
        assert "".join(c.text for c in parts) == choice.text
        for name in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
            assert [v for c in parts for v in getattr(c.logprobs, name)] == getattr(choice.logprobs, name)


def test_offsets_stay_inside_text_cut_by_a_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="stop here", max_tokens=10, **GREEDY).choices[0].text
    stop = full[3:5]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("the greedy continuation has no printable stop string")
    result = client.completions.create(model=MODEL, prompt="stop here", max_tokens=10, stop=[stop], logprobs=0,
                                       echo=True, **GREEDY)
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and choice.text.endswith(full[:full.index(stop)])
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    assert choice.logprobs.text_offset[-1] <= len(choice.text)


# --- the other fields a request declares -------------------------------------------------------------------

@contextmanager
def client_ids_seen(server) -> Iterator[list]:
    """The fairness key (`client_id`) of every request the server's engine admits meanwhile."""
    seen = []
    engine = server.engine.engine
    original = engine.add_request

    def spy(request_id, prompt, params, **kwargs):
        seen.append(kwargs["client_id"])
        return original(request_id, prompt, params, **kwargs)

    engine.add_request = spy
    try:
        yield seen
    finally:
        del engine.add_request


def test_user_is_the_fairness_key_after_the_client_id_header(server, client):
    with client_ids_seen(server) as seen:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, user="alice")
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, user="bob")
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, user="alice",
                                  extra_headers={"X-Client-Id": "tenant-7"})
    assert seen == ["user-alice", "user-bob", "tenant-7"]


def test_a_bearer_key_is_one_fairness_key_in_any_spelling_of_the_scheme(server):
    with client_ids_seen(server) as seen:
        for authorization in ("Bearer k1", "bearer k1", "BEARER  k1", "Bearer k2", "Basic k1", "Bearer"):
            response = httpx.post(server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 1},
                                  headers={"Authorization": authorization})
            assert response.status_code == 200
    assert seen[0] == seen[1] == seen[2] and seen[0].startswith("key-")
    assert seen[3] != seen[0] and seen[3].startswith("key-") and seen[4:] == [None, None]


def test_tokenize_messages_honours_add_special_tokens(server):
    plain = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()["tokens"]
    special = httpx.post(server.url + "/tokenize", json={"messages": USER, "add_special_tokens": True}).json()["tokens"]
    assert special == [BOS, *plain] and plain[0] != BOS


UNUSED_VLLM_FIELDS = [
    ("logits_processors", ["my.module:proc"]), ("spaces_between_special_tokens", False),
]
UNUSED_CHAT_FIELDS = [("echo", True), ("continue_final_message", True), ("documents", [{"text": "d"}]),
                      ("use_beam_search", True)]  # completions has it (test_server_beam_search.py)


@pytest.mark.parametrize("name,value", UNUSED_VLLM_FIELDS)
def test_vllm_fields_we_do_not_serve_are_a_400_on_both_endpoints(client, name, value):
    for create, kwargs in ((client.completions.create, {"prompt": "x"}),
                           (client.chat.completions.create, {"messages": USER})):
        with pytest.raises(openai.BadRequestError) as raised:
            create(model=MODEL, max_tokens=1, extra_body={name: value}, **kwargs)
        assert raised.value.body["param"] == name and name in raised.value.body["message"]


@pytest.mark.parametrize("name,value", UNUSED_CHAT_FIELDS)
def test_chat_fields_we_do_not_serve_are_a_400(client, name, value):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, extra_body={name: value})
    assert raised.value.body["param"] == name


def test_unused_values_of_those_fields_are_accepted(client):
    defaults = {"use_beam_search": False, "spaces_between_special_tokens": True, "return_token_ids": False,
                "response_format": {"type": "text"}, "logits_processors": []}
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=defaults).choices
    chat_defaults = {**defaults, "echo": False, "continue_final_message": False, "documents": []}
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, extra_body=chat_defaults).choices


@pytest.mark.parametrize("name,value", [("use_beam_search", 0), ("return_token_ids", 0),
                                        ("spaces_between_special_tokens", 1), ("echo", 0),
                                        ("continue_final_message", 0)])
def test_a_number_is_not_the_unused_boolean_of_those_fields(server, name, value):
    # JSON's 0 and 1 are not false and true (Python's 0 == False must not let them through).
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, name: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == name


def test_add_special_tokens_decides_the_bos_on_both_endpoints(client):
    def prompt_tokens(create, **kwargs) -> int:
        return create(model=MODEL, max_tokens=1, **kwargs).usage.prompt_tokens

    completion = client.completions.create
    assert prompt_tokens(completion, prompt="abc") == 4  # vLLM's default for a prompt: with the BOS
    assert prompt_tokens(completion, prompt="abc", extra_body={"add_special_tokens": False}) == 3
    chat = client.chat.completions.create
    plain = prompt_tokens(chat, messages=USER)  # vLLM's default for messages: the template's tokens only
    assert prompt_tokens(chat, messages=USER, extra_body={"add_special_tokens": True}) == plain + 1


# --- the real model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server():
    from vllmlite.models.loader import load_model

    loaded = load_model("default", "float32", 0)
    with running_server(loaded, model="default", dtype="float32", num_blocks=256) as live:
        yield live


@pytest.mark.real_model
def test_real_model_echo_offsets_match_the_text_and_ids_round_trip(real_server):
    client = openai.OpenAI(base_url=real_server.base_url, api_key="x", max_retries=0, timeout=120)
    prompt = "Café au lait ☕ costs €3, naïvely."
    prompt_ids = httpx.post(real_server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    kwargs = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12, echo=True, logprobs=20, temperature=0.0)
    result = client.completions.create(**kwargs)
    by_ids = client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True})
    choice = result.choices[0]
    assert choice.text.startswith(prompt)
    assert_offsets_match_text(choice.text, choice.logprobs.tokens, choice.logprobs.text_offset)
    assert choice.logprobs.text_offset[len(prompt_ids)] == len(prompt)
    assert all(len(top) in (20, 21) for top in choice.logprobs.top_logprobs[1:])
    ids = [parse_token_id(t) for t in by_ids.choices[0].logprobs.tokens]
    assert ids[:len(prompt_ids)] == prompt_ids
    tokenizer = real_server.engine.tokenizer
    assert tokenizer.decode(ids[len(prompt_ids):]) == choice.text[len(prompt):]


@pytest.mark.real_model
def test_real_model_prompt_logprobs_rank_the_prompt_tokens(real_server):
    client = openai.OpenAI(base_url=real_server.base_url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    result = client.completions.create(model=model, prompt="The capital of France is Paris", max_tokens=1,
                                       extra_body={"prompt_logprobs": 5})
    positions = result.choices[0].prompt_logprobs
    prompt_ids = httpx.post(real_server.url + "/tokenize",
                            json={"prompt": "The capital of France is Paris"}).json()["tokens"]
    assert positions[0] is None and len(positions) == len(prompt_ids) > 1
    for token_id, position in zip(prompt_ids[1:], positions[1:]):
        ranked = sorted(position.values(), key=lambda e: e["rank"])
        assert str(token_id) in position and [e["rank"] for e in ranked][:5] == [1, 2, 3, 4, 5]
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
    assert position[str(prompt_ids[-1])]["rank"] <= 5  # "Paris" after "The capital of France is"


@pytest.mark.real_model
def test_real_model_card_names_the_model_not_its_file(real_server):
    card = httpx.get(real_server.base_url + "/models").json()["data"][0]
    assert card["root"] == card["id"] and "/" not in card["root"] and ".gguf" not in card["root"]
