"""The offline API, vLLM's surface: `LLM(model=..., **engine_args).generate(prompts, SamplingParams(...))`,
`.beam_search(prompts, BeamSearchParams(...))` and `.embed(prompts)`.

A thin loop over LLMEngine.step(); outputs come back in input order. The keywords are EngineArgs'
fields, vLLM's names included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from vllmlite.beam_search import BeamSearch, BeamSearchOutput, step_sampling_params
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine_args import ENGINE_ARG_NAMES, EngineArgs
from vllmlite.outputs import EmbeddingRequestOutput, OutputProgress, PositionLogprobs, RequestOutput
from vllmlite.pooling_params import PoolingParams
from vllmlite.sampling_params import BeamSearchParams, SamplingParams
from vllmlite.tokenizer import Tokenizer

PromptInput = str | dict


class LLM:
    def __init__(self, model: str = EngineArgs.model, **engine_args: Any) -> None:
        """Load `model` and start an engine; `engine_args` are EngineArgs' fields (ValueError names a
        bad value, TypeError an unknown keyword)."""
        unknown = sorted(set(engine_args) - ENGINE_ARG_NAMES)
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args).create_engine_config())
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling params a request gets when it gives none (a new object, free to change).
        No model here carries generation defaults, so these are SamplingParams()'s."""
        return SamplingParams()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in input order.

        A prompt is a string or {"prompt_token_ids": [...]} (optionally with "prompt"). `use_tqdm`
        shows a progress bar on stderr; a callable is used in place of `tqdm` to make it.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(self._add_requests(prompts, self._params_per_prompt(sampling_params, len(prompts))),
                         use_tqdm)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: one BeamSearchOutput per prompt, in input order, its sequences best first
        (vllmlite/beam_search.py says how they are chosen and scored). A sequence's `text` is its
        tokens decoded, prompt included, as in vLLM.

        Each step sends every live beam of every prompt as a one-token request whose prompt is the
        beam's tokens, as vLLM does. The beams share their blocks through the prefix cache: the full
        blocks of the prompt and of a common past are computed once and referenced by every beam, only
        a beam's last partial block is computed again, and a pruned beam's blocks are released when
        its request ends. `use_tqdm` shows a bar over the steps.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenizer = self.engine.tokenizer
        searches = [BeamSearch(self._prompt_token_ids(p), params, tokenizer.eos_token_id, self.engine.max_model_len)
                    for p in prompts]
        step_params = step_sampling_params(params)
        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="step", dynamic_ncols=True) if use_tqdm else None
        while running := [search for search in searches if not search.is_done]:
            beams = [{"prompt_token_ids": beam.tokens} for search in running for beam in search.live]
            outputs = iter(self._run(self._add_requests(beams, [step_params] * len(beams)), use_tqdm=False))
            for search in running:
                search.advance([_next_token_logprobs(next(outputs)) for _ in search.live])
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        results = [BeamSearchOutput(search.best()) for search in searches]
        for sequence in (s for result in results for s in result.sequences):
            sequence.text = tokenizer.decode(sequence.tokens)
        return results

    def _prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        value = _prompt_value(prompt)
        return self.engine.tokenizer.encode(value) if isinstance(value, str) else value

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | Callable[..., tqdm] = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: the final-norm hidden states pooled as the
        engine's `pooling` knob says (last token or mean), L2-normalized unless the params say not.
        Embedding requests run through the same scheduler as generation (chunked, batched)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(pooling_params, len(prompts), PoolingParams)
        return self._run(self._add_requests(prompts, params), use_tqdm)

    def _add_requests(self, prompts: Sequence[PromptInput], params: list) -> list[str]:
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, _prompt_value(prompt), p, final_only=True)  # _run reads the last alone
            ids.append(request_id)
        return ids

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: render each conversation, then generate; each output's `prompt` is the
        rendered text. `chat_template` replaces the model's template (rendered in the same jinja
        sandbox), `tools` reach a template with a tools section, and `chat_template_kwargs` are
        extra variables the template reads (Qwen3's `enable_thinking`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt, tools=tools,
                                                 **(chat_template_kwargs or {}))
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt["prompt"]  # the engine got ids; vLLM's chat outputs carry the text
        return outputs

    @staticmethod
    def _params_per_prompt(params, count: int, kind: type = SamplingParams) -> list:
        """One `kind` (SamplingParams or PoolingParams) per prompt: the default, one for all, or a list."""
        if params is None:
            return [kind()] * count
        if isinstance(params, kind):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} {kind.__name__} for {count} prompts")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list:
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        progress = _Progress(len(request_ids), use_tqdm if callable(use_tqdm) else tqdm) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if not isinstance(output, OutputProgress) and output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(output)
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


def _next_token_logprobs(output: RequestOutput) -> PositionLogprobs:
    """The logprobs of the one token a beam's step request computed; its error if it failed."""
    if output.error is not None:
        raise RuntimeError(f"beam search: a step request failed: {output.error}")
    return output.outputs[0].logprobs[0]


class _Progress:
    """vLLM's bar: prompts processed, with the input and output tokens/s so far."""

    def __init__(self, total: int, make_bar: Callable[..., tqdm]) -> None:
        self.bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.num_input_tokens = 0
        self.num_output_tokens = 0

    def update(self, output: RequestOutput | EmbeddingRequestOutput) -> None:
        if isinstance(output, EmbeddingRequestOutput):
            self.num_input_tokens += len(output.prompt_token_ids)
        else:
            self.num_input_tokens += len(output.prompt_token_ids) * len(output.outputs)
            self.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.postfix = (f"est. speed input: {self.num_input_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.num_output_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
