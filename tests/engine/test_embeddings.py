"""Embeddings through the engine: one vector per prompt, equal to pooling a dense forward pass over
the whole prompt, whatever the serving machinery does (block size, chunking, batching with
generation, prefix caching, preemption)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import greedy, make_prompts, run_to_completion
from reference import dense_greedy, dense_hidden

from vllmlite import LLM, EmbeddingRequestOutput, PoolingParams
from vllmlite.engine_args import EngineArgs

POOLINGS = ["last", "mean"]


def expected_embedding(tiny_model, prompt: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    """The final-norm hidden states of one dense pass over the prompt, pooled, then L2-normalized."""
    hidden = dense_hidden(tiny_model, prompt)            # [len, hidden]
    vector = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    return vector / np.linalg.norm(vector) if normalize else vector


def embeddings_of(engine, prompts: list[list[int]], **run_kwargs) -> list[np.ndarray]:
    outputs = run_to_completion(engine, [(p, PoolingParams()) for p in prompts], **run_kwargs)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished and o.error is None for o in outputs)
    return [np.array(o.outputs.embedding) for o in outputs]


def assert_matches(tiny_model, prompts, embeddings, pooling) -> None:
    assert len(embeddings) == len(prompts) > 0
    for prompt, embedding in zip(prompts, embeddings):
        np.testing.assert_allclose(embedding, expected_embedding(tiny_model, prompt, pooling), rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(6, seed=21, min_len=1, max_len=50)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9])
def test_embedding_equals_pooled_dense_forward(make_engine, tiny_model, pooling, length):
    prompt = make_prompts(1, seed=length, min_len=length, max_len=length)[0]
    [embedding] = embeddings_of(make_engine(block_size=4, pooling=pooling), [prompt])
    assert embedding.shape == (tiny_model.config.hidden_size,)
    assert np.linalg.norm(embedding) == pytest.approx(1.0, abs=1e-12)
    assert_matches(tiny_model, [prompt], [embedding], pooling)


def test_last_and_mean_pooling_differ(make_engine, prompts):
    last = embeddings_of(make_engine(pooling="last"), prompts[:1])[0]
    mean = embeddings_of(make_engine(pooling="mean"), prompts[:1])[0]
    assert len(prompts[0]) > 1 and np.abs(last - mean).max() > 1e-3


@pytest.mark.parametrize("pooling", POOLINGS)
def test_normalize_false_gives_the_raw_pooled_vector(make_engine, tiny_model, prompts, pooling):
    engine = make_engine(pooling=pooling)
    [output] = run_to_completion(engine, [(prompts[0], PoolingParams(normalize=False))])
    want = expected_embedding(tiny_model, prompts[0], pooling, normalize=False)
    np.testing.assert_allclose(output.outputs.embedding, want, rtol=0, atol=1e-10)
    assert abs(np.linalg.norm(want) - 1.0) > 1e-3  # so the check above is not the normalized vector


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("block_size, budget", [(1, 4096), (4, 3), (4, 8), (16, 7), (64, 4096)])
def test_embedding_invariant_to_block_size_and_chunking(make_engine, tiny_model, prompts, pooling, block_size,
                                                        budget):
    engine = make_engine(pooling=pooling, block_size=block_size, num_blocks=4096 // block_size,
                         max_num_batched_tokens=budget)
    assert_matches(tiny_model, prompts, embeddings_of(engine, prompts), pooling)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_embeddings_batched_with_generation_change_no_token(make_engine, tiny_model, prompts, pooling):
    """Generation and embedding requests arrive interleaved and share steps (chunked, 16 tokens a
    step); every greedy token is the dense reference's and every embedding is too."""
    gen_prompts = make_prompts(4, seed=22, min_len=5, max_len=30)
    requests = [(p, greedy(8)) for p in gen_prompts] + [(p, PoolingParams()) for p in prompts]
    arrivals = {i: 2 * i for i in range(len(requests))}
    engine = make_engine(pooling=pooling, block_size=4, max_num_batched_tokens=16)
    outputs = run_to_completion(engine, requests, arrivals=arrivals)
    assert len(outputs) == len(requests)
    for prompt, output in zip(gen_prompts, outputs):
        assert output.outputs[0].token_ids == dense_greedy(tiny_model, prompt, 8)
    assert_matches(tiny_model, prompts, [np.array(o.outputs.embedding) for o in outputs[len(gen_prompts):]], pooling)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_embedding_invariant_to_prefix_caching(make_engine, tiny_model, pooling, enable_prefix_caching):
    """A shared 24-token prefix is published by a generation request first. Last pooling may take
    the prefix hit (only the last position's state matters); mean pooling never does (it needs
    every position computed)."""
    shared = make_prompts(1, seed=23, min_len=24, max_len=24)[0]
    prompts = [shared + p for p in make_prompts(3, seed=24, min_len=2, max_len=9)]
    engine = make_engine(pooling=pooling, block_size=4, enable_prefix_caching=enable_prefix_caching)
    run_to_completion(engine, [(shared + [7, 7], greedy(2))])
    outputs = run_to_completion(engine, [(p, PoolingParams()) for p in prompts])
    assert_matches(tiny_model, prompts, [np.array(o.outputs.embedding) for o in outputs], pooling)
    hits = [o.num_cached_tokens for o in outputs]
    assert hits == ([24] * 3 if enable_prefix_caching and pooling == "last" else [0] * 3)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_embedding_invariant_to_preemption(make_engine, tiny_model, pooling, mode):
    """Generation requests that grow (older, so never the victim) force the newest running
    requests, embeddings mid-prompt among them, out of a 24-block cache; a recomputed mean starts
    its sum afresh, a swapped one keeps it."""
    gen_prompts = make_prompts(3, seed=25, min_len=10, max_len=20)
    embed_prompts = make_prompts(4, seed=26, min_len=20, max_len=40)
    requests = [(p, greedy(24)) for p in gen_prompts] + [(p, PoolingParams()) for p in embed_prompts]
    engine = make_engine(pooling=pooling, block_size=4, num_blocks=24, preemption_mode=mode, swap_space=0.01,
                         max_num_batched_tokens=8)
    outputs = run_to_completion(engine, requests, arrivals={i: i for i in range(len(requests))})
    embedded = outputs[len(gen_prompts):]
    assert sum(o.metrics.num_preemptions for o in embedded) > 0
    assert len(outputs) == len(requests)
    for prompt, output in zip(gen_prompts, outputs):
        assert output.outputs[0].token_ids == dense_greedy(tiny_model, prompt, 24)
    assert_matches(tiny_model, embed_prompts, [np.array(o.outputs.embedding) for o in embedded], pooling)


