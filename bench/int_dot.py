"""Integer dot products on quantized weights against today's quantized paths and float32: one linear
layer, at 1 and 32 tokens (or --tokens), through the numba backend's kernels.

    python -m bench.int_dot            # about a minute on 2 cores
    python -m bench.int_dot --quick    # one shape, few repetitions

Shapes [out, in]: the default model's gate/up (1536 x 576) and down (576 x 1536), and a 2048 x
8192 down projection of a larger model. Random weights rounded by our quantizer (int8: affine or
Q8_0-symmetric per block, as `quantize` picks; int8 sym: every block symmetric, as a Q8_0 GGUF
stores them; int4: Q4_1-like). Every path of one shape and token count runs in interleaved
rounds, and each path's median is given as a ratio to float32's median within the same run.
Raw results: results/int_dot.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.kernels.numba import linear
from vllmlite.kernels.numba.int_linear import BYTES, int_dot_linear, rounded_activations
from vllmlite.kernels.quant import BLOCK, BlockRows, QuantizedMatrix, quantize, tile

SHAPES = ((1536, 576), (576, 1536), (2048, 8192))
TOKENS = (1, 32)
FORMATS = ("int8", "int8 sym", "int4")


def weights(shape: tuple[int, int], rng: np.random.Generator) -> dict[str, np.ndarray | QuantizedMatrix]:
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)   # [out, in]
    blocks = w.reshape(shape[0], -1, BLOCK)                               # [out, blocks, 32]
    scales = np.abs(blocks).max(axis=-1) / np.float32(127)                # Q8_0's grid, no mins
    q = np.clip(np.rint(blocks / scales[..., None]), -127, 127).astype(np.int8)
    return {"float32": w, "int8": quantize(w, "int8"), "int8 sym": tile(BlockRows("int8", q, scales, None)),
            "int4": quantize(w, "int4")}


def paths(ws: dict, formats: tuple[str, ...]) -> dict[str, Callable[[np.ndarray, np.ndarray], None]]:
    """name -> a product x -> out: float32; each format today (float activations), through the
    integer kernel (int-dot: the CPU's byte products, vpdpbusd with AVX-512 VNNI or vpmaddubsw with
    AVX2; int-dot int16: the portable int16 kernel on such a CPU), and as its rounded activations through today's kernels (int-dot
    rounded: the same function, `linear(..., int_dot=True)` below INT_DOT_MIN_ROWS tokens)."""
    def product(w, route):
        return lambda x, out: route(x, w, out)
    runs = {"float32": product(ws["float32"], linear)}
    for fmt in formats:
        runs[f"{fmt} today"] = product(ws[fmt], linear)
        runs[f"{fmt} int-dot"] = product(ws[fmt], int_dot_linear)
        if BYTES:
            runs[f"{fmt} int-dot int16"] = product(ws[fmt], lambda x, w, out: int_dot_linear(x, w, out, portable=True))
        runs[f"{fmt} int-dot rounded"] = product(ws[fmt], lambda x, w, out: linear(rounded_activations(x), w, out))
    return runs


def measure(shape: tuple[int, int], num_tokens: int, rounds: int, rng: np.random.Generator,
            formats: tuple[str, ...] = FORMATS) -> dict:
    ws = weights(shape, rng)
    x = rng.standard_normal((shape[1], num_tokens), dtype=np.float32).T   # feature-major, as the model's
    out = np.empty((shape[0], num_tokens), np.float32).T
    runs = paths(ws, formats)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():   # warm up: compile, touch the memory
        run(x, out)
    calls = max(1, int(2e8 / (shape[0] * shape[1] * num_tokens)))  # ~0.1 s of float work per sample
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                run(x, out)
            times[name].append((time.perf_counter() - start) / calls)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    return {"shape": list(shape), "tokens": num_tokens, "median_s": medians,
            "x_float32": {name: m / medians["float32"] for name, m in medians.items()}, "samples_s": times}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--shapes", type=int, nargs="+", choices=range(len(SHAPES)), default=None,
                        help="indices into SHAPES (default: all)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "int_dot.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes is not None else list(SHAPES)
    shapes, rounds = (shapes[:1], 2) if args.quick else (shapes, args.rounds)
    rows = [measure(shape, n, rounds, rng, tuple(args.formats)) for shape in shapes for n in args.tokens]
    names = list(rows[0]["median_s"])
    print(f"{'out x in':>11} {'tokens':>6} {'float32 us':>10} " + " ".join(f"{n:>14}" for n in names[1:]))
    for r in rows:
        print(f"{r['shape'][0]:>5}x{r['shape'][1]:<5} {r['tokens']:6d} {r['median_s']['float32'] * 1e6:10.1f} "
              + " ".join(f"{r['x_float32'][n]:13.2f}x" for n in names[1:]))
    print("(each path's median time over float32's, same run)")
    report = {"command": module_command("bench.int_dot", argv), "machine": machine_info(), "rounds": rounds,
              "rows": rows}
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
