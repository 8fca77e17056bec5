"""Where an offline GPU run's time goes, step by step: a look, not a result.

    python -m bench.gpu_steps --shape qwen3-0.6b --out /tmp/steps      # on a CUDA machine

Runs bench.gpu's offline workload (random weights at a shape, N requests, greedy, ignore_eos) once
plain, recording for every `engine.step()` its wall time, the runner's share (launch and wait for
the device, sampling), whether it replayed a CUDA graph, and its rows; then again under cProfile.
Then torch.profiler's kernel table for one decode graph replay at batch 1 and at `--batch`, and for
one eager mixed step (a prefill chunk beside decodes). Writes steps.json, the step summary printed,
cprofile.txt and kernels.txt into `--out`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np
import torch

from bench.gpu import decode_inputs, decode_step, hf_model, make_engine, our_model, workload
from vllmlite.sampling_params import SamplingParams


def record_steps(engine, prompts: list[list[int]], output_len: int, tag: str,
                 first_steps: cProfile.Profile | None = None) -> list[dict]:
    """Each step's record; `first_steps` profiles the first three."""
    runner, graphs = engine.runner, engine.runner.graphs
    replays = [0]
    graph_run, graph_launch_steps, execute = graphs.run, graphs.launch_steps, runner.execute
    timing: dict = {}

    def counting_run(*args):
        replays[0] += 1
        return graph_run(*args)

    def counting_launch_steps(ids, meta, lookahead, after=None):
        replays[0] += 1
        timing["passes"] = int(lookahead.max()) + 1
        return graph_launch_steps(ids, meta, lookahead, after)

    def timed_execute(out):
        start = time.perf_counter()
        result = execute(out)
        timing["execute"] = time.perf_counter() - start
        timing["rows"] = sum(len(s.token_ids) for s in out.scheduled)
        timing["seqs"] = len(out.scheduled)
        return result

    graphs.run, graphs.launch_steps, runner.execute = counting_run, counting_launch_steps, timed_execute
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = []
    torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        before, timing["execute"], timing["passes"] = replays[0], 0.0, 1
        timing["rows"] = timing["seqs"] = 0
        profiling = first_steps is not None and len(steps) < 3
        if profiling:
            first_steps.enable()
        start = time.perf_counter()
        engine.step()
        if profiling:
            first_steps.disable()
        steps.append({"wall": time.perf_counter() - start, "execute": timing["execute"], "rows": timing["rows"],
                      "seqs": timing["seqs"], "graph": replays[0] > before, "passes": timing["passes"]})
    graphs.run, graphs.launch_steps, runner.execute = graph_run, graph_launch_steps, execute
    return steps


def summary(steps: list[dict]) -> dict:
    kinds = defaultdict(lambda: {"steps": 0, "wall": 0.0, "execute": 0.0, "rows": 0, "passes": 0})
    for s in steps:
        kind = "graph" if s["graph"] else ("decode_eager" if s["rows"] == s["seqs"] else "mixed")
        k = kinds[kind]
        k["steps"] += 1
        k["wall"] += s["wall"]
        k["execute"] += s["execute"]
        k["rows"] += s["rows"]
        k["passes"] += s["passes"]
    return {"total_s": sum(s["wall"] for s in steps), "steps": len(steps), "by_kind": dict(kinds)}


def kernel_table(fn, reps: int = 3) -> str:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = our_model(hf_model(args.shape))
    prompts = workload(args.num_requests, loaded.config.vocab_size)
    engine = make_engine(loaded, max_num_seqs=256, max_len=1024 + args.output_len + 16,
                         num_scheduler_steps=args.num_scheduler_steps)
    record_steps(engine, prompts[:4], 4, "warm")
    first = cProfile.Profile()   # what the plain run's first steps spend their time on (compiling?)
    steps = record_steps(engine, prompts, args.output_len, "plain", first)
    report = {"shape": args.shape, "plain": summary(steps)}
    print(json.dumps(report, indent=1), flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = record_steps(engine, prompts, args.output_len, "profiled")
    profiler.disable()
    report["profiled"] = summary(profiled)
    with open(args.out / "cprofile_first_steps.txt", "w") as f:
        pstats.Stats(first, stream=f).sort_stats("cumulative").print_stats(50)
    with open(args.out / "cprofile.txt", "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(80)
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)
    report["steps"] = steps
    (args.out / "steps.json").write_text(json.dumps(report))
    tables = []
    for batch in (1, args.batch):
        result = decode_step(engine, batch, 512)
        tables.append(f"decode batch {batch}: {result}")
        model, graphs = engine.runner.model, engine.runner.graphs
        meta, ids = decode_inputs(batch, 512)
        tables.append(kernel_table(lambda: model.kernels.argmax(graphs.run(ids, meta))))
        tables.append(f"eager forward, batch {batch}")

        def eager():
            meta.kernel_cache.clear()
            model.kernels.argmax(model.forward_logits(ids, meta, engine.runner.kv_cache, np.arange(batch)))
        tables.append(kernel_table(eager))
    (args.out / "kernels.txt").write_text("\n\n".join(tables))
    print("\n\n".join(tables), flush=True)


if __name__ == "__main__":
    main()
