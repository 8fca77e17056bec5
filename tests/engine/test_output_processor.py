"""The output processor on its own: sampled tokens in, RequestOutputs and stop-string hits out."""

from __future__ import annotations

from vllmlite.core.request import FinishReason, Request, RequestStatus
from vllmlite.engine.output_processor import OutputProcessor, StopStringHit
from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.sampling import make_generator

PROMPT = [ord(c) for c in "hi"]


def group_of_two(params: SamplingParams) -> list[Request]:
    """Two samples of one user request "g", as the engine makes them."""
    return [Request(request_id="g" if i == 0 else f"g#{i}", prompt_token_ids=PROMPT, sampling_params=params,
                    max_tokens=params.max_tokens, generator=make_generator(i), status=RequestStatus.RUNNING,
                    parent_id=None if i == 0 else "g", sample_index=i) for i in range(2)]


def append(request: Request, text: str) -> Request:
    for c in text:
        request.append_token(ord(c))
    return request


def test_an_n2_group_with_a_stop_string_hands_back_the_hit_and_reports_each_sample(tiny_model):
    params = SamplingParams(n=2, stop=["ab"], max_tokens=10)
    processor = OutputProcessor(tiny_model.tokenizer)
    first, second = group_of_two(params)
    processor.add_request("g", "hi", params, [first, second])

    # Step 1: "a" may begin the stop string, so it is held back from the text.
    assert processor.detokenize([append(first, "xa"), append(second, "y")]) == []
    [out] = processor.make_outputs()
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("g", "hi", PROMPT, False)
    assert [(c.index, c.text, c.delta_text, c.finish_reason) for c in out.outputs] == \
        [(0, "x", "x", None), (1, "y", "y", None)]
    assert out.outputs[0].delta_token_ids == [ord("x"), ord("a")]  # token ids are not held back

    # Step 2: sample 0 completes "ab" and one more token was sampled after it (a speculative round).
    hits = processor.detokenize([append(first, "bz"), append(second, "b")])
    assert hits == [StopStringHit(first, "ab")]
    assert first.output_token_ids == [ord(c) for c in "xab"]  # "z", sampled past the stop, is dropped
    assert not first.is_finished  # finishing is the engine's job, through the scheduler
    first.finish(FinishReason.STOP, "ab")
    [out] = processor.make_outputs()
    sample0, sample1 = out.outputs
    assert (sample0.text, sample0.delta_text, sample0.finish_reason, sample0.stop_reason) == ("x", "", "stop", "ab")
    assert (sample0.token_ids, sample0.delta_token_ids) == ([ord(c) for c in "xab"], [ord("b")])
    assert (sample1.text, sample1.delta_text, sample1.finish_reason) == ("yb", "b", None)
    assert not out.finished and processor.num_unfinished_requests == 1

    # Step 3: sample 1 ends on max_tokens; the group is done and forgotten.
    append(second, "c").finish(FinishReason.LENGTH)
    assert processor.detokenize([second]) == []
    [out] = processor.make_outputs()
    assert out.finished and out.metrics.finished_time is not None
    assert [(c.text, c.delta_text, c.finish_reason) for c in out.outputs] == [("x", "", "stop"), ("ybc", "c", "length")]
    assert processor.num_unfinished_requests == 0 and not processor.has_request("g")
    assert processor.detokenize([second]) == [] and processor.make_outputs() == []


def test_a_stop_string_in_an_already_finished_request_becomes_its_reason(tiny_model):
    params = SamplingParams(stop=["ab"], max_tokens=3)
    processor = OutputProcessor(tiny_model.tokenizer)
    request, _ = group_of_two(params)
    processor.add_request("g", None, params, [request])
    append(request, "abc").finish(FinishReason.LENGTH)  # max_tokens reached on the same step
    assert processor.detokenize([request]) == []       # nothing left for the engine to finish
    [out] = processor.make_outputs()
    assert out.finished and (out.outputs[0].text, out.outputs[0].finish_reason) == ("", "stop")
    assert out.outputs[0].stop_reason == "ab" and out.outputs[0].token_ids == [ord("a"), ord("b")]


def test_best_of_reports_once_the_n_most_likely_when_every_candidate_is_done(tiny_model):
    params = SamplingParams(n=1, best_of=2, max_tokens=1)
    internal = OutputProcessor.sampling_params_for(params)
    assert internal.logprobs == 0 and params.logprobs is None  # ranking needs logprobs, the user's stay unset
    processor = OutputProcessor(tiny_model.tokenizer)
    first, second = group_of_two(internal)
    processor.add_request("g", None, params, [first, second])
    first.cumulative_logprob, second.cumulative_logprob = -2.0, -1.0
    append(first, "p").finish(FinishReason.LENGTH)
    assert processor.detokenize([first]) == [] and processor.make_outputs() == []  # a candidate still runs
    append(second, "q").finish(FinishReason.LENGTH)
    processor.detokenize([second])
    [out] = processor.make_outputs()
    assert [(c.index, c.text, c.cumulative_logprob) for c in out.outputs] == [(0, "q", -1.0)]


def test_abort_returns_the_samples_and_forgets_the_group(tiny_model):
    params = SamplingParams(n=2, max_tokens=4)
    processor = OutputProcessor(tiny_model.tokenizer)
    samples = group_of_two(params)
    processor.add_request("g", None, params, samples)
    processor.detokenize([append(samples[0], "x")])
    assert processor.abort_request("g") == samples and processor.abort_request("g") == []
    assert processor.make_outputs() == [] and processor.num_unfinished_requests == 0


class RefusesToDecode:
    """A tokenizer whose decode fails: ids outside its vocabulary, as a model's bigger vocabulary
    behind a byte tokenizer gives (the GPU benchmark's random models)."""

    stop_token_ids = frozenset()

    def decode(self, token_ids, skip_special_tokens=True):
        raise AssertionError("decoded although detokenize=False")


def test_detokenize_false_never_decodes_the_prompt_or_the_output():
    params = SamplingParams(max_tokens=3, detokenize=False)
    processor = OutputProcessor(RefusesToDecode())
    request = Request(request_id="r", prompt_token_ids=[70000, 70001], sampling_params=params, max_tokens=3,
                      generator=make_generator(0), status=RequestStatus.RUNNING)
    processor.add_request("r", None, params, [request])
    for token in (90000, 90001):
        request.append_token(token)
    assert processor.detokenize([request]) == []
    [out] = processor.make_outputs()
    assert (out.outputs[0].text, out.outputs[0].token_ids) == ("", [90000, 90001])
