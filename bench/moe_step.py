"""A MoE model's decode step against a dense model of the same ACTIVE size: does a step cost what
its active parameters cost?

    python -m bench.moe_step            # hidden 512, 4 layers, 32 experts top-4 of width 256; 1 and 32 seqs
    python -m bench.moe_step --quick    # smoke test

Both models share everything but the MLP: the same attention, embedding and LM head; the dense
MLP is top_k * expert width wide (1024), so per token both do the same multiply-adds (the MoE also
runs its router, [experts, hidden]). A decode step of 1 and of 32 sequences at a 256-token context
(DecoderModel.forward on the numba kernels), timed in rounds that alternate which model goes first;
the best round of each is reported (the machine is shared). At 32 sequences the 128 (token,
expert) pairs reach most experts, so the MoE reads several times the dense MLP's weights in the
same step: its ratio there is the model's cost, not overhead. Raw results: results/bench_moe_step.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.measure import timed
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from bench.step_bench import BLOCK_SIZE, kv_for
from vllmlite.config import ModelConfig
from vllmlite.kernels import get_kernels
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import ModelWeights, random_weights


def moe_weights(dense: ModelWeights, config: ModelConfig, seed: int) -> ModelWeights:
    """`dense` with every layer's MLP replaced by routed experts of `config`'s shape."""
    rng, h, inter, e = np.random.default_rng(seed), config.hidden_size, config.expert_intermediate_size, config.num_experts

    def experts(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((e, rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(dense.dtype)
    layers = [dataclasses.replace(layer, w_gate_up=None, w_down=None, router=experts(1, h)[:, 0],
                                  w_experts_gate_up=experts(2 * inter, h), w_experts_down=experts(h, inter))
              for layer in dense.layers]
    return dataclasses.replace(dense, layers=layers)


def mlp_parameters(config: ModelConfig, active: bool) -> int:
    """One layer's MLP parameters (a token's share, with `active`, in a MoE layer)."""
    if not config.num_experts:
        return 3 * config.intermediate_size * config.hidden_size
    experts = config.num_experts_per_tok if active else config.num_experts
    return (experts * 3 * config.expert_intermediate_size + config.num_experts) * config.hidden_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 8 experts, context 32, 2 rounds")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_moe_step.json")
    args = parser.parse_args(argv)
    hidden, num_experts, width = (128, 8, 64) if args.quick else (512, 32, 256)
    if args.quick:
        args.context, args.rounds = 32, 2
    top_k = 4
    dense_config = ModelConfig(architecture="llama", vocab_size=8192, hidden_size=hidden,
                               intermediate_size=top_k * width, num_layers=4, num_heads=8, num_kv_heads=4,
                               head_dim=hidden // 8, max_position_embeddings=args.context + 1)
    moe_config = dataclasses.replace(dense_config, architecture="mixtral", num_experts=num_experts,
                                     num_experts_per_tok=top_k, moe_intermediate_size=width)
    dense_w = random_weights(dense_config, np.dtype(np.float32), seed=0)
    kernels = get_kernels("numba")
    models = {"dense": DecoderModel(dense_config, dense_w, args.context + 1, kernels),
              "moe": DecoderModel(moe_config, moe_weights(dense_w, moe_config, seed=1), args.context + 1, kernels)}
    machine, rng, rows = machine_info(), np.random.default_rng(0), []
    for num_seqs in args.seqs:
        kv, tables = kv_for(models["dense"], num_seqs, args.context, rng)
        meta = build_metadata([1] * num_seqs, [args.context + 1] * num_seqs, tables, BLOCK_SIZE)
        input_ids, logits_rows = rng.integers(0, dense_config.vocab_size, num_seqs), np.arange(num_seqs)
        best = {"moe": np.inf, "dense": np.inf}
        for round_ in range(args.rounds):
            for name in (("moe", "dense") if round_ % 2 == 0 else ("dense", "moe")):
                step = timed(lambda: models[name].forward(input_ids, meta, kv, logits_rows), reps=3, warm_up=True)
                best[name] = min(best[name], min(step.wall_s))
        rows.append({"num_seqs": num_seqs, "moe_ms": best["moe"] * 1e3, "dense_ms": best["dense"] * 1e3,
                     "ratio_moe_over_dense": best["moe"] / best["dense"]})
        print(f"decode {num_seqs:2d} seqs at context {args.context}: moe {rows[-1]['moe_ms']:.2f} ms, dense "
              f"{rows[-1]['dense_ms']:.2f} ms, moe / dense {rows[-1]['ratio_moe_over_dense']:.2f}", file=sys.stderr)
    shapes = {"hidden": hidden, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 8192, "experts": num_experts,
              "top_k": top_k, "expert_width": width, "dense_width": top_k * width,
              "mlp_params_per_layer": {"dense": mlp_parameters(dense_config, True),
                                       "moe_active": mlp_parameters(moe_config, True),
                                       "moe_total": mlp_parameters(moe_config, False)}}
    report = {"machine": dict(machine, loadavg_end=list(os.getloadavg())), "command": module_command("bench.moe_step", argv),
              "kernels": "numba", "context": args.context, "rounds": args.rounds, "timing": "best round of each",
              "shapes": shapes, "rows": rows}
    write_json(args.out, report)
    print(f"load {machine['loadavg_start']} -> {report['machine']['loadavg_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
