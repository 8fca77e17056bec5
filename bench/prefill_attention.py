"""Long-prompt prefill: the attention of long chunks in query tiles vs the dense reference it replaced.

    python -m bench.prefill_attention                   # SmolLM2-135M, 512/1024/2048 tokens, 3 rounds
    python -m bench.prefill_attention --quick           # smoke test: the random model, short prompts

Two measurements, every variant run in turn in each round (the order alternating), so the
machine's other load falls on all alike; medians over `--reps` rounds, wall and process CPU time.
- prefill: one prompt of N tokens in one forward pass (the time to first token, less scheduling),
  on two models over the same weights: the numba backend as it is (`tiled`), and the same backend
  with every long chunk through the dense `reference.attend_group` with OpenBLAS on its default
  threads (`dense`, how the numba backend attended long chunks before prefill_attention.py). Both
  sample the same greedy token.
- attention alone, one layer: random q/K/V at the model's shape, the dense reference vs
  `attend_chunk` for each tile size of `--tiles` on one thread (OpenBLAS's too), and vs the numba
  backend's paged_attention (`backend`: tiles of TILE_QUERIES on all of numba's threads).
Raw results: results/bench_prefill_attention.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.measure import timed
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.config import ceil_div
from vllmlite.kernels import blas, reference
from vllmlite.kernels import numba as numba_kernels
from vllmlite.kernels.attention_metadata import AttentionMetadata, build_metadata
from vllmlite.kernels.numba import attention as numba_attention
from vllmlite.kernels.prefill_attention import TILE_QUERIES, attend_chunk
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import LoadedModel, load_model

BLOCK_SIZE = 16


def dense_paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                          out: np.ndarray) -> None:
    """The numba backend's paged_attention with each long chunk through the dense reference."""
    numba_attention.attend_short_queries(q, k_cache, v_cache, meta, out)
    for group in meta.long_groups:
        reference.attend_group(q, k_cache, v_cache, group, meta.block_size, out)


def dense_kernels() -> SimpleNamespace:
    """The numba backend with `dense_paged_attention` in place of its own."""
    functions = {name: getattr(numba_kernels, name) for name in numba_kernels.__all__}
    return SimpleNamespace(**{**functions, "paged_attention": dense_paged_attention})


def interleaved(variants: dict, reps: int) -> dict:
    """Each variant once a round, in alternating order; per variant the median wall and CPU
    milliseconds and every round's wall time. Each variant runs once first, untimed (compiling,
    first touches of memory)."""
    for fn in variants.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for _ in range(reps):
        names.reverse()
        for name in names:
            timing = timed(variants[name])
            wall[name] += timing.wall_s
            cpu[name] += timing.cpu_s
    return {name: {"median_ms": 1e3 * float(np.median(wall[name])), "median_cpu_ms": 1e3 * float(np.median(cpu[name])),
                   "rounds_ms": [1e3 * w for w in wall[name]]} for name in names}


def prefill(loaded: LoadedModel, num_tokens: int, reps: int) -> dict:
    """One prompt of num_tokens in one forward pass, tiled vs dense; the greedy tokens they pick."""
    c = loaded.config
    rng = np.random.default_rng(num_tokens)
    input_ids = rng.integers(100, min(40000, c.vocab_size), num_tokens)
    num_blocks = ceil_div(num_tokens, BLOCK_SIZE)
    meta = build_metadata([num_tokens], [num_tokens], [list(range(num_blocks))], BLOCK_SIZE)
    shape = (num_blocks * BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    kv_cache = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(c.num_layers)]
    models = {"tiled": DecoderModel(c, loaded.weights, num_tokens, numba_kernels),
              "dense": DecoderModel(c, loaded.weights, num_tokens, dense_kernels())}
    last = np.array([num_tokens - 1])
    logits = {}

    def run(name: str) -> None:
        logits[name] = models[name].forward(input_ids, meta, kv_cache, last)

    result = interleaved({name: (lambda name=name: run(name)) for name in models}, reps)
    return {"num_tokens": num_tokens, **result,
            "ratio_dense_over_tiled": result["dense"]["median_ms"] / result["tiled"]["median_ms"],
            "same_greedy_token": bool(logits["tiled"].argmax() == logits["dense"].argmax()),
            "max_abs_logit_diff": float(np.abs(logits["tiled"] - logits["dense"]).max())}


