"""Greedy agreement of each KV cache dtype with float32 K/V on a wider set of prompts than the 13
parity prompts of bench.quant_accuracy, where one prompt is 8% of the score:

    python -m bench.kv_agreement     # about 3 minutes on 2 cores

80 prompts on the default model's float32 weights: 60 windows of 20-299 tokens cut at random
(seed 123) from bench/data/coriolanus.txt, and 20 chat questions in the model's chat template.
Each is continued 32 tokens greedily (ignore_eos), all in one batch; a row counts the continuations
identical to float32 K/V's and the mean tokens before the first that differs. The row "int8
unturned" stores int8 K/V without the rotation (kv_dtype.py's module docstring), to show what it
buys. Raw results: results/kv_agreement.json.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from unittest import mock

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.quant_accuracy import PreloadedLLM
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite import SamplingParams
from vllmlite.kernels import kv_dtype
from vllmlite.models.loader import LoadedModel, load_model

TEXT = REPO_ROOT / "bench" / "data" / "coriolanus.txt"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
    "List three uses of a paperclip.", "Why is the sky blue?", "Translate 'good morning' to Spanish.",
    "Give me a recipe for pancakes.", "What does a CPU do?", "Tell me a joke about cats.",
    "Summarize the plot of Hamlet.", "How do plants make food?", "What is 17 times 23?",
    "Describe a sunset in one sentence.", "Name five programming languages.", "What is gravity?",
    "How do I boil an egg?", "Who wrote Pride and Prejudice?", "What is machine learning?",
    "Write a limerick about a dog.", "What are prime numbers?",
]
NUM_WINDOWS = 60
MAX_TOKENS = 32
MAX_MODEL_LEN = 448   # the longest prompt (299 tokens) and its continuation fit
NUM_BLOCKS = 2048     # of 16 tokens: every prompt of the batch at once
ROWS = ("fp16", "bf16", "int8", "int8 unturned")


def prompts_of(loaded: LoadedModel) -> list[list[int]]:
    """The 60 text windows, then the 20 chat questions, as token ids."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(TEXT.read_text())
    rng = np.random.default_rng(123)
    prompts = []
    for _ in range(NUM_WINDOWS):
        length = int(rng.integers(20, 300))
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + length])
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return prompts + [tokenizer.encode(chat.format(question)) for question in QUESTIONS]


def continuations(loaded: LoadedModel, prompts: list[list[int]], kv_cache_dtype: str) -> list[list[int]]:
    llm = PreloadedLLM(loaded, "none", MAX_MODEL_LEN, kv_cache_dtype, num_blocks=NUM_BLOCKS)   # the whole batch at once
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def compare(name: str, got: list[list[int]], ref: list[list[int]]) -> dict:
    same = [a == b for a, b in zip(got, ref)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), MAX_TOKENS) for a, b in zip(got, ref)]
    return {"name": name, "identical": sum(same), "of": len(same),
            "identical_text_windows": sum(same[:NUM_WINDOWS]), "identical_chat": sum(same[NUM_WINDOWS:]),
            "mean_tokens_before_first_difference": float(np.mean(first))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "kv_agreement.json")
    args = parser.parse_args(argv)
    start, machine = time.perf_counter(), machine_info()
    loaded = load_model("default")
    prompts = prompts_of(loaded)
    ref = continuations(loaded, prompts, "auto")
    rows = []
    for name in ROWS:
        unturned = name.endswith("unturned")
        with mock.patch.object(kv_dtype, "turned", lambda _: False) if unturned else contextlib.nullcontext():
            rows.append(compare(name, continuations(loaded, prompts, name.split()[0]), ref))
        r = rows[-1]
        print(f"{name:14s} identical to float32 K/V: {r['identical']}/{r['of']} (text {r['identical_text_windows']}"
              f"/{NUM_WINDOWS}, chat {r['identical_chat']}/{len(QUESTIONS)}); mean tokens before the first "
              f"difference {r['mean_tokens_before_first_difference']:.1f}", flush=True)
    report = {"command": module_command("bench.kv_agreement", argv), "machine": machine,
              "prompts": f"{NUM_WINDOWS} windows of {TEXT.relative_to(REPO_ROOT)} (20-299 tokens, seed 123) and "
                         f"{len(QUESTIONS)} chat questions; {MAX_TOKENS} greedy tokens each, ignore_eos",
              "rows": rows, "seconds": time.perf_counter() - start}
    write_json(args.out, report)
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
