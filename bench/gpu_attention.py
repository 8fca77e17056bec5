"""The Triton paged-attention kernel alone on a GPU: decode batches at two context lengths, timed
for each tuning (keys per tile, warps, pipeline stages), as bytes of K/V read per second next to
the device's copy bandwidth. A look for choosing the defaults, not a result of its own: each call
is timed from Python (CUDA events around the launch), so at small batches the launch overhead hides
the kernel's own time (triton_attention.split_plan's thresholds come from CUDA-graph timings).

    python -m bench.gpu_attention --out results/gpu_attention_sweep.json
    python -m bench.gpu_attention --kv-cache-dtype fp8 --case llama-3.1-8b:256:512 --out ...   # float8 K/V
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np
import torch

from bench.gpu import copy_bandwidth, cuda_time
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.torch import triton_attention as ta

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}   # heads, kv heads, head_dim


CASES = [("qwen3-0.6b", 1, 512), ("qwen3-0.6b", 1, 4096), ("qwen3-0.6b", 32, 512), ("qwen3-0.6b", 256, 512),
         ("llama-3.1-8b", 256, 1024)]   # shape, batch, context


def sweep(shape: str, batch: int, context: int, block_size: int = 16, kv_dtype=torch.bfloat16) -> list[dict]:
    heads, kv_heads, head_dim = SHAPES[shape]
    blocks = -(-context // block_size)
    tables = np.random.default_rng(0).permutation(batch * blocks).reshape(batch, blocks)
    meta = build_metadata([1] * batch, [context] * batch, tables.tolist(), block_size)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, heads, head_dim, **dev)
    out = torch.empty_like(q)
    k_cache, v_cache = (torch.randn(batch * blocks * block_size, kv_heads, head_dim, **dev).to(kv_dtype)
                        for _ in range(2))
    rows = ta.tile_rows(heads, kv_heads, long=False)
    tiles = torch.from_numpy(ta.make_tiles(meta.query_start, meta.positions, np.arange(batch), rows)).cuda()
    block_tables = torch.from_numpy(meta.block_tables).cuda()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    results = []
    for block_n, warps, stages, split in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3), (False, True)):
        splits = ta.split_plan(batch * kv_heads, context, num_sms) if split else 1
        if split and splits == 1:
            continue
        def attend():
            ta.paged_attention_tiles(q, k_cache, v_cache, tiles, rows, block_tables, block_size, out, splits,
                                     block_n=block_n, num_warps=warps, num_stages=stages)
        seconds = cuda_time(attend)
        results.append({"shape": shape, "batch": batch, "context": context, "block_n": block_n, "num_warps": warps,
                        "num_stages": stages, "num_splits": splits, "us": seconds * 1e6,
                        "kv_gb_s": kv_bytes / seconds / 1e9})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "gpu_attention_sweep.json")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="K/V in bf16 (auto) or float8 e4m3 (kv_cache_dtype fp8)")
    parser.add_argument("--case", action="append", help="shape:batch:context (repeatable; default: five cases)")
    args = parser.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    cases = [(c.split(":")[0], *map(int, c.split(":")[1:])) for c in args.case] if args.case else CASES
    report = {"what": __doc__.split("\n")[0], "command": module_command("bench.gpu_attention"),
              "machine": machine_info(), "device": torch.cuda.get_device_name(),
              "copy_bandwidth_gb_s": copy_bandwidth() / 1e9, "kv_cache_dtype": args.kv_cache_dtype, "rows": []}
    for shape, batch, context in cases:
        rows = sweep(shape, batch, context, kv_dtype=kv_dtype)
        best = min(rows, key=lambda r: r["us"])
        default = next(r for r in rows if (r["block_n"], r["num_warps"], r["num_stages"]) == (64, 4, 2)
                       and r["num_splits"] == max(x["num_splits"] for x in rows))
        print(f"{shape} b{batch} ctx{context}: default {default['us']:.1f} us {default['kv_gb_s']:.0f} GB/s; best "
              f"{best['us']:.1f} us {best['kv_gb_s']:.0f} GB/s at block_n {best['block_n']} warps {best['num_warps']} "
              f"stages {best['num_stages']} splits {best['num_splits']}", flush=True)
        report["rows"] += rows
        write_json(args.out, report)


if __name__ == "__main__":
    main()
