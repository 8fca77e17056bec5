"""One row times each weight matrix of a shape (a one-request decode's products): torch.mm (cuBLAS)
against the Triton GEMV (vllmlite/kernels/torch/triton_gemv.py) over a sweep of its tiles:

    python -m bench.gpu_gemv --shapes qwen3-0.6b,llama-3.2-1b,llama-3.1-8b --out results/gpu_gemv.json

Each candidate is captured 20 times in one CUDA graph, cycling through copies of the random bf16
weight that together pass the L2 cache (each launch reads from memory, as a model's layers do), and
timed by CUDA events; `plan`'s tile is timed beside the sweep's best, and the per-token sums over the
layers and the LM head are compared with the bytes at the device's copy bandwidth. A look, not a result.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import torch

from bench.gpu import SHAPES, copy_bandwidth, cuda_time
from vllmlite.kernels.torch.triton_gemv import gemv, plan

REPS = 20
CONFIGS = [dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
           for n, k, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4))
           if n * k <= 16384]


def matrices(shape: str) -> dict[str, tuple[int, int, int]]:
    """(N, K, count per token) of each product of one token."""
    hidden, inter, layers, heads, kv, head_dim, vocab, _ = SHAPES[shape]
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden, layers), "o": (hidden, heads * head_dim, layers),
            "gate_up": (2 * inter, hidden, layers), "down": (hidden, inter, layers), "lm_head": (vocab, hidden, 1)}


COLD_BYTES = 256 * 2**20   # weights cycled through, over the L2 cache's 50 MB: each launch reads from memory


def graph_time(fn, copies: int) -> float:
    """Seconds a launch of fn(i) takes, REPS launches in one CUDA graph over `copies` weights in turn."""
    fn(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPS):
            fn(i % copies)
    return cuda_time(graph.replay) / REPS


def sweep(n: int, k: int) -> dict:
    """torch.mm and the best GEMV tile for one [n, k] bf16 weight times one row."""
    nbytes = n * k * 2
    copies = -(-COLD_BYTES // nbytes)
    w = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn((1, k), dtype=torch.bfloat16, device="cuda")
    ref, out = (torch.empty((1, n), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm = graph_time(lambda i: torch.mm(x, w[i].T, out=ref), copies)
    planned = graph_time(lambda i: gemv(x, w[i], out), copies)
    times = {}
    for config in CONFIGS:
        try:
            times[json.dumps(config)] = graph_time(lambda i, config=config: gemv(x, w[i], out, **config), copies)
        except Exception as error:   # a tile the compiler refuses (too many registers)
            print(f"  N={n} K={k} {config}: {type(error).__name__}", flush=True)
    best = min(times, key=times.get)
    torch.mm(x, w[0].T, out=ref)
    gemv(x, w[0], out)
    error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return {"n": n, "k": k, "mm_us": mm * 1e6, "planned_us": planned * 1e6, "plan": plan(n, k),
            "gemv_us": times[best] * 1e6, "config": json.loads(best), "mm_tb_s": nbytes / mm / 1e12,
            "planned_tb_s": nbytes / planned / 1e12, "gemv_tb_s": nbytes / times[best] / 1e12,
            "max_rel_error": error, "every_config_us": {c: t * 1e6 for c, t in sorted(times.items(), key=lambda x: x[1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    report = {"copy_bandwidth_tb_s": bandwidth / 1e12, "shapes": {}}
    for shape in args.shapes.split(","):
        rows, totals = {}, {"mm_us": 0.0, "planned_us": 0.0, "gemv_us": 0.0, "bytes": 0}
        for name, (n, k, count) in matrices(shape).items():
            row = rows[name] = {**sweep(n, k), "count": count}
            totals["mm_us"] += row["mm_us"] * count
            totals["gemv_us"] += row["gemv_us"] * count
            totals["planned_us"] += row["planned_us"] * count
            totals["bytes"] += n * k * 2 * count
            print(f"{shape} {name:8s} N={n:6d} K={k:5d}: mm {row['mm_us']:7.1f} us ({row['mm_tb_s']:.2f} TB/s), "
                  f"planned gemv {row['planned_us']:7.1f} us ({row['planned_tb_s']:.2f} TB/s), "
                  f"best {row['gemv_us']:7.1f} us {row['config']} "
                  f"err {row['max_rel_error']:.1e}", flush=True)
        totals["bound_us"] = totals["bytes"] / bandwidth * 1e6
        report["shapes"][shape] = {"matrices": rows, **totals}
        print(f"{shape}: per token mm {totals['mm_us']:.0f} us, planned gemv {totals['planned_us']:.0f} us, "
              f"best gemv {totals['gemv_us']:.0f} us, "
              f"bytes at copy speed {totals['bound_us']:.0f} us", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
