"""`LLM(model=..., **engine_args)` takes what a vLLM script passes, and `generate(use_tqdm=...)` shows
vLLM's progress bar."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from vllmlite.llm import LLM
from vllmlite.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["hello", "the quick brown fox", {"prompt_token_ids": [5, 6, 7]}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random", num_blocks=256)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_vllm_keywords_construct_an_engine_that_generates_the_same_greedy_text(llm):
    vllm_style = LLM(model="random", dtype="auto", gpu_memory_utilization=0.01, tensor_parallel_size=1,
                     trust_remote_code=True, enforce_eager=True, disable_custom_all_reduce=True,
                     kv_cache_dtype="auto", cpu_offload_gb=0, disable_log_stats=True, seed=0,
                     max_model_len=64, swap_space=0, max_num_seqs=4, tokenizer="random")
    assert vllm_style.engine.config.dtype == "float32" and vllm_style.engine.max_model_len == 64
    assert vllm_style.engine.get_stats().scheduler.num_kv_blocks > 0
    got = texts(vllm_style.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(len(o.outputs[0].token_ids) == 6 for o in vllm_style.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("kwargs, name", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"dtype": "int4"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_impossible_values_raise_a_value_error_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM("random", **kwargs)


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'max_num_sequences'"):
        LLM("random", max_num_sequences=4)


def test_use_tqdm_shows_vllms_progress_bar_on_stderr(llm, capsys):
    outputs = llm.generate(PROMPTS, GREEDY)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "100%" in err
    assert "est. speed input:" in err and "toks/s, output:" in err
    assert texts(outputs) == texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert capsys.readouterr().err == ""


def test_use_tqdm_may_be_a_callable_that_makes_the_bar(llm):
    made: list[dict] = []
    sink = io.StringIO()

    def make_bar(**kwargs) -> tqdm:
        made.append(kwargs)
        return tqdm(file=sink, **kwargs)

    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=make_bar)
    assert made and made[0]["total"] == 2 and made[0]["desc"] == "Processed prompts"
    assert "2/2" in sink.getvalue()


def test_chat_still_renders_and_generates(llm, capsys):
    outputs = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 6
    assert "Processed prompts" in capsys.readouterr().err
