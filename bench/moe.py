"""Routed experts (the numba backend's `moe`) against a dense SwiGLU of the same active size.

    python -m bench.moe                       # hidden 1024, inter 512, 32 experts, top 4; 1/16/256 tokens
    python -m bench.moe --quick               # smoke test: small shapes, 2 rounds

The dense MLP has top_k * inter intermediate features, so both do the same multiply-adds per token
(its weights are what one token's experts read); the ratio moe / dense is the MoE block's overhead
(grouping, gathering, one pair of products per expert with tokens, the weighted sum). With more
tokens the MoE also reads more experts' weights (up to all of them) where the dense MLP reads the
same ones again, so its ratio grows with the batch: that is the cost of the model, not overhead.
Each round times both, alternating which goes first; the best round of each is reported, since
the machine is shared. Raw results: results/bench_moe.json.
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
from vllmlite.kernels.reference import route


def compare(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, reps: int) -> dict:
    """Best-of-`reps` wall times of moe and of the dense SwiGLU of the same active size, feature-major
    activations as the model's workspace holds them."""
    rng = np.random.default_rng(num_tokens)
    x = np.ascontiguousarray(rng.standard_normal((num_tokens, hidden), dtype=np.float32).T).T   # [tokens, hidden]
    w_gate_up = rng.standard_normal((num_experts, 2 * inter, hidden), dtype=np.float32) / np.sqrt(hidden)
    w_down = rng.standard_normal((num_experts, hidden, inter), dtype=np.float32) / np.sqrt(inter)
    routing = route(rng.standard_normal((num_tokens, num_experts)).astype(np.float32), top_k, normalize=True)
    dense_gate_up = rng.standard_normal((2 * top_k * inter, hidden), dtype=np.float32) / np.sqrt(hidden)
    dense_down = rng.standard_normal((hidden, top_k * inter), dtype=np.float32) / np.sqrt(top_k * inter)
    out = np.empty((hidden, num_tokens), np.float32).T
    gate_up = np.empty((2 * top_k * inter, num_tokens), np.float32).T
    act = np.empty((top_k * inter, num_tokens), np.float32).T

    def moe():
        kernels.moe(x, routing.expert_ids, routing.expert_weights, w_gate_up, w_down, out)

    def dense():
        kernels.linear(x, dense_gate_up, gate_up)
        kernels.silu_and_mul(gate_up, act)
        kernels.linear(act, dense_down, out)

    best = {"moe": np.inf, "dense": np.inf}
    for round_ in range(reps):
        for name, fn in ((("moe", moe), ("dense", dense)) if round_ % 2 == 0 else (("dense", dense), ("moe", moe))):
            best[name] = min(best[name], min(timed(fn, reps=3, warm_up=True).wall_s))
    num_used = len(np.unique(routing.expert_ids))
    return {"num_tokens": num_tokens, "experts_used": num_used, "moe_ms": best["moe"] * 1e3,
            "dense_ms": best["dense"] * 1e3, "ratio_moe_over_dense": best["moe"] / best["dense"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7, help="rounds")
    parser.add_argument("--quick", action="store_true", help="hidden 128, inter 64, 8 experts, 2 rounds")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_moe.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.inter, args.experts, args.reps = 128, 64, 8, 2
    machine = machine_info()
    rows = []
    for n in args.tokens:
        rows.append(compare(n, args.hidden, args.inter, args.experts, args.top_k, args.reps))
        row = rows[-1]
        print(f"{n} tokens ({row['experts_used']} of {args.experts} experts used): moe {row['moe_ms']:.3f} ms, dense "
              f"SwiGLU of {args.top_k} x {args.inter} {row['dense_ms']:.3f} ms, moe / dense {row['ratio_moe_over_dense']:.2f}",
              file=sys.stderr)
    report = {"machine": dict(machine, loadavg_end=list(os.getloadavg())), "command": module_command("bench.moe", argv),
              "hidden": args.hidden, "inter": args.inter, "experts": args.experts, "top_k": args.top_k,
              "reps": args.reps, "rows": rows}
    write_json(args.out, report)
    print(f"load {machine['loadavg_start']} -> {report['machine']['loadavg_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
