"""InputProcessor: the engine's intake. One `add_request` call becomes the Requests the scheduler runs
(the prompt encoded and checked, n/best_of samples each with its own seed), and a constrained request
waits here until its grammar has compiled.

Knows the tokenizer, the request limits and the grammar compiler; knows nothing of scheduling, blocks,
the model or outputs (the engine registers what this returns with them).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vllmlite.core.request import FinishReason, Request
from vllmlite.engine.output_processor import OutputProcessor
from vllmlite.engine.request_limits import RequestLimits, truncated_prompt
from vllmlite.pooling_params import PoolingParams, PoolingType
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import Tokenizer
from vllmlite.worker.sampling import make_generator
from vllmlite.worker.structured_output import GrammarCompiler

Prompt = str | list[int]
GRAMMAR_WAIT_SECONDS = 0.05  # an idle step waits this long at most for a grammar to compile


@dataclass
class NewRequest:
    """One `add_request` call, processed: its samples (one unless n or best_of > 1) and what the
    output processor keeps of it."""

    request_id: str
    prompt_text: str | None                  # the prompt as the caller gave it, if it was text
    params: SamplingParams | PoolingParams   # the engine's own copy of the caller's params
    samples: list[Request]

    @property
    def is_pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)

    @property
    def needs_grammar(self) -> bool:
        return self.samples[0].sampling_params.structured_outputs is not None


class CompiledRequests(NamedTuple):
    """What `pop_compiled` hands the engine: each ready request's samples (first, then forks), every
    one with its own grammar state, and the samples whose grammar failed, finished in error."""

    ready: list[list[Request]]
    failed: list[Request]


class _Compiling(NamedTuple):
    """A request whose grammar is compiling: it joins the scheduler when the future is done."""

    grammar: Future
    samples: list[Request]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: RequestLimits, pooling: PoolingType,
                 seed: int | None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._pooling = pooling
        self._seed_rng = np.random.default_rng(seed)  # seeds of the requests that bring none
        # Its thread and llguidance's view of the vocabulary start with the first constrained request.
        self._grammar_compiler = GrammarCompiler(tokenizer, limits.vocab_size)
        self._compiling: list[_Compiling] = []

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams, *,
                arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                client_id: str | None = None) -> NewRequest:
        """Encode, check and fan out one request; raises ValueError (a client error) if it cannot run.

        The engine keeps its own validated copy of `params` (as vLLM clones them): fields assigned
        since construction are checked here, and assigning fields later never reaches this request.
        """
        params = params.clone()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        new = NewRequest(request_id, prompt if isinstance(prompt, str) else None, params, [])
        common = dict(arrival_time=arrival_time or time.monotonic(), priority=priority,
                      cache_salt=cache_salt, client_id=client_id)
        if isinstance(params, PoolingParams):
            self.limits.check(token_ids, params)
            # It never samples; the scheduler and runner read its (default) sampling params like any request's.
            new.samples.append(Request(request_id=request_id, prompt_token_ids=token_ids,
                                       sampling_params=SamplingParams(), max_tokens=0, generator=make_generator(0),
                                       pooling_params=params, pooling=self._pooling, **common))
            return new
        internal = OutputProcessor.sampling_params_for(params)
        internal.update_from_tokenizer(self.tokenizer)
        max_tokens = self.limits.check(token_ids, internal)
        token_ids = truncated_prompt(token_ids, internal)
        for i in range(params.num_sequences):
            # Sample i of a seeded request is that request alone with seed + i (as vLLM does).
            seed = int(self._seed_rng.integers(2**63)) if params.seed is None else params.seed + i
            new.samples.append(Request(
                request_id=request_id if i == 0 else f"{request_id}#{i}",
                prompt_token_ids=token_ids, sampling_params=internal, max_tokens=max_tokens,
                generator=make_generator(seed), parent_id=None if i == 0 else request_id, sample_index=i,
                **common))
        return new

    def check_grammar(self, structured_outputs: StructuredOutputsParams) -> None:
        """`GrammarCompiler.check`: ValueError unless the grammar compiles and takes its first tokens
        within llguidance's limits. Thread-safe; it compiles into the cache the request then uses."""
        self._grammar_compiler.check(structured_outputs)

    def compile_grammar(self, new: NewRequest) -> None:
        """Hold a constrained request back until its grammar has compiled (off the step thread)."""
        structured_outputs = new.samples[0].sampling_params.structured_outputs
        self._compiling.append(_Compiling(self._grammar_compiler.submit(structured_outputs), new.samples))

    def pop_compiled(self, idle: bool) -> CompiledRequests:
        """The requests whose grammar is done compiling, in the order they came. `idle` (nothing else
        to run): wait a little for a compile rather than let the engine spin."""
        done = CompiledRequests([], [])
        if not self._compiling:
            return done
        if idle:
            wait([c.grammar for c in self._compiling], GRAMMAR_WAIT_SECONDS, FIRST_COMPLETED)
        for compiling in [c for c in self._compiling if c.grammar.done()]:
            self._compiling.remove(compiling)
            error = compiling.grammar.exception()
            if error is not None:
                for request in compiling.samples:  # a ValueError is the grammar's own fault
                    request.finish(FinishReason.ERROR, error=str(error), is_client_error=isinstance(error, ValueError))
                done.failed.extend(compiling.samples)
                continue
            for request in compiling.samples:
                request.grammar = self._grammar_compiler.new_state(compiling.grammar.result())
            done.ready.append(compiling.samples)
        return done

    def abort(self, request_id: str) -> None:
        """Forget a request still waiting for its grammar; unknown ids are ignored."""
        self._compiling = [c for c in self._compiling if c.samples[0].request_id != request_id]

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar (they count as waiting in the engine's stats)."""
        return len(self._compiling)
