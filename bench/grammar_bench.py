"""Structured output cost: grammar work per engine step for a batch of constrained requests.

    python -m bench.grammar_bench                         # default model, 16 JSON-schema requests
    python -m bench.grammar_bench --quick --model random  # smoke test

16 requests with the same JSON schema (sampled, temperature 0.7) decode together. Grammar work is
what structured output adds to a step: computing the allowed-token masks (llguidance, into a
bitmask), advancing each grammar by its kept token, and applying the masks in the sampler (timed
afterwards: the same unpacking and np.copyto on the masks the run produced).
It is reported as a fraction of the time of the steps it ran in; the same prompts unconstrained
give the step time without it. The grammar compiles once (cached by schema), off the step thread;
its cold time, tokenizer bridge included, is reported too. Raw results: results/bench_grammar.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.measure import timed
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine_args import EngineArgs
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.worker.structured_output import GrammarMasker, GrammarState, unpack_bitmask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "email": {"type": "string", "maxLength": 60},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}}}
PROMPT = "Describe a fictional person as a JSON object with name, age, email and tags.\n"


class _Timer:
    """Wraps a class's method so every call adds its wall time to `seconds`; keeps what it returned."""

    def __init__(self, cls: type, name: str) -> None:
        self.seconds, self.calls, self.results = 0.0, 0, []
        original = getattr(cls, name)

        def timed_method(*args, **kwargs):
            timing = timed(lambda: original(*args, **kwargs))
            self.seconds += timing.wall_s[0]
            self.calls += 1
            self.results.append(timing.result)
            return timing.result
        setattr(cls, name, timed_method)
        self.restore = lambda: setattr(cls, name, original)


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict:
    """Add every request, wait for the grammars, then step to the end; step times and counts."""
    start = time.perf_counter()
    for i, p in enumerate(params):
        engine.add_request(str(i), PROMPT, p)
    step_s, outputs = [], {}
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step_s.append(time.perf_counter() - t)
    return {"wall_s": time.perf_counter() - start, "num_steps": len(step_s), "step_s": float(sum(step_s)),
            "outputs": [outputs[str(i)].outputs[0] for i in range(len(params))]}


def _mask_apply_seconds(masks: list[np.ndarray], vocab_size: int) -> float:
    """What the sampler's mask application (unpacking the grammar's bits, one np.copyto per sampling
    step) cost on the masks the run produced: [rows, words] packed bits each."""
    rng = np.random.default_rng(0)
    total = 0.0
    for packed in masks:
        logits = rng.standard_normal((len(packed), vocab_size))  # [rows, vocab]
        start = time.perf_counter()
        np.copyto(logits, -np.inf, where=~unpack_bitmask(packed, vocab_size))
        total += time.perf_counter() - start
    return total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quick", action="store_true", help="4 requests of 16 tokens")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    num_requests, max_tokens = (4, 16) if args.quick else (args.num_requests, args.max_tokens)
    engine = LLMEngine(EngineArgs(model=args.model, num_blocks=1024).create_engine_config())
    structured = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, structured_outputs=structured)
                   for i in range(num_requests)]
    plain = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, ignore_eos=True)
             for i in range(num_requests)]
    _run(engine, plain[:1])  # warm-up
    compile_start = time.perf_counter()
    engine.add_request("compile", PROMPT, SamplingParams(max_tokens=1, structured_outputs=structured))
    while engine.has_unfinished_requests():
        engine.step()
    cold_compile_s = time.perf_counter() - compile_start

    timers = [_Timer(GrammarMasker, "masks"), _Timer(GrammarState, "accept")]
    try:
        run = _run(engine, constrained)
    finally:
        for timer in timers:
            timer.restore()
    apply_s = _mask_apply_seconds(timers[0].results, engine.model_config.vocab_size)
    grammar_s = timers[0].seconds + timers[1].seconds + apply_s
    baseline = _run(engine, plain)
    documents = [o.text for o in run["outputs"]]
    num_valid = sum(_parses(text) for text, o in zip(documents, run["outputs"]) if o.finish_reason == "stop")
    result = {
        "machine": machine_info(), "command": module_command("bench.grammar_bench", argv), "model": args.model,
        "num_requests": num_requests, "max_tokens": max_tokens, "schema": SCHEMA,
        "cold_compile_s": cold_compile_s,
        "constrained": {"num_steps": run["num_steps"], "step_s": run["step_s"],
                        "mean_step_ms": run["step_s"] / run["num_steps"] * 1e3,
                        "num_finished_stop": sum(o.finish_reason == "stop" for o in run["outputs"]),
                        "num_valid_json_of_stopped": num_valid},
        "grammar": {"mask_s": timers[0].seconds, "mask_calls": timers[0].calls, "accept_s": timers[1].seconds,
                    "accept_calls": timers[1].calls, "mask_apply_s": apply_s, "total_s": grammar_s,
                    "fraction_of_step_time": grammar_s / run["step_s"],
                    "per_step_ms": grammar_s / run["num_steps"] * 1e3},
        "unconstrained": {"num_steps": baseline["num_steps"], "step_s": baseline["step_s"],
                          "mean_step_ms": baseline["step_s"] / baseline["num_steps"] * 1e3},
    }
    print(f"{num_requests} constrained requests: {run['num_steps']} steps, mean step "
          f"{result['constrained']['mean_step_ms']:.1f} ms (unconstrained {result['unconstrained']['mean_step_ms']:.1f} ms); "
          f"grammar {result['grammar']['per_step_ms']:.2f} ms/step = {result['grammar']['fraction_of_step_time']:.1%} "
          f"of step time; cold compile {cold_compile_s:.2f} s", file=sys.stderr)
    out = args.out or REPO_ROOT / "results" / ("bench_grammar_quick.json" if args.quick else "bench_grammar.json")
    write_json(out, result)
    print(f"wrote {out}", file=sys.stderr)
    return result


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    main()
