"""paged_attention's options on the numba backend: what a sliding window saves and a soft-cap costs.

    python -m bench.attention_options                  # SmolLM2's heads, contexts of 4000 tokens
    python -m bench.attention_options --quick          # smoke test: 1000 tokens, 2 rounds

One layer's attention at SmolLM2's shape (9 heads, 3 KV heads, head_dim 64, blocks of 16), float32,
for a batch of decodes, a batch of 4-token queries (speculative verification) and one prefill chunk
over cached context: without options, with a window of `--window` keys (the work should follow the
window, not the context), and with a soft-cap. Every variant is timed in each round, the order
rotating; the best round of each is reported (the machine is shared). Raw results:
results/bench_attention_options.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.measure import timed
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.kernels import numba as kernels
from vllmlite.kernels.attention_metadata import build_metadata

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def step(shapes: list[tuple[int, int]], rng: np.random.Generator):
    """q, caches and metadata for sequences of (queries, sequence length), blocks shuffled."""
    needed = [-(-seq_len // BLOCK_SIZE) for _, seq_len in shapes]
    pool = rng.permutation(sum(needed)).tolist()
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    k_cache, v_cache = rng.standard_normal((2, sum(needed) * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
    meta = build_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, BLOCK_SIZE)
    q = rng.standard_normal((int(meta.query_start[-1]), NUM_HEADS, HEAD_DIM), dtype=np.float32)
    return q, k_cache, v_cache, meta


def compare(name: str, shapes: list[tuple[int, int]], window: int, reps: int) -> dict:
    q, k_cache, v_cache, meta = step(shapes, np.random.default_rng(len(shapes)))
    out = np.empty_like(q)
    variants = {"default": {}, f"window {window}": {"sliding_window": window}, "softcap 50": {"softcap": 50.0}}
    best = dict.fromkeys(variants, np.inf)
    names = list(variants)
    for round_ in range(reps):
        for variant in names[round_ % 3:] + names[:round_ % 3]:
            def attend(options=variants[variant]):
                kernels.paged_attention(q, k_cache, v_cache, meta, out, **options)
            best[variant] = min(best[variant], min(timed(attend, reps=3, warm_up=True).wall_s))
    return {"case": name, "shapes": shapes[:1], "num_seqs": len(shapes),
            **{f"{variant}_ms": seconds * 1e3 for variant, seconds in best.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4000, help="tokens of each sequence")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5, help="rounds")
    parser.add_argument("--quick", action="store_true", help="1000 tokens, window 256, 2 rounds")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_attention_options.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.context, args.window, args.reps = 1000, 256, 2
    machine = machine_info()
    n = args.context
    cases = [("32 decodes", [(1, n)] * 32), ("8 x 4-token queries", [(4, n)] * 8), ("one 256-token chunk", [(256, n)])]
    rows = []
    for name, shapes in cases:
        rows.append(compare(name, shapes, args.window, args.reps))
        print(f"{name} at {n} tokens: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in rows[-1].items()
                                                   if k.endswith("_ms")), file=sys.stderr)
    report = {"machine": dict(machine, loadavg_end=list(os.getloadavg())),
              "command": module_command("bench.attention_options", argv), "context": n, "window": args.window,
              "reps": args.reps, "rows": rows}
    write_json(args.out, report)
    print(f"load {machine['loadavg_start']} -> {report['machine']['loadavg_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
