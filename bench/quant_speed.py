"""Quantized serving speed next to float32 and llama-server: one user alone, and a burst.

    python -m bench.quant_speed            # about 12 minutes on 2 cores
    python -m bench.quant_speed --quick    # a smoke test (tests/test_quant_speed.py)

Every target is a fresh server on this machine, one after another in one run (bench/serve/):

    none            float32: the GGUF's Q4_1/Q8_0 blocks dequantized at load (the default)
    int4            --quantization int4: the GGUF's Q4_1 layers and Q8_0 embedding as stored
    int8_from_f32   --quantization int8 on an F32 copy of the same GGUF (written here once): every
                    matrix rounded to int8 blocks at load, so int8's own speed is measured
    llama.cpp_np1   llama-server on the Q4_1 GGUF with one slot (bench/build_llama_server.sh)

Single stream: the long-prompt mix (every third prompt 512-1536 tokens) one request at a time.
Decode tok/s is 1 / the median over requests of the time per output token after the first (a
median: one stalled request does not stand for the rest); prefill tok/s is the long prompts'
tokens over their time to first token. Burst: the 48-request base set sent at once to
our three targets (llama-server's burst numbers are in results/serve_sweep.json), in --burst-rounds
rounds with the targets' order rotated each round: one burst's throughput varies 10-35% from run to
run on a small VM, so the summary gives each target's median, and its ratio to float32 as the median
of the rounds' ratios (each taken within one round). Each run also records the server's resident
memory. Raw runs: results/quant_single_stream.json and results/quant_burst.json (round 1),
quant_burst_2.json, ...; the summary: results/quant_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.report import REPO_ROOT, machine_info, module_command
from bench.serve import benchmark as serve_benchmark
from vllmlite.models.model_source import resolve_model

F32_COPY = REPO_ROOT / "bench" / "data" / "SmolLM2-135M-Instruct.F32.gguf"  # git-ignored (*.gguf)
LONG_PROMPT = 512  # prompts at least this long count for prefill tok/s


def write_f32_copy(source: str, path: Path) -> None:
    """The GGUF at `source` with every tensor dequantized to F32 and its metadata copied."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        writer.add_tensor(t.name, np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type).reshape(shape),
                                                       dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def summarize_run(run: dict) -> dict:
    ok = [r for r in run["requests"] if r["error"] is None]
    tpots = [r["tpot_s"] for r in ok if r["tpot_s"] == r["tpot_s"]]       # not NaN
    long = [r for r in ok if r["prompt_tokens"] >= LONG_PROMPT]
    s = run["summary"]
    return {"target": run["target"], "arrival": run["arrival"],
            "decode_tok_s": 1 / float(np.median(tpots)) if tpots else None,
            "prefill_tok_s": sum(r["prompt_tokens"] for r in long) / sum(r["ttft_s"] for r in long) if long else None,
            "output_tok_s": s["output_throughput"], "ttft_p50_s": s["ttft_ms"]["p50"] / 1e3,
            "errors": s["errors"], "server_memory": run.get("server_memory")}


def burst_medians(rounds: list[list[dict]]) -> list[dict]:
    """Per target, in the first round's order: the median over rounds of its output tok/s and TTFT,
    and of its ratio to float32 ("none") within each round."""
    rows = []
    for first in rounds[0]:
        runs = [next(r for r in rnd if r["target"] == first["target"]) for rnd in rounds]
        ratios = [run["output_tok_s"] / next(r for r in rnd if r["target"] == "none")["output_tok_s"]
                  for run, rnd in zip(runs, rounds)]
        rows.append(dict(first, output_tok_s=float(np.median([r["output_tok_s"] for r in runs])),
                         ttft_p50_s=float(np.median([r["ttft_p50_s"] for r in runs])),
                         x_float32=float(np.median(ratios)), x_float32_rounds=ratios,
                         errors=sum(r["errors"] for r in runs)))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-llama", action="store_true", help="leave llama-server out")
    parser.add_argument("--burst-rounds", type=int, default=3, help="bursts per target (1 with --quick)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "results")
    args = parser.parse_args(argv)
    source = resolve_model("default")
    if not F32_COPY.exists():
        print(f"writing an F32 copy of {Path(source).name} to {F32_COPY} ...", flush=True)
        start = time.perf_counter()
        write_f32_copy(source, F32_COPY)
        os.sync()  # its 538 MB written back now, not under the first timed run
        print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    targets = ["none=", "int4=--quantization int4", f"int8_from_f32=--model {F32_COPY} --quantization int8"]
    ours = [flag for target in targets for flag in ("--launch", target)]
    llama = [] if args.no_llama else ["--launch-llama", "llama.cpp_np1=-np 1"]
    quick = ["--quick"] if args.quick else []
    prefix = "quant_quick_" if args.quick else "quant_"
    single = serve_benchmark.main([*ours, *llama, "--workload", "long_mix", "--num-requests", "4" if args.quick else "12",
                         "--arrivals", "concurrency:1", *quick, "--out", str(args.out_dir / f"{prefix}single_stream.json")])
    rounds = []
    for k in range(1 if args.quick else args.burst_rounds):
        order = targets[k % len(targets):] + targets[:k % len(targets)]
        burst = serve_benchmark.main([*(flag for target in order for flag in ("--launch", target)), "--workload", "base",
                                      "--arrivals", "burst", *quick,
                                      "--out", str(args.out_dir / f"{prefix}burst{f'_{k + 1}' if k else ''}.json")])
        rounds.append([summarize_run(r) for r in burst["runs"]])
    report = {"command": module_command("bench.quant_speed", argv),
              "machine": machine_info(),
              "single_stream": [summarize_run(r) for r in single["runs"]],
              "burst": burst_medians(rounds), "burst_rounds": rounds}
    (args.out_dir / f"{prefix}speed.json").write_text(json.dumps(report, indent=1) + "\n")
    print()
    for row in report["single_stream"]:
        mem = row["server_memory"] or {}
        print(f"single stream {row['target']:18s} decode {row['decode_tok_s'] or 0:6.1f} tok/s  "
              f"prefill {row['prefill_tok_s'] or 0:6.1f} tok/s  peak RSS {mem.get('peak_rss_mib', 0):5.0f} MiB")
    for row in report["burst"]:
        print(f"burst         {row['target']:18s} {row['output_tok_s']:6.1f} out tok/s (median)  "
              f"{row['x_float32']:.2f}x float32 (median of {', '.join(f'{x:.2f}' for x in row['x_float32_rounds'])})")
    return report


if __name__ == "__main__":
    main()