def attention_alone(loaded: LoadedModel, num_tokens: int, tiles: list[int], reps: int) -> dict:
    """One layer's attention of a num_tokens prompt: the dense reference vs attend_chunk per tile
    on one thread, and vs the numba backend."""
    c = loaded.config
    rng = np.random.default_rng(num_tokens)
    num_blocks = ceil_div(num_tokens, BLOCK_SIZE)
    meta = build_metadata([num_tokens], [num_tokens], [list(range(num_blocks))], BLOCK_SIZE)
    shape = (num_blocks * BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    k_cache, v_cache = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    q = rng.standard_normal((num_tokens, c.num_heads, c.head_dim), np.float32)   # [tokens, heads, head_dim]
    out = np.empty_like(q)
    group = meta.long_groups[0]

    def tiled(tile: int) -> None:
        with blas.one_thread():
            attend_chunk(q, k_cache, v_cache, meta, 0, out, tile)

    variants = {"dense": lambda: reference.attend_group(q, k_cache, v_cache, group, BLOCK_SIZE, out)}
    variants.update({f"tile_{tile}": (lambda tile=tile: tiled(tile)) for tile in tiles})
    variants["backend"] = lambda: numba_kernels.paged_attention(q, k_cache, v_cache, meta, out)
    result = interleaved(variants, reps)
    return {"num_tokens": num_tokens, **result,
            "ratio_dense_over_tiles": {name: result["dense"]["median_ms"] / r["median_ms"]
                                       for name, r in result.items() if name != "dense"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048], help="prompt tokens")
    parser.add_argument("--tiles", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="queries a tile, for the attention-alone comparison")
    parser.add_argument("--reps", type=int, default=3, help="rounds")
    parser.add_argument("--quick", action="store_true", help="the random model, 64 and 128 tokens, 1 round")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_prefill_attention.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.lengths, args.tiles, args.reps = "random", [64, 128], [32, 64], 1
    machine = machine_info()
    loaded = load_model(args.model, "float32", 0)
    attention = []
    for n in args.lengths:
        attention.append(attention_alone(loaded, n, args.tiles, args.reps))
        row = attention[-1]
        print(f"attention, one layer, {n} tokens: dense {row['dense']['median_ms']:.1f} ms; " + ", ".join(
            f"{name} {row[name]['median_ms']:.1f} ms (x{ratio:.2f})"
            for name, ratio in row["ratio_dense_over_tiles"].items()), file=sys.stderr)
    prefills = []
    for n in args.lengths:
        prefills.append(prefill(loaded, n, args.reps))
        row = prefills[-1]
        print(f"prefill {n} tokens: dense {row['dense']['median_ms']:.0f} ms, tiled {row['tiled']['median_ms']:.0f} "
              f"ms, x{row['ratio_dense_over_tiled']:.2f}; same greedy token: {row['same_greedy_token']} (logits "
              f"within {row['max_abs_logit_diff']:.1e})", file=sys.stderr)
    report = {"machine": dict(machine, loadavg_end=list(os.getloadavg())),
              "command": module_command("bench.prefill_attention", argv), "model": args.model,
              "block_size": BLOCK_SIZE, "reps": args.reps, "default_tile": TILE_QUERIES,
              "attention_one_layer": attention, "prefill": prefills}
    write_json(args.out, report)
    print(f"load {machine['loadavg_start']} -> {report['machine']['loadavg_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
