"""The offline API, vLLM's surface: `LLM(model=...).generate(prompts, SamplingParams(...))`.

A thin loop over LLMEngine.step(); outputs come back in input order.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from vllmlite.engine import LLMEngine
from vllmlite.outputs import RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer

PromptInput = str | dict


class LLM:
    def __init__(self, model: str = "default", dtype: str = "float32", seed: int = 0, *,
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 swap_space: float = 1.0, speculative_config: dict | None = None,
                 kernels: str | None = None, quantization: str | None = None) -> None:
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                            enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode,
                            swap_space=swap_space)
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=max_model_len)
        speculative = SpeculativeConfig.from_dict(speculative_config) if speculative_config else None
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, seed=seed, cache=cache,
                                             scheduler=scheduler, speculative=speculative, kernels=kernels,
                                             quantization=quantization))
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in input order.

        A prompt is a string or {"prompt_token_ids": [...]} (optionally with "prompt").
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, _prompt_value(prompt), p)
            ids.append(request_id)
        return self._run(ids, use_tqdm and len(ids) >= 8)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True) -> list[RequestOutput]:
        """Render each conversation through the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return params

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(len(request_ids)) if show_progress else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(len(finished), sum(len(c.token_ids) for o in finished.values()
                                                           for c in o.outputs))
        if progress is not None:
            progress.close()
        return [finished[i] for i in request_ids]


def _prompt_value(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt["prompt"]
    raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")


class _Progress:
    """A one-line progress bar on stderr: requests done, output tokens and tokens/s."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.perf_counter()

    def update(self, done: int, tokens: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        filled = 30 * done // self.total
        sys.stderr.write(f"\rgenerate [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} "
                         f"{tokens} tokens {tokens / elapsed:.1f} tok/s ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
