"""Drivers over one LLMEngine: static batching (admit B, run all B to completion, admit the next B)
and continuous batching (admit everything; the scheduler fills the batch as requests finish).

Both use the same engine, weights, sampler and token budget, so a row differs only in who may run
together. Sequential serving is static batching with B = 1.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.workload import BenchRequest
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.outputs import RequestOutput
from vllmlite.sampling_params import SamplingParams

StepObserver = Callable[[LLMEngine, dict], None]  # (engine, final outputs so far by request id)


def bench_params(max_tokens: int) -> SamplingParams:
    """Greedy, EOS ignored: every request produces exactly `max_tokens` tokens on every row."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_batches(engine: LLMEngine, requests: list[BenchRequest], batch_size: int | None,
                arrival_time: float, on_step: StepObserver) -> dict[str, RequestOutput]:
    """Serve `requests` in admission groups of `batch_size` (None: one group holding all of them).

    A group is admitted only when the previous one has fully finished, so with batch_size B at most B
    requests hold KV at once and a short request's slot idles until the group's longest one ends
    (static batching). With batch_size None the scheduler admits waiting requests whenever a sequence
    slot and blocks are free (continuous batching). Every request is stamped with `arrival_time`, so
    TTFT includes the time spent waiting for earlier groups. Returns the final output per request id.
    """
    group_size = batch_size or len(requests)
    finished: dict[str, RequestOutput] = {}
    for start in range(0, len(requests), group_size):
        for request in requests[start:start + group_size]:
            engine.add_request(request.request_id, request.prompt_token_ids, bench_params(request.max_tokens),
                               arrival_time=arrival_time)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            on_step(engine, finished)
    return finished
