"""What one stream's decode step is made of, kernel by kernel, and the floor its kernel count sets:

    python -m bench.gpu_launch_floor --shapes qwen3-0.6b,llama-3.2-1b      # on a CUDA machine

For each shape (random weights, bf16): the engine's captured decode graph at batch 1 (context 256,
the single-stream run's mean) replayed under torch.profiler, its kernels split into the matrix
products (cuBLAS) and the rest (Triton's and torch's), with each group's count and device time a
replay; the graph's own time by CUDA events; the GEMM-only graph beside it (bench.gpu's bound);
and the floor: the device time a replay of a graph of the smallest possible kernels (load one
value, store it) takes per kernel. The floor times the non-GEMM kernel count, plus the GEMM-only
graph, is what one token costs at best while every operation stays a kernel of its own, against
the memory-bandwidth bound (bench.gpu's `single` row). A look, not a result: printed and written
to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import torch
import triton
import triton.language as tl

from bench.gpu import copy_bandwidth, cuda_time, decode_inputs, decode_step, hf_model, make_engine, our_model

GEMM_NAMES = ("nvjet", "gemm", "gemv", "cutlass", "splitkreduce", "xmma", "cublas")   # cuBLAS and our GEMV
CONTEXT = 256
FLOOR_KERNELS = 512


@triton.jit
def _smallest_kernel(x_ptr, y_ptr):
    tl.store(y_ptr, tl.load(x_ptr) + 1.0)


def kernel_floor(count: int = FLOOR_KERNELS) -> float:
    """Seconds a kernel of the smallest work costs inside a CUDA graph of `count` of them, each
    reading what the one before wrote (as a model's kernels do)."""
    a = torch.zeros(1, device="cuda")
    b = torch.zeros(1, device="cuda")

    def chain():
        for i in range(count):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _smallest_kernel[(1,)](src, dst)
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return cuda_time(graph.replay) / count


def graph_kernels(engine, batch: int, context: int, reps: int = 5) -> dict:
    """The decode graph's kernels at `batch`: per replay, their count and device microseconds, split
    into GEMMs and the rest, with the rest by name."""
    graphs = engine.runner.graphs
    meta, ids = decode_inputs(batch, context)
    graphs.run(ids, meta)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graphs.run(ids, meta)
        torch.cuda.synchronize()
    groups = {"gemm": [0, 0.0], "other": [0, 0.0]}
    others: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.key.startswith(("Memcpy", "Memset")):
            continue
        group = "gemm" if any(n in event.key.lower() for n in GEMM_NAMES) else "other"
        groups[group][0] += event.count / reps
        groups[group][1] += event.device_time_total / reps
        if group == "other":
            others[event.key[:60]][0] += event.count / reps
            others[event.key[:60]][1] += event.device_time_total / reps
    return {"gemm_kernels": groups["gemm"][0], "gemm_us": groups["gemm"][1],
            "other_kernels": groups["other"][0], "other_us": groups["other"][1],
            "others": {name: {"kernels": n, "us": us} for name, (n, us) in sorted(others.items(), key=lambda x: -x[1][1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    floor = kernel_floor()
    bandwidth = copy_bandwidth()
    report = {"kernel_floor_us": floor * 1e6, "copy_bandwidth_tb_s": bandwidth / 1e12, "context": CONTEXT, "shapes": {}}
    print(f"smallest kernel in a graph: {floor * 1e6:.2f} us; copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    for shape in args.shapes.split(","):
        engine = make_engine(our_model(hf_model(shape)), max_num_seqs=8, max_len=1024)
        step = decode_step(engine, 1, CONTEXT)
        kernels = graph_kernels(engine, 1, CONTEXT)
        token_bytes = engine.weights_bytes + engine.kv_bytes_per_token * CONTEXT
        bound_ms = token_bytes / bandwidth * 1e3
        best_ms = step["gemm_graph_ms"] + kernels["other_kernels"] * floor * 1e3
        row = {**step, **kernels, "bandwidth_bound_ms": bound_ms, "best_with_separate_kernels_ms": best_ms,
               "best_fraction_of_bound": bound_ms / best_ms, "step_fraction_of_bound": bound_ms / step["step_ms"],
               "gemm_graph_fraction_of_bound": bound_ms / step["gemm_graph_ms"]}
        report["shapes"][shape] = row
        print(f"{shape}: graph step {step['step_ms']:.3f} ms, GEMM-only graph {step['gemm_graph_ms']:.3f} ms, "
              f"bound {bound_ms:.3f} ms; {kernels['gemm_kernels']:.0f} GEMM kernels {kernels['gemm_us']:.0f} us, "
              f"{kernels['other_kernels']:.0f} others {kernels['other_us']:.0f} us; best with separate kernels "
              f"{best_ms:.3f} ms = {bound_ms / best_ms:.0%} of the bound", flush=True)
        for name, v in list(kernels["others"].items())[:12]:
            print(f"    {name:60s} {v['kernels']:5.0f} x {v['us'] / max(v['kernels'], 1):6.2f} us", flush=True)
        del engine
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_floor.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
