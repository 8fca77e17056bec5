"""The numba decode kernel's attention over int8 K/V, with and without the integer scores:

    python -m bench.int8_scores     # about a minute on 2 cores

The default model's 30 layers of attention for a 32 x 512 decode step (bench.step_bench's shapes and
cache), the same rounded queries each way: q . k from their 16-bit integers (block_products.
packed_scores with the integers: vpdpwssd, AVX-512 VNNI only) against the float products that widen
each key (without them, as runs without VNNI), timed in turn round after round (bench.measure.interleaved).
Also the rounding itself (the turn and `round_queries` of 30 layers' queries), which only the int8
path pays. Raw results: results/kv_int_scores_avx512.json (with the step and agreement runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.measure import interleaved
from bench.report import machine_info, module_command, write_json
from bench.step_bench import BLOCK_SIZE, kv_for
from vllmlite.kernels import get_kernels
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.numba import attention, block_products
from vllmlite.kernels.numba.elementwise import round_queries
from vllmlite.kernels.numba.hadamard import turn_heads
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import load_model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="time each way is measured, at least")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not block_products.INTEGER_SCORES:
        sys.exit("this CPU has no AVX-512 VNNI: the decode kernel takes no integer scores here")
    loaded = load_model("default")
    config = loaded.config
    model = DecoderModel(config, loaded.weights, 600, get_kernels("numba"))
    rng = np.random.default_rng(0)
    num_seqs, context = 32, 512
    kv, tables = kv_for(model, num_seqs, context, rng, "int8")
    meta = build_metadata([1] * num_seqs, [context + 1] * num_seqs, tables, BLOCK_SIZE)
    q = rng.standard_normal((num_seqs, config.num_heads, config.head_dim), dtype=np.float32)
    rounded, rounding = round_queries(turn_heads(q))
    out = np.empty_like(q)

    def layers(with_integers: bool) -> None:
        for k_cache, v_cache in kv:
            attention.attend_short_queries(rounded, k_cache, v_cache, meta, out,
                                           rounding=rounding if with_integers else None)

    def rounding_only() -> None:
        for _ in kv:
            round_queries(turn_heads(q))

    times = interleaved({"integer": lambda: layers(True), "float": lambda: layers(False), "rounding": rounding_only},
                        min_seconds=args.seconds)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    ratios = np.divide(times["integer"], times["float"])
    result = {"what": f"attention of {config.num_layers} layers, {num_seqs} x {context} int8 K/V, numba decode kernel",
              "command": module_command("bench.int8_scores", argv), "machine": machine_info(),
              "median_s": medians, "rounds": len(ratios),
              "integer_over_float_quartiles": np.percentile(ratios, [25, 50, 75]).tolist()}
    print(f"attention, {config.num_layers} layers: integer scores {medians['integer'] * 1e3:.1f} ms, float products "
          f"{medians['float'] * 1e3:.1f} ms (median ratio {np.median(ratios):.3f}, {len(ratios)} rounds); "
          f"rounding the queries {medians['rounding'] * 1e3:.2f} ms", file=sys.stderr)
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
