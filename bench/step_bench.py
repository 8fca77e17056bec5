"""Step microbenchmark: one forward pass of the model next to its GEMM-only bound.

    python -m bench.step_bench                           # default model, about 3 minutes on 2 cores
    python -m bench.step_bench --quick --model random    # smoke test
    python -m bench.step_bench --kernels numba,numpy     # both backends in one run, side by side

Decode: for 8/32/64 running sequences at contexts 128/512/2048, the time of one decode forward
pass (every sequence one token; KV for the whole context present, each sequence in its own
shuffled blocks) next to the GEMM-only time: the same linear layers on the same number of rows,
with the same BLAS calls into the same buffers, and nothing else. Prefill: a 512-token prompt in
one forward pass, tokens/s next to the GEMM-only rate. The ratio (forward / GEMM-only) is what the
kernels and everything around the matrix products cost. Beside it, the time to only read the step's
K/V from the cache, block by block through the block tables as attention does (`kv_read_only`):
GEMM-only plus that read is a floor under the step when attention waits on memory rather than
arithmetic (`read_floor_ratio`). The forward pass, the GEMM-only pass and the read are timed in
turn, round after round (`bench.measure.interleaved`), and each is the median of its rounds, so a
machine that changes speed during the run moves all three alike; `ratio_quartiles` are those of the
rounds' own ratios. Raw results: results/bench_step.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np
from numba import prange

from bench.measure import interleaved
from bench.report import REPO_ROOT, machine_info, module_command
from vllmlite.engine_args import EngineArgs
from vllmlite.kernels import get_kernels
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.kv_dtype import PackedKV
from vllmlite.kernels.numba.jit import parallel
from vllmlite.kernels.numba.kv_read import cache_arrays, prefetch_block
from vllmlite.kernels.reference import linear  # BLAS: the GEMM-only bound
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import load_model

BLOCK_SIZE = 16


def gemm_only(model: DecoderModel, num_tokens: int, num_logits: int) -> None:
    """Exactly the forward pass's matrix products (same shapes, same buffers), nothing else."""
    w = model.weights
    buf = model.workspace(num_tokens)
    for layer in w.layers:
        linear(buf.hidden, layer.wqkv, buf.qkv)
        linear(buf.attn, layer.wo, buf.out)
        linear(buf.hidden, layer.w_gate_up, buf.gate_up)
        linear(buf.act, layer.w_down, buf.out)
    linear(buf.hidden[:num_logits], w.lm_head, np.empty((num_logits, w.lm_head.shape[0]), model.dtype))