def test_embedding_request_is_never_speculated(make_engine, tiny_model, prompts):
    engine = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    requests = [(p, PoolingParams()) for p in prompts] + [([1, 2, 3, 1, 2, 3, 1, 2], greedy(8))]
    outputs = run_to_completion(engine, requests)
    assert_matches(tiny_model, prompts, [np.array(o.outputs.embedding) for o in outputs[:-1]], "last")


def test_prompt_too_long_is_refused_and_one_filling_the_context_is_embedded(make_engine, tiny_model):
    engine = make_engine(max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length is 32"):
        engine.add_request("long", list(range(33)), PoolingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], PoolingParams())
    [embedding] = embeddings_of(engine, [list(range(32))])  # no room is needed for an output token
    assert_matches(tiny_model, [list(range(32))], [embedding], "last")


def test_prompt_that_never_fits_the_cache_is_refused(make_engine):
    engine = make_engine(block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match="KV cache holds at most 7 prompt tokens"):
        engine.add_request("big", list(range(20)), PoolingParams())
    assert not engine.has_unfinished_requests()


def test_aborted_embedding_frees_its_blocks(make_engine):
    engine = make_engine(block_size=4, max_num_batched_tokens=4)
    engine.add_request("e", list(range(30)), PoolingParams())
    engine.step()
    assert engine.get_stats().scheduler.num_kv_blocks_used > 0
    engine.abort_request("e")
    stats = engine.get_stats()
    assert stats.scheduler.num_kv_blocks_used == 0 and stats.num_unfinished_requests == 0
    assert not engine.scheduler.requests


def test_pooling_knob_is_validated():
    with pytest.raises(ValueError, match="pooling must be one of"):
        EngineArgs(model="random", pooling="cls").create_engine_config()
    assert EngineArgs(model="random", pooling="mean").create_engine_config().pooling == "mean"


def test_llm_embed_has_vllms_shape(tiny_model):
    llm = LLM(model="random", dtype="float64", num_blocks=64, pooling="mean")
    tokenizer = llm.get_tokenizer()
    outputs = llm.embed(["hello there", {"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert [o.request_id for o in outputs] == ["0", "1"]
    assert outputs[0].prompt_token_ids == tokenizer.encode("hello there")
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    for output in outputs:
        assert output.finished and output.outputs.hidden_size == tiny_model.config.hidden_size
        assert np.linalg.norm(output.outputs.embedding) == pytest.approx(1.0)
    raw = llm.embed("hello there", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(np.array(raw) / np.linalg.norm(raw), outputs[0].outputs.embedding, atol=1e-12)
    with pytest.raises(ValueError, match="got 1 PoolingParams for 2 prompts"):
        llm.embed(["a", "b"], [PoolingParams()], use_tqdm=False)


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    return LLM(model="default", num_blocks=256, max_num_batched_tokens=64)


@pytest.mark.real_model
def test_real_model_embeddings_are_unit_vectors_whatever_the_batch(real_llm):
    texts = ["The cat sat on the mat.", "Paris is the capital of France.",
             "def add(a, b):\n    return a + b", "Stock markets fell sharply on Monday."]
    batched = [np.array(o.outputs.embedding) for o in real_llm.embed(texts, use_tqdm=False)]
    alone = [np.array(real_llm.embed(t, use_tqdm=False)[0].outputs.embedding) for t in texts]
    assert len(batched) == len(alone) == len(texts)
    for b, a in zip(batched, alone):
        assert b.shape == (576,) and np.linalg.norm(b) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)  # float32: batch shapes change rounding only
    similarity = np.array(batched) @ np.array(batched).T
    assert np.all(similarity[~np.eye(len(texts), dtype=bool)] < 0.9999)  # different texts, different vectors


@pytest.mark.real_model
def test_real_model_paraphrases_are_closer_than_unrelated_sentences(real_llm):
    """SmolLM2 is no embedding model, but its last-token states already tell these apart (margins
    0.15-0.2 when written; the assertion asks for 0.05)."""
    groups = [("The cat sat on the mat.", "A cat was sitting on the rug.",
               "Interest rates were raised by the central bank."),
              ("How do I bake bread at home?", "What is a simple recipe for homemade bread?",
               "The football match ended in a draw."),
              ("The weather is sunny and warm today.", "It is a bright, hot day outside.",
               "Python is a programming language."),
              ("He bought a new car yesterday.", "Yesterday he purchased a new automobile.",
               "Photosynthesis happens in plant leaves.")]
    for group in groups:
        a, b, c = (np.array(o.outputs.embedding) for o in real_llm.embed(list(group), use_tqdm=False))
        assert a @ b > max(a @ c, b @ c) + 0.05, group
