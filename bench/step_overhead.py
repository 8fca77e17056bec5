"""Per-step Python overhead of the engine, without the model: what the GPU waits on between graphs.

    python -m bench.step_overhead                    # 256 and 64 sequences, about a minute on 2 cores
    python -m bench.step_overhead --baseline main    # the same, also for main's vllmlite, interleaved
    python -m bench.step_overhead --server-heap      # in a heap the size of the server process's
    python -m bench.step_overhead --quick            # smoke test

An LLMEngine on the random model whose forward pass is a stub returning a fixed logits array of the
right shape (each row's argmax a letter; no matmul), so a step costs only what runs around the
model: scheduling, the runner's batch building and the greedy sampler, the scheduler's update and
output processing (detokenization off and on). `--num-seqs` requests (prompts of `--prompt-len`
distinct random tokens, ignore_eos) are prefilled, then `--steps` decode steps are timed while every
one of them runs. Per phase (schedule, execute with the stub, update, outputs, the rest of `step()`,
total): microseconds of the engine thread's CPU time per sequence per step, the mean over the steps
(garbage collections included, wherever they land) and the median; CPU time, as a busy machine
disturbs it less than wall time (also reported). Then the same requests through AsyncLLMEngine (with
the server's metrics), one asyncio consumer each, `--async-tokens` tokens: tokens/s, also with the
start-up heap frozen as the server process does (gc.freeze), and the offline step loop's tokens/s
on the same work.

`--baseline REF` measures REF's `vllmlite/` (`git archive` into a temporary folder) and this tree's
alternately, each round of each in a fresh process (who goes first alternates), `--rounds` times
each, and reports each side's best round side by side. Raw results: results/bench_step_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import vllmlite  # (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.config import ceil_div
from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.engine_args import EngineArgs
from vllmlite.sampling_params import SamplingParams

PHASES = ("schedule", "execute", "update", "outputs")
MAX_NUM_BATCHED_TOKENS = 8192  # as bench.gpu runs


def make_engine(num_seqs: int, prompt_len: int, max_tokens: int) -> LLMEngine:
    """The random model with a stub forward pass, room for every request whole, and no preemption."""
    blocks_per_seq = ceil_div(prompt_len + max_tokens + 1, 16)
    config = EngineArgs(model="random", kernels="numpy", max_num_seqs=num_seqs,
                        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                        num_blocks=num_seqs * blocks_per_seq + 16).create_engine_config()
    engine = LLMEngine(config)
    vocab_size = engine.model_config.vocab_size
    logits = np.zeros((num_seqs, vocab_size), dtype=np.float32)      # [rows, vocab]
    logits[np.arange(num_seqs), ord("a") + np.arange(num_seqs) % 26] = 1.0  # row i decodes one letter

    def forward_logits(input_ids, meta, kv_cache, logits_rows, workspace=None):
        return logits[:len(logits_rows)]

    engine.model.forward_logits = forward_logits  # the runner calls it through its model
    return engine


def add_requests(engine: LLMEngine, num_seqs: int, prompt_len: int, max_tokens: int, detokenize: bool) -> None:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=detokenize)
    for i in range(num_seqs):
        engine.add_request(str(i), rng.integers(0, 256, prompt_len).tolist(), params)


def _timed(phases: dict[str, float], name: str, fn: Callable) -> Callable:
    """`fn`, adding the engine thread's CPU seconds in it to phases[name]."""
    def wrapper(*args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.thread_time() - started
    return wrapper


def offline_row(num_seqs: int, prompt_len: int, num_steps: int, detokenize: bool) -> dict:
    """Microseconds per sequence per step of each phase of `step()`, the median over `num_steps`
    decode steps in which all `num_seqs` requests run."""
    # The first prompts decode while the last ones prefill: none may finish before the timed steps end.
    max_tokens = num_steps + 2 * ceil_div(num_seqs * prompt_len, MAX_NUM_BATCHED_TOKENS) + 8
    engine = make_engine(num_seqs, prompt_len, max_tokens)
    add_requests(engine, num_seqs, prompt_len, max_tokens, detokenize)
    running = engine.scheduler.running
    while len(running) < num_seqs or any(r.num_output_tokens == 0 for r in running):
        engine.step()  # prefill: not measured
    phases = dict.fromkeys(PHASES, 0.0)
    scheduler = engine.scheduler
    scheduler.schedule = _timed(phases, "schedule", scheduler.schedule)
    scheduler.update = _timed(phases, "update", scheduler.update)
    engine._execute = _timed(phases, "execute", engine._execute)
    engine._process_outputs = _timed(phases, "outputs", engine._process_outputs)
    samples: dict[str, list[float]] = {name: [] for name in (*PHASES, "other", "total", "wall")}
    for _ in range(num_steps):
        for name in PHASES:
            phases[name] = 0.0
        started, started_cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        total, wall = time.thread_time() - started_cpu, time.perf_counter() - started
        if len(outputs) != num_seqs:
            raise AssertionError(f"a step of {num_seqs} decodes gave {len(outputs)} outputs")
        for name in PHASES:
            samples[name].append(phases[name])
        samples["other"].append(total - sum(phases.values()))
        samples["total"].append(total)
        samples["wall"].append(wall)
    # The mean is what throughput pays (a full garbage collection lands in one step of many); the
    # median shows the typical step.
    mean = {name: 1e6 * float(np.mean(values)) / num_seqs for name, values in samples.items()}
    median = {name: 1e6 * float(np.median(values)) / num_seqs for name, values in samples.items()}
    return {"num_seqs": num_seqs, "detokenize": detokenize, "num_steps": num_steps, "us_per_seq_step": mean,
            "median_us_per_seq_step": median}


def async_row(num_seqs: int, prompt_len: int, max_tokens: int) -> dict:
    """Tokens/s of the stubbed engine through AsyncLLMEngine with one consumer per request, and of
    the offline step loop on the same requests (detokenized, as the server does); and through
    AsyncLLMEngine again with the start-up heap frozen (gc.freeze), as the server process does."""
    engine = make_engine(num_seqs, prompt_len, max_tokens)
    add_requests(engine, num_seqs, prompt_len, max_tokens, detokenize=True)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    offline_s = time.perf_counter() - started
    async_s = _served_seconds(make_engine(num_seqs, prompt_len, max_tokens), num_seqs, prompt_len, max_tokens)
    engine = make_engine(num_seqs, prompt_len, max_tokens)
    gc.collect()
    gc.freeze()
    try:
        frozen_s = _served_seconds(engine, num_seqs, prompt_len, max_tokens)
    finally:
        gc.unfreeze()  # the next rounds start as this one did
    num_tokens = num_seqs * max_tokens
    return {"num_seqs": num_seqs, "max_tokens": max_tokens, "offline_tokens_per_s": num_tokens / offline_s,
            "async_tokens_per_s": num_tokens / async_s, "async_over_offline": offline_s / async_s,
            "async_frozen_heap_tokens_per_s": num_tokens / frozen_s}


def _served_seconds(engine: LLMEngine, num_seqs: int, prompt_len: int, max_tokens: int) -> float:
    seconds, num_tokens = asyncio.run(_consume_all(engine, num_seqs, prompt_len, max_tokens))
    if num_tokens != num_seqs * max_tokens:
        raise AssertionError(f"the consumers got {num_tokens} tokens, expected {num_seqs * max_tokens}")
    return seconds


async def _consume_all(engine: LLMEngine, num_seqs: int, prompt_len: int, max_tokens: int) -> tuple[float, int]:
    client = AsyncLLMEngine(engine, EngineMetrics("random"))  # as the server builds it (engine/factory.py)
    client.start()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [rng.integers(0, 256, prompt_len).tolist() for _ in range(num_seqs)]

    async def consume(i: int) -> int:
        num_tokens = 0
        async for output in client.generate(GenerateRequest(str(i), prompts[i], params)):
            num_tokens += len(output.outputs[0].delta_token_ids)
        return num_tokens

    try:
        started = time.perf_counter()
        counts = await asyncio.gather(*(consume(i) for i in range(num_seqs)))
        return time.perf_counter() - started, sum(counts)
    finally:
        client.shutdown()


def measure(args: argparse.Namespace) -> dict:
    """One round: every offline row, then the async row."""
    rows = [offline_row(n, args.prompt_len, args.steps, detokenize)
            for n in args.num_seqs for detokenize in (False, True)]
    for row in rows:
        us = row["us_per_seq_step"]
        print(f"  {row['num_seqs']:4d} seqs, detokenize {row['detokenize']!s:5}: "
              + "  ".join(f"{name} {us[name]:5.1f}" for name in (*PHASES, "other", "total", "wall")) + " us/seq/step",
              file=sys.stderr)
    served = async_row(max(args.num_seqs), args.prompt_len, args.async_tokens)
    print(f"  async {served['num_seqs']} consumers: {served['async_tokens_per_s']:.0f} tok/s "
          f"({served['async_frozen_heap_tokens_per_s']:.0f} with the heap frozen), offline "
          f"{served['offline_tokens_per_s']:.0f} tok/s ({served['async_over_offline']:.0%})", file=sys.stderr)
    return {"offline": rows, "async": served, "vllmlite": str(Path(vllmlite.__file__).parent)}


def import_server_modules() -> None:
    """What the server process has loaded besides the engine: the API app, and torch on a GPU."""
    importlib.import_module("vllmlite.api.app")
    if importlib.util.find_spec("torch") is not None:
        importlib.import_module("torch")


def measure_in_subprocess(label: str, source: Path, args: argparse.Namespace) -> dict:
    """One round in a fresh process whose `vllmlite` is the one in `source` (this module is this
    tree's): both sides of a comparison start alike, with nothing left over from the other."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = ["--rounds", "1", "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
                "--async-tokens", str(args.async_tokens), "--num-seqs", ",".join(map(str, args.num_seqs)),
                "--round-only", out.name, *(["--server-heap"] if args.server_heap else [])]
        # `-m` puts the working directory first on the path: `vllmlite` is the source's, `bench` this tree's.
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        print(f"{label}:", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "bench.step_overhead", *argv], cwd=source, env=env, check=True)
        return json.loads(Path(out.name).read_text())


def export_vllmlite(ref: str, folder: Path) -> str:
    """`git archive REF vllmlite` unpacked into `folder`; REF's commit."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO_ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "vllmlite"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return commit


def summarize(rounds: list[dict]) -> dict:
    """Per row, each figure's best over the rounds (least time, most tokens/s): other load on a shared
    machine only ever adds time, so the least disturbed round is the one that compares."""
    offline = []
    for i, row in enumerate(rounds[0]["offline"]):
        figures = {key: {name: min(r["offline"][i][key][name] for r in rounds) for name in row[key]}
                   for key in ("us_per_seq_step", "median_us_per_seq_step")}
        offline.append({**row, **figures})
    served = {name: max(r["async"][name] for r in rounds) if isinstance(value, float) else value
              for name, value in rounds[0]["async"].items()}
    served["async_over_offline"] = served["async_tokens_per_s"] / served["offline_tokens_per_s"]
    return {"offline": offline, "async": served, "vllmlite": rounds[0]["vllmlite"], "rounds": rounds}


def print_table(current: dict, baseline: dict | None) -> None:
    names = (*PHASES, "other", "total", "wall")
    print("CPU us per sequence per step, mean over steps" + (" (baseline -> this tree)" if baseline else ""))
    print(f"{'seqs':>4} {'detok':>5} " + " ".join(f"{n:>15}" for n in names))
    for i, row in enumerate(current["offline"]):
        us = row["us_per_seq_step"]
        cells = [f"{baseline['offline'][i]['us_per_seq_step'][n]:6.1f} -> {us[n]:5.1f}" if baseline else
                 f"{us[n]:15.1f}" for n in names]
        print(f"{row['num_seqs']:4d} {row['detokenize']!s:>5} " + " ".join(f"{c:>15}" for c in cells))
    served, before = current["async"], baseline["async"] if baseline else None
    for key, label in (("async_tokens_per_s", ""), ("async_frozen_heap_tokens_per_s", ", start-up heap frozen")):
        was = f"{before[key]:.0f} -> " if before else ""
        print(f"async, {served['num_seqs']} consumers{label}: {was}{served[key]:.0f} tok/s")
    print(f"offline, the same requests: {served['offline_tokens_per_s']:.0f} tok/s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", default="256,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per row")
    parser.add_argument("--async-tokens", type=int, default=128, help="tokens each async consumer receives")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each side, with --baseline)")
    parser.add_argument("--baseline", default=None, help="a git ref whose vllmlite is measured too")
    parser.add_argument("--server-heap", action="store_true",
                        help="import what the server process holds first (the API app; torch where installed, "
                             "as on a GPU): a heap of its size for the garbage collector to walk")
    parser.add_argument("--quick", action="store_true", help="8 and 4 sequences, few steps, one round")
    parser.add_argument("--round-only", type=Path, default=None, help=argparse.SUPPRESS)  # a baseline's round
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_step_overhead.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_seqs, args.prompt_len, args.steps, args.async_tokens, args.rounds = "8,4", 20, 5, 4, 1
    args.num_seqs = [int(n) for n in str(args.num_seqs).split(",")]
    if args.server_heap:
        import_server_modules()
    if args.round_only is not None:
        result = measure(args)
        args.round_only.write_text(json.dumps(result))
        return result
    machine = machine_info()
    with tempfile.TemporaryDirectory() as folder:
        base_commit = export_vllmlite(args.baseline, Path(folder)) if args.baseline else None
        current_rounds, baseline_rounds = [], []
        for round_index in range(args.rounds):
            if not args.baseline:
                print(f"round {round_index}:", file=sys.stderr)
                current_rounds.append(measure(args))
                continue
            sides = [(baseline_rounds, f"{args.baseline}, round {round_index}", Path(folder)),
                     (current_rounds, f"this tree, round {round_index}", REPO_ROOT)]
            for rounds, label, source in sides[::1 if round_index % 2 == 0 else -1]:  # who goes first alternates
                rounds.append(measure_in_subprocess(label, source, args))
    current = summarize(current_rounds)
    baseline = summarize(baseline_rounds) if baseline_rounds else None
    report = {"machine": dict(machine, loadavg_end=list(os.getloadavg())),
              "command": module_command("bench.step_overhead", argv), "server_heap": args.server_heap,
              "num_gc_objects": len(gc.get_objects()), "prompt_len": args.prompt_len,
              "steps": args.steps, "async_tokens": args.async_tokens, "current": current,
              "baseline": None if baseline is None else {"ref": args.baseline, "commit": base_commit, **baseline}}
    write_json(args.out, report)
    print_table(current, baseline)
    print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
