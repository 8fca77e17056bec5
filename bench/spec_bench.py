"""Speculative decoding benchmark: forward passes, wall time and acceptance, with and without it.

    OPENBLAS_NUM_THREADS=1 python -m bench.spec_bench   # default model, about 2 minutes on 2 cores
    python -m bench.spec_bench --quick --model random

Each prompt kind (repetitive, code-like, plain text) runs greedily, one request at a time (where
speculation matters most: decoding is latency-bound), under every configuration in --configs.
Greedy output must be identical with speculation on and off; the script checks it.
Raw results go to results/bench_spec.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
from bench.report import REPO_ROOT, machine_info, module_command
from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.models.loader import load_model
from vllmlite.sampling_params import SamplingParams

PROMPTS = {
    "repetitive": "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, "
                  "grape. apple, banana, cherry, date, elderberry, fig, grape. apple, banana,",
    "code": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
            "    return a * b\n\n\ndef div(a, b):\n",
    "plain": "The history of the printing press begins in the fifteenth century, when",
}
CONFIGS = {
    "off": None,
    "ngram_k4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "self_draft_L8_k3": {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 8},
}


def run(loaded, model: str, spec: dict | None, prompt: str, max_tokens: int) -> dict:
    if spec and spec.get("num_draft_layers", 0) >= loaded.config.num_layers:
        spec = {**spec, "num_draft_layers": max(1, loaded.config.num_layers // 4)}  # tiny models
    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(),
                          speculative=SpeculativeConfig.from_dict(spec) if spec else None)
    engine = LLMEngine(config, loaded)
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    output = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            output = out
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    spec = stats.scheduler.spec_decode
    return {
        "token_ids": output.outputs[0].token_ids,
        "seconds": elapsed,
        "output_tokens_per_s": max_tokens / elapsed,
        "target_forward_passes": stats.num_forward_passes,
        "draft_forward_passes": stats.num_draft_forward_passes,
        "draft_tokens": spec.num_draft_tokens,
        "accepted_tokens": spec.num_accepted_tokens,
        "acceptance_rate": spec.acceptance_rate,
        "accepted_per_position": list(spec.accepted_per_position),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true", help="16 tokens per run, for a smoke test")
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "bench_spec.json"))
    args = parser.parse_args()
    max_tokens = 16 if args.quick else args.max_tokens
    loaded = load_model(args.model)
    rows = []
    for kind, prompt in PROMPTS.items():
        baseline = None
        for name, spec in CONFIGS.items():
            print(f"[{time.strftime('%H:%M:%S')}] {kind:10s} {name:18s} ...", end=" ", flush=True)
            row = run(loaded, args.model, spec, prompt, max_tokens)
            baseline = baseline or row
            row.update(prompt_kind=kind, config=name,
                       speedup=baseline["seconds"] / row["seconds"],
                       identical_to_off=row["token_ids"] == baseline["token_ids"])
            print(f"{row['seconds']:6.2f} s  passes {row['target_forward_passes']:4d}  "
                  f"accept {row['acceptance_rate']:.0%}  speedup {row['speedup']:.2f}x  "
                  f"same output: {row['identical_to_off']}")
            rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"command": module_command("bench.spec_bench"), "machine": machine_info(),
              "model": args.model, "max_tokens": max_tokens, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    if not all(r["identical_to_off"] for r in rows):
        sys.exit("greedy output changed under speculation: this is a bug")


if __name__ == "__main__":
    main()