def kv_for(model: DecoderModel, num_seqs: int, context: int, rng: np.random.Generator, kv_cache_dtype: str = "auto"):
    """A KV cache holding `num_seqs` contexts in shuffled, distinct blocks, stored as kv_cache_dtype
    says (kernels/kv_dtype.py); the block tables."""
    c = model.config
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    order = rng.permutation(num_blocks)
    tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq].tolist() for i in range(num_seqs)]
    shape = (num_blocks * BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    def cache():
        values = rng.standard_normal(shape, dtype=np.float32).astype(model.dtype)
        if kv_cache_dtype == "auto":
            return values
        packed = PackedKV(kv_cache_dtype, shape)
        packed.store(np.arange(shape[0]), values)
        return packed

    return [(cache(), cache()) for _ in range(c.num_layers)], tables


@parallel
def _read_blocks(data, scales, tables, num_keys, block_size, sums):  # pragma: no cover - compiled
    """sums[s] = the sum of every stored element (and scale) of sequence s's first num_keys slots,
    read a block at a time through its block table with the next block prefetched: the attention
    kernels' reads of one cache, without their arithmetic."""
    for s in prange(tables.shape[0]):
        total = np.float32(0)
        num_blocks = -(-num_keys // block_size)
        for b in range(num_blocks):
            if b + 1 < num_blocks:
                prefetch_block(data, scales, tables[s, b + 1] * block_size, block_size)
            first = tables[s, b] * block_size
            values = data[first:first + block_size].ravel()
            for i in range(values.shape[0]):
                total += np.float32(values[i])
            if scales is not None:
                block_scales = scales[first:first + block_size].ravel()
                for i in range(block_scales.shape[0]):
                    total += block_scales[i]
        sums[s] = total


def kv_read_only(kv: list, tables: list[list[int]], num_keys: int) -> None:
    """Every layer's K and V of the decode's sequences read as the attention kernels read them, and
    nothing else: how long the step's KV bytes take to come from memory, the floor under attention."""
    table_array, sums = np.asarray(tables, np.int64), np.empty(len(tables), np.float32)
    for k_cache, v_cache in kv:
        for cache in (k_cache, v_cache):
            _read_blocks(*cache_arrays(cache), table_array, num_keys, BLOCK_SIZE, sums)


def decode_row(model: DecoderModel, num_seqs: int, context: int, min_seconds: float, rng,
               kv_cache_dtype: str = "auto") -> dict:
    kv, tables = kv_for(model, num_seqs, context, rng, kv_cache_dtype)
    meta = build_metadata([1] * num_seqs, [context + 1] * num_seqs, tables, BLOCK_SIZE)
    input_ids = rng.integers(0, model.config.vocab_size, num_seqs)
    rows = np.arange(num_seqs)
    times = interleaved({"forward": lambda: model.forward(input_ids, meta, kv, rows),
                         "gemm": lambda: gemm_only(model, num_seqs, num_seqs),
                         "read": lambda: kv_read_only(kv, tables, context + 1)}, min_seconds=3 * min_seconds)
    forward, gemm, read = (float(np.median(times[name])) for name in ("forward", "gemm", "read"))
    return {"num_seqs": num_seqs, "context": context, "kv_cache_dtype": kv_cache_dtype, "forward_s": forward,
            "gemm_only_s": gemm, "ratio": forward / gemm, "tokens_per_s": num_seqs / forward,
            "kv_read_only_s": read, "read_floor_ratio": (gemm + read) / gemm, "rounds": len(times["forward"]),
            "ratio_quartiles": np.percentile(np.divide(times["forward"], times["gemm"]), [25, 75]).tolist()}


def prefill_row(model: DecoderModel, prompt_len: int, min_seconds: float, rng) -> dict:
    kv, tables = kv_for(model, 1, prompt_len, rng)
    meta = build_metadata([prompt_len], [prompt_len], tables, BLOCK_SIZE)
    input_ids = rng.integers(0, model.config.vocab_size, prompt_len)
    rows = np.array([prompt_len - 1])
    times = interleaved({"forward": lambda: model.forward(input_ids, meta, kv, rows),
                         "gemm": lambda: gemm_only(model, prompt_len, 1)}, min_seconds=2 * min_seconds)
    forward, gemm = float(np.median(times["forward"])), float(np.median(times["gemm"]))
    return {"prompt_len": prompt_len, "forward_s": forward, "gemm_only_s": gemm,
            "tokens_per_s": prompt_len / forward, "gemm_only_tokens_per_s": prompt_len / gemm,
            "fraction_of_gemm_rate": gemm / forward}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quick", action="store_true", help="few small shapes, short timings")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated backends, each measured in turn in this run "
                             "(default: $VLLMLITE_KERNELS or numba); e.g. numba,numpy")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the decode rows' K/V storage: auto, fp16, bf16, int8")
    parser.add_argument("--decode", default=None,
                        help="only these decode shapes, SEQSxCONTEXT comma-separated (e.g. 32x512), no prefill")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    seqs, contexts, prompt_len, min_seconds = ([8, 32, 64], [128, 512, 2048], 512, 2.0) if not args.quick \
        else ([2, 4], [16, 40], 32, 0.05)
    shapes = [(n, ctx) for ctx in contexts for n in seqs] if args.decode is None else \
        [tuple(int(v) for v in shape.split("x")) for shape in args.decode.split(",")]
    loaded = load_model(args.model)
    if loaded.config.num_experts:   # the GEMM-only bound below is the dense MLP's products
        parser.error(f"{args.model} is a mixture-of-experts model; its step against a dense one: python -m bench.moe_step")
    names = args.kernels.split(",") if args.kernels else [None]   # None: EngineArgs reads $VLLMLITE_KERNELS
    backends = [EngineArgs(kernels=name).create_engine_config().kernel_backend for name in names]
    rng = np.random.default_rng(0)
    result = {"machine": machine_info(), "command": module_command("bench.step_bench", argv), "model": args.model,
              "kernels": backends, "kv_cache_dtype": args.kv_cache_dtype, "kernel_warm_up_s": {}, "decode": [],
              "prefill": []}
    for kernels in backends:
        model = DecoderModel(loaded.config, loaded.weights, max(ctx for _, ctx in shapes) + 1, get_kernels(kernels))
        result["kernel_warm_up_s"][kernels] = model.warm_up()
        print(f"kernels {kernels}; decode: one token per sequence, forward vs GEMM-only (ms)", file=sys.stderr)
        for num_seqs, context in shapes:
            row = {"kernels": kernels, **decode_row(model, num_seqs, context, min_seconds, rng, args.kv_cache_dtype)}
            result["decode"].append(row)
            print(f"  seqs {num_seqs:3d} ctx {context:5d}: forward {row['forward_s'] * 1e3:8.1f}  "
                  f"gemm {row['gemm_only_s'] * 1e3:8.1f}  ratio {row['ratio']:.2f}  "
                  f"KV read alone {row['kv_read_only_s'] * 1e3:6.1f} (floor {row['read_floor_ratio']:.2f})  "
                  f"{row['tokens_per_s']:7.1f} tok/s", file=sys.stderr)
        if args.decode is not None:
            continue
        row = {"kernels": kernels, **prefill_row(model, prompt_len, min_seconds, rng)}
        result["prefill"].append(row)
        print(f"prefill {prompt_len} tokens: {row['tokens_per_s']:.0f} tok/s, GEMM-only "
              f"{row['gemm_only_tokens_per_s']:.0f} tok/s ({row['fraction_of_gemm_rate']:.0%})", file=sys.stderr)
    out = args.out or REPO_ROOT / "results" / ("bench_step_quick.json" if args.quick else "bench_step.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
