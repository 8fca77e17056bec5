"""Structured output at its edges: a grammar that is complete but may go on, empty constraints, the
masks along speculative guesses when the model's vocabulary is larger than the grammar's, and
grammars that break one of llguidance's limits only once tokens arrive."""

from __future__ import annotations

import re

import llguidance
import numpy as np
import openai
import pytest
from conftest import run_to_completion

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

EOS = 257  # the byte tokenizer's <|eos|>


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_grammar_that_may_continue_keeps_generating_until_it_stops(make_engine, seed):
    """`[0-9]{1,5}` accepts after one digit but allows four more: with EOS ignored (and made
    unattractive) the output goes on to five digits, where the grammar stops the request."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True, logit_bias={EOS: -100.0},
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{1,5}"))
    (output,) = run_to_completion(make_engine(), [([5, 6, 7], params)])
    completion = output.outputs[0]
    assert re.fullmatch("[0-9]{5}", completion.text), completion.text
    assert completion.finish_reason == "stop" and len(completion.token_ids) == 5


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_an_empty_regex_or_grammar_is_refused(kind):
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} must be a non-empty string"):
        StructuredOutputsParams(**{kind: ""})


def test_an_empty_regex_over_http_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="random", prompt="x", max_tokens=3, extra_body={"guided_regex": ""})
    assert "non-empty" in raised.value.body["message"]


def test_masks_along_guesses_never_allow_tokens_past_the_grammars_vocabulary():
    """The model's vocabulary (288: the grammar's bitmask words, full) is larger than the grammar's
    (258, the byte tokenizer's). Every row of a grammar's entry forbids the tokens past 258: the rows
    along the allowed guesses, and the rows after a forbidden guess, which otherwise allow all."""
    tokenizer = ByteTokenizer()
    llg_tokenizer = make_llg_tokenizer(tokenizer, tokenizer.vocab_size)
    grammar_vocab_size, model_vocab_size = llg_tokenizer.vocab_size, 288
    assert grammar_vocab_size < model_vocab_size
    matcher = llguidance.LLMatcher(llg_tokenizer, llguidance.grammar_from("regex", "[a-z]+"))
    state = GrammarState(matcher, grammar_vocab_size)
    guesses = [ord("a"), ord("b"), ord("1"), ord("c")]  # "1" is forbidden: the rows after it allow all
    masks = unpack_bitmask(GrammarMasker(model_vocab_size).masks([(None, []), (state, guesses)]), model_vocab_size)
    assert masks.shape == (1 + 1 + len(guesses), model_vocab_size)
    assert masks[0].all()  # no grammar: everything
    lowercase = list(range(ord("a"), ord("z") + 1))
    for row in masks[1:4]:  # now, after "a", after "ab"
        assert np.flatnonzero(row).tolist()[:len(lowercase)] == lowercase
    for row in masks[4:]:  # after the forbidden guess
        assert row[:grammar_vocab_size].all()
    assert not masks[1:, grammar_vocab_size:].any()
    assert matcher.get_error() == "" and not matcher.is_stopped()  # the guesses were rolled back


# --- llguidance's limits, met once tokens arrive ----------------------------------------------------

EXPLODING = {"regex": "a{1000}{1000}", "grammar": "start: " + " | ".join(f'"w{i}"' for i in range(6000))}


@pytest.mark.parametrize("kind", sorted(EXPLODING))
def test_check_walks_the_first_tokens_and_refuses_a_grammar_past_a_limit_in_one_line(kind):
    """Both pass llguidance's validation; the lexer (too many states) or the parser (a row of 6,001
    items) fails at the first token."""
    params = StructuredOutputsParams(**{kind: EXPLODING[kind]})
    params.verify()
    compiler = GrammarCompiler(ByteTokenizer(), 258)
    with pytest.raises(ValueError, match=f"^structured_outputs.{kind} breaks a limit of the grammar engine within "
                                         r"its first tokens: [^\n]+$"):
        compiler.check(params)
    compiler.check(StructuredOutputsParams(regex="[ab]{1000}"))  # long, within the limits
    compiler.check(StructuredOutputsParams(json_object=True))


def test_a_state_whose_grammar_broke_a_limit_accepts_nothing_not_even_eos():
    """Every state compiled from one spec shares its lexer: once one breaks it, the others start failed,
    their mask allows only EOS, and taking it must not pass for the grammar's end."""
    tokenizer = ByteTokenizer()
    llg_tokenizer = make_llg_tokenizer(tokenizer, tokenizer.vocab_size)
    compiled = llguidance.LLMatcher(llg_tokenizer, StructuredOutputsParams(regex="q{1000}{1000}").grammar_text())
    masker = GrammarMasker(tokenizer.vocab_size)

    def allowed(state: GrammarState) -> list[int]:  # as the engine does: the mask, then the sampled token
        return np.flatnonzero(unpack_bitmask(masker.masks([(state, [])]), tokenizer.vocab_size)[0]).tolist()

    first = GrammarState(compiled.deep_copy(), llg_tokenizer.vocab_size)
    assert allowed(first) == [ord("q")]
    assert not first.accept(ord("q")) and first.error == "lexer error: too many expressions constructed"
    second = GrammarState(compiled.deep_copy(), llg_tokenizer.vocab_size)
    assert allowed(second) == [EOS]
    assert not second.accept(EOS)
