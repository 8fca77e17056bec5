"""Structured output: the tiny random model emits random bytes, so a valid JSON document, regex match
or grammar sentence can only come from the constraint. Every output here must be valid, under
batching, preemption, chunked prefill, forks and speculation alike."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import llguidance
import numpy as np
import pytest
from conftest import make_prompts, run_to_completion

from vllmlite import LLM
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import ByteTokenizer
from vllmlite.worker.structured_output import (
    GrammarCompiler,
    GrammarMasker,
    GrammarState,
    make_llg_tokenizer,
    unpack_bitmask,
)

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
                                       "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                      "ok": {"type": "boolean"}}}}},
    "array_enum": {"type": "object", "additionalProperties": False, "required": ["tags"],
                   "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                           "minItems": 1, "maxItems": 3},
                                  "note": {"type": "string", "maxLength": 4}}},
    "number_bounds": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                      "minItems": 2, "maxItems": 4},
}
REGEX = r"[a-c]{3}-[0-9]{1,4}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "[" pair ("," pair)? "]"\npair: KEY "=" NUM\nKEY: /[a-z]{1,3}/\nNUM: /[0-9]{1,2}/'
LARK_AS_REGEX = r"\[[a-z]{1,3}=[0-9]{1,2}(,[a-z]{1,3}=[0-9]{1,2})?\]"


def constrained(temperature: float = 0.0, max_tokens: int = 120, seed: int | None = 0, **constraint) -> SamplingParams:
    if "json" in constraint:
        constraint["disable_any_whitespace"] = True  # a random model would pick whitespace forever
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def texts(output) -> list[str]:
    return [c.text for c in output.outputs]


def assert_complete(output) -> None:
    assert [c.finish_reason for c in output.outputs] == ["stop"] * len(output.outputs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(make_engine, name, temperature):
    prompts = make_prompts(3, seed=1)
    outputs = run_to_completion(make_engine(), [(p, constrained(temperature, seed=i, json=SCHEMAS[name]))
                                                for i, p in enumerate(prompts)])
    for output in outputs:
        assert_complete(output)
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS[name])


def test_json_schema_as_text_and_json_object(make_engine):
    outputs = run_to_completion(make_engine(), [([1, 2], constrained(json=json.dumps(SCHEMAS["flat"]))),
                                                ([3, 4], constrained(json_object=True))])
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), SCHEMAS["flat"])
    assert isinstance(json.loads(outputs[1].outputs[0].text), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_lark_outputs_match(make_engine, temperature):
    prompts = make_prompts(6, seed=2)
    kinds = [{"regex": REGEX}, {"choice": CHOICES}, {"grammar": LARK}, {"grammar": 'root ::= "on" | "off"'}] * 2
    outputs = run_to_completion(make_engine(), [(p, constrained(temperature, seed=i, **k))
                                                for i, (p, k) in enumerate(zip(prompts, kinds))])
    for output, kind in zip(outputs, kinds):
        assert_complete(output)
        text = output.outputs[0].text
        if "regex" in kind:
            assert re.fullmatch(REGEX, text), text
        elif "choice" in kind:
            assert text in CHOICES
        elif kind["grammar"] == LARK:
            assert re.fullmatch(LARK_AS_REGEX, text), text
        else:
            assert text in ("on", "off")


def test_forked_samples_each_follow_the_grammar(make_engine):
    params = constrained(1.0, json=SCHEMAS["array_enum"])
    params.n = 6
    output = run_to_completion(make_engine(), [([5, 6, 7], params)])[0]
    assert len(output.outputs) == 6
    assert_complete(output)
    documents = [json.loads(text) for text in texts(output)]
    for document in documents:
        jsonschema.validate(document, SCHEMAS["array_enum"])
    assert len({json.dumps(d) for d in documents}) > 1  # independent samples, each with its own state


def test_unconstrained_neighbours_keep_their_greedy_output(make_engine):
    prompts = make_prompts(4, seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [texts(run_to_completion(make_engine(), [(p, plain)])[0]) for p in prompts]
    mixed = []
    for i, p in enumerate(prompts):
        mixed += [(p, plain), (p[::-1], constrained(json=SCHEMAS["nested"]))]
    outputs = run_to_completion(make_engine(), mixed)
    assert [texts(o) for o in outputs[0::2]] == alone
    for output in outputs[1::2]:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS["nested"])


def run_constrained(engine, temperature: float = 0.0) -> list[list[str]]:
    requests = [(p, constrained(temperature, seed=i, **kind))
                for i, (p, kind) in enumerate(zip(make_prompts(6, seed=4, min_len=20, max_len=40),
                                                  [{"json": SCHEMAS["flat"]}, {"regex": REGEX},
                                                   {"json": SCHEMAS["array_enum"]}, {"grammar": LARK},
                                                   {"json": SCHEMAS["number_bounds"]}, {"choice": CHOICES}]))]
    return [texts(o) for o in run_to_completion(engine, requests)]


@pytest.mark.parametrize("overrides", [
    {"block_size": 4, "num_blocks": 24, "preemption_mode": "recompute", "max_num_batched_tokens": 32},
    {"block_size": 4, "num_blocks": 24, "preemption_mode": "swap", "swap_space": 0.01, "max_num_batched_tokens": 32},
    {"max_num_batched_tokens": 8},
], ids=["recompute", "swap", "chunked"])
def test_constrained_output_identical_under_preemption_and_chunking(make_engine, overrides):
    expected = run_constrained(make_engine())
    engine = make_engine(**overrides)
    assert run_constrained(engine) == expected
    if "preemption_mode" in overrides:
        assert engine.get_stats().scheduler.num_preemptions > 0


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                  {"method": "self_draft", "num_draft_layers": 2, "num_speculative_tokens": 3}],
                         ids=["ngram", "target_as_draft"])
def test_speculation_keeps_constrained_output(make_engine, spec):
    """The draft knows nothing of the grammar: guesses it forbids are rejected, allowed ones kept;
    greedy output equals the output without speculation, and sampled output stays valid."""
    expected = run_constrained(make_engine())
    engine = make_engine(speculative_config=spec)
    assert run_constrained(engine) == expected
    stats = engine.get_stats().scheduler.spec_decode
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some guesses were rejected
    sampled = run_constrained(make_engine(speculative_config=spec), temperature=1.0)
    jsonschema.validate(json.loads(sampled[0][0]), SCHEMAS["flat"])
    assert re.fullmatch(REGEX, sampled[1][0]) and re.fullmatch(LARK_AS_REGEX, sampled[3][0])
    assert sampled[5][0] in CHOICES


def test_masks_along_guesses_then_roll_back():
    tokenizer = ByteTokenizer()
    llg_tokenizer = make_llg_tokenizer(tokenizer, tokenizer.vocab_size)
    matcher = llguidance.LLMatcher(llg_tokenizer, llguidance.grammar_from("regex", "ab+c"))
    state = GrammarState(matcher, llg_tokenizer.vocab_size)
    masks = unpack_bitmask(GrammarMasker(tokenizer.vocab_size).masks([(state, [ord("a"), ord("b"), ord("x")]), (None, [])]),
                           tokenizer.vocab_size)
    assert masks.shape == (5, tokenizer.vocab_size)
    assert np.flatnonzero(masks[0]).tolist() == [ord("a")]
    assert np.flatnonzero(masks[1]).tolist() == [ord("b")]
    assert np.flatnonzero(masks[2]).tolist() == [ord("b"), ord("c")]
    assert masks[3].all() and masks[4].all()  # after the forbidden "x"; and a row without grammar
    mask = unpack_bitmask(GrammarMasker(tokenizer.vocab_size).masks([(state, [])]), tokenizer.vocab_size)
    assert np.flatnonzero(mask[0]).tolist() == [ord("a")]


def test_grammar_ends_the_request_even_with_ignore_eos(make_engine):
    params = constrained(1.0, choice=CHOICES, max_tokens=50)
    params.ignore_eos = True
    output = run_to_completion(make_engine(), [([9, 9], params)])[0]
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].text in CHOICES


def test_max_tokens_may_cut_a_document_short(make_engine):
    output = run_to_completion(make_engine(), [([1], constrained(json=SCHEMAS["flat"], max_tokens=4))])[0]
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize("constraint, message", [
    ({"json": {"type": "foo"}}, "json is invalid"), ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "regex is invalid"), ({"grammar": "start: missing_rule"}, "grammar is invalid"),
])
def test_invalid_constraint_is_refused_before_queueing(make_engine, constraint, message):
    engine = make_engine()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        engine.check_request([1, 2], params)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", [1, 2], params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one .* got none"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"choice": []}, "choice must be"), ({"choice": ["a", 1]}, "choice must be"), ({"json": 3}, "json must be"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
    ({"regex": "a" * 70000}, "regex has 70000 characters; at most 65536"),
    ({"json": {"enum": ["x" * 40000, "y" * 40000]}}, "json has 800.. characters"),
])
def test_structured_outputs_params_take_exactly_one_valid_constraint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuse_other_types_and_guided_decoding():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(TypeError, match="use structured_outputs"):
        SamplingParams(guided_decoding=None)


def test_a_schema_as_dict_or_text_shares_one_compile_and_keeps_its_property_order(make_engine):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}}}
    a = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    b = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    assert a.key == b.key
    engine = make_engine()
    outputs = run_to_completion(engine, [([1], SamplingParams(structured_outputs=a, max_tokens=40)),
                                         ([2], SamplingParams(structured_outputs=b, max_tokens=40))])
    assert len(engine.input_processor._grammar_compiler._cache) == 1
    # properties come in the schema's order, not sorted (a sorted key once forced {"alpha"... first)
    assert [o.outputs[0].text for o in outputs] == ['{"zeta":1,"alpha":2}'] * 2


def test_a_slow_compile_does_not_stall_other_requests(make_engine, monkeypatch):
    engine = make_engine()
    release = threading.Event()
    compile_grammar = GrammarCompiler._compile

    def slow_compile(self, params):
        assert release.wait(10)
        return compile_grammar(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    engine.add_request("json", [1, 2], constrained(json=SCHEMAS["flat"]))
    engine.add_request("plain", [3, 4], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finished = {}
    while "plain" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "json" not in finished and engine.has_unfinished_requests()
    assert engine.get_stats().scheduler.num_waiting == 1  # waiting for its grammar
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    jsonschema.validate(json.loads(finished["json"].outputs[0].text), SCHEMAS["flat"])


def test_abort_while_compiling_leaves_nothing(make_engine, monkeypatch):
    release = threading.Event()
    compile_grammar = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, p: release.wait(10) and compile_grammar(self, p))
    engine = make_engine()
    engine.add_request("json", [1, 2], constrained(json=SCHEMAS["flat"]))
    engine.step()
    engine.abort_request("json")
    release.set()
    assert not engine.has_unfinished_requests() and engine.step() == []
    run_to_completion(engine, [])  # asserts no leaks


def test_async_engine_streams_a_constrained_request(make_async):
    """Through the engine thread: the grammar compiles while the loop runs, the deltas join into
    a valid document, and a plain request beside it streams as usual."""
    engine = make_async()

    async def collect(request_id: str, params: SamplingParams) -> list:
        return [o async for o in engine.generate(GenerateRequest(request_id, [1, 2, 3], params))]

    async def main():
        return await asyncio.gather(collect("json", constrained(json=SCHEMAS["nested"])),
                                    collect("plain", SamplingParams(max_tokens=8, ignore_eos=True)))

    constrained_outputs, plain_outputs = asyncio.run(main())
    text = "".join(o.outputs[0].delta_text for o in constrained_outputs)
    jsonschema.validate(json.loads(constrained_outputs[-1].outputs[0].text), SCHEMAS["nested"])
    assert text == constrained_outputs[-1].outputs[0].text
    assert len(plain_outputs[-1].outputs[0].token_ids) == 8


def test_offline_generate_with_structured_outputs():
    llm = LLM(model="random", dtype="float64", num_blocks=64)
    outputs = llm.generate(["a", "b"], constrained(json=SCHEMAS["nested"]), use_tqdm=False)
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS["nested"])


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    return LLM(model="default", num_blocks=256)


@pytest.mark.real_model
def test_real_model_writes_schema_valid_json(real_llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                             "population": {"type": "integer", "minimum": 0}}}
    prompt = "Give the largest city of France as JSON with its country and population.\n"
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json=schema))
    output = real_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop"
    jsonschema.validate(json.loads(output.text), schema)
    speculating = LLM(model="default", num_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert speculating.generate([prompt], params, use_tqdm=False)[0].outputs[0].text == output.text
    assert speculating.engine.get_stats().scheduler.spec_decode.num_draft_tokens > 0


@pytest.mark.real_model
def test_real_model_choice_and_regex(real_llm):
    choice = SamplingParams(temperature=0.0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["Paris", "London", "Berlin"]))
    regex = SamplingParams(temperature=0.7, seed=1, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"))
    outputs = real_llm.generate(["The capital of France is", "Today's date is"], [choice, regex], use_tqdm=False)
    assert outputs[0].outputs[0].text == "Paris"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outputs[1].outputs[0].text)


def test_verify_rechecks_a_constraint_changed_after_it_passed():
    params = StructuredOutputsParams(regex="a+")
    params.verify()
    params.verify()  # the engine loop re-verifies what the HTTP thread checked: remembered
    params.regex = "a("
    with pytest.raises(ValueError, match="regex is invalid"):
        params.verify()


def test_a_grammar_that_fails_to_compile_ends_only_its_request(make_engine, monkeypatch):
    def failing_compile(self, params):
        raise ValueError("structured_outputs.json is invalid: too complex")

    monkeypatch.setattr(GrammarCompiler, "_compile", failing_compile)
    params = constrained(json=SCHEMAS["flat"])
    params.n = 2
    outputs = run_to_completion(make_engine(), [([1, 2], params), ([3], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert [c.finish_reason for c in outputs[0].outputs] == ["error", "error"]
    assert "too complex" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "length"
