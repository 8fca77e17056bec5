"""Quantized linear layers against float32, on the default model's own matrices.

    python -m bench.quant_bench            # about 1 minute on 2 cores
    python -m bench.quant_bench --quick    # 1 and 17 tokens, one repetition (tests/test_quant_bench.py)

Every matrix of the model (30 layers' Q, K, V, output, gate, up, down, and the LM head) as the GGUF
stores it (Q4_1 layers, Q8_0 LM head) and dequantized to float32, multiplied by 1-64 tokens through
`Kernels.linear` of the default backend: the time of one pass over all of them, and through which
quantized path (from the packed bytes for few tokens, dequantized tiles into BLAS beyond). Raw
results: results/bench_quant.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import gguf
import numpy as np

from bench.measure import timed
from bench.report import REPO_ROOT, machine_info, module_command
from vllmlite.kernels import get_kernels
from vllmlite.kernels.quant import dequantize, from_gguf, tile
from vllmlite.models.model_source import resolve_model

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_quant.json")
    args = parser.parse_args(argv)
    token_counts, reps = ((1, 17), 1) if args.quick else ((1, 2, 4, 8, 16, 64), 3)
    reader = gguf.GGUFReader(resolve_model("default"))
    tensors = {t.name: t for t in reader.tensors}

    def stored(name: str):
        t = tensors[name]
        return tile(from_gguf(t.data, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))))
    num_layers = sum(name.endswith(".attn_q.weight") for name in tensors)
    quantized = [stored(f"blk.{i}.{m}.weight") for i in range(num_layers) for m in MATRICES]
    quantized.append(stored("token_embd.weight"))
    floats = [dequantize(m) for m in quantized]
    kernels = get_kernels()
    rng = np.random.default_rng(0)
    rows = []
    print(f"bytes: quantized {sum(m.nbytes for m in quantized) / 1e6:.0f} MB, "
          f"float32 {sum(w.nbytes for w in floats) / 1e6:.0f} MB")
    for num_tokens in token_counts:
        xs = {k: rng.standard_normal((k, num_tokens), dtype=np.float32).T for k in {w.shape[1] for w in floats}}
        outs = [np.empty((w.shape[0], num_tokens), np.float32).T for w in floats]
        row = {"tokens": num_tokens}
        for name, weights in (("quantized_s", quantized), ("float32_s", floats)):
            row[name] = timed(lambda ws=weights: [kernels.linear(xs[w.shape[1]], w, o) for w, o in zip(ws, outs)],
                              reps=reps, warm_up=True).mean_s
        row["ratio"] = row["quantized_s"] / row["float32_s"]
        rows.append(row)
        print(f"{num_tokens:3d} tokens: quantized {row['quantized_s'] * 1e3:7.1f} ms, "
              f"float32 {row['float32_s'] * 1e3:7.1f} ms, ratio {row['ratio']:.2f}")
    report = {"command": module_command("bench.quant_bench", argv), "machine": machine_info(), "rows": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
