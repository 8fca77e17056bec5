"""Prompt logprobs on a prompt whose prefix is in the cache: every position still gets its entry,
the same as with the prefix cache off."""

from conftest import greedy, run_to_completion


def test_prompt_logprobs_cover_every_position_of_a_cached_prefix(make_engine):
    prompt = list(range(1, 40))  # nine full blocks of 4, cached by the first request
    asking = greedy(2, prompt_logprobs=1)
    cached = make_engine(block_size=4)
    run_to_completion(cached, [(prompt, greedy(2))])
    (hit,) = run_to_completion(cached, [(prompt, asking)])
    (fresh,) = run_to_completion(make_engine(block_size=4, enable_prefix_caching=False), [(prompt, asking)])
    assert len(fresh.prompt_logprobs) == len(prompt)  # the first position's entry is None, as vLLM's
    assert hit.prompt_logprobs == fresh.prompt_logprobs
