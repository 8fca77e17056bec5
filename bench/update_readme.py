"""Regenerate README.md's benchmark section from the raw JSON in results/.

    python -m bench.update_readme             # rewrite README.md's section
    python -m bench.update_readme --print     # print it instead

Everything between `<!-- bench:start -->` and `<!-- bench:end -->` is rewritten; the numbers come
only from results/*.json, with the machine, command and date each file records.
"""

from __future__ import annotations

import json
import math
import sys

from bench.report import REPO_ROOT, side_by_side, sweep_claims

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _machine_line(report: dict) -> str:
    m = report.get("machine", {})
    cpu = m.get("cpu_model") or m.get("processor") or "unknown CPU"
    commit = (m.get("git_commit") or "")[:10]
    return (f"Machine: {cpu}, {m.get('cpu_count')} cores, numpy {m.get('numpy')}, Python {m.get('python')}; "
            f"date {m.get('date')}; commit {commit}. Command: `{report.get('command')}`")


def offline_section(report: dict) -> list[str]:
    lines = ["### Offline: sequential vs static batching vs the paged engine (`bench/bench.py`)", "",
             _machine_line(report), "",
             "| row | output tok/s | x sequential | TTFT mean / p50 / p99 (s) | TPOT (ms) | forward passes "
             "| KV utilization | prefix hit rate |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    rows = report["rows"]
    base = {}
    for row in rows:
        base.setdefault(row["workload"], row["output_tokens_per_s"])
        hit = row.get("prefix_hit_rate")
        lines.append(
            f"| {row['name']} | {row['output_tokens_per_s']:.1f} | "
            f"{row['output_tokens_per_s'] / base[row['workload']]:.2f} | "
            f"{row['ttft_mean_s']:.1f} / {row['ttft_p50_s']:.1f} / {row['ttft_p99_s']:.1f} | "
            f"{row['tpot_mean_s'] * 1000:.0f} | {row['forward_passes']} | {row['kv_utilization']:.0%} | "
            f"{'-' if hit is None else f'{hit:.0%}'} |")
    lines += ["", "Targets (from the issue), as measured:", ""]
    for t in report.get("targets", []):
        verdict = "met" if t["met"] else "**missed**"
        lines.append(f"- {t['description']}: {t['value']:.2f} (target >= {t['threshold']}) - {verdict}")
    return lines


def spec_section(report: dict) -> list[str]:
    lines = ["### Speculative decoding, one request at a time, greedy (`bench/spec_bench.py`)", "",
             _machine_line(report), "",
             "| prompt | config | wall s | speedup | target passes | draft passes | acceptance | same output |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['prompt_kind']} | {r['config']} | {r['seconds']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['target_forward_passes']} | {r['draft_forward_passes']} | "
                     f"{r['acceptance_rate']:.0%} | {r['identical_to_off']} |")
    return lines


def step_section(report: dict) -> list[str]:
    lines = ["### One forward pass next to its GEMM-only bound (`bench/step_bench.py`)", "",
             _machine_line(report), "",
             "Decode: every sequence one token, its whole context in shuffled KV blocks; GEMM-only is the "
             "same linear layers on the same rows and nothing else.", "",
             "| kernels | sequences | context | forward ms | GEMM-only ms | ratio | tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["decode"]:
        lines.append(f"| {r['kernels']} | {r['num_seqs']} | {r['context']} | {r['forward_s'] * 1e3:.1f} | "
                     f"{r['gemm_only_s'] * 1e3:.1f} | {r['ratio']:.2f} | {r['tokens_per_s']:.1f} |")
    lines += ["", "| kernels | prefill prompt | tok/s | GEMM-only tok/s | fraction |", "|---|---:|---:|---:|---:|"]
    for r in report["prefill"]:
        lines.append(f"| {r['kernels']} | {r['prompt_len']} | {r['tokens_per_s']:.0f} | "
                     f"{r['gemm_only_tokens_per_s']:.0f} | {r['fraction_of_gemm_rate']:.0%} |")
    default = report["kernels"][0]
    decode = next((r for r in report["decode"] if r["kernels"] == default and r["num_seqs"] == 32
                   and r["context"] == 512), None)
    prefill = next((r for r in report["prefill"] if r["kernels"] == default), None)
    lines += ["", f"Targets, `{default}` kernels:", ""]
    if decode:
        lines.append(f"- decode step at 32 sequences, context 512: {decode['ratio']:.2f}x the GEMM-only time "
                     f"(target <= 1.3x) - {'met' if decode['ratio'] <= 1.3 else '**missed**'}")
    if prefill:
        fraction = prefill["fraction_of_gemm_rate"]
        lines.append(f"- prefill of a {prefill['prompt_len']}-token prompt: {fraction:.0%} of the GEMM-only rate "
                     f"(target >= 85%) - {'met' if fraction >= 0.85 else '**missed**'}")
    return lines


def serve_sweep_section(report: dict) -> list[str]:
    lines = side_by_side(report, _machine_line, "### Serving: our server at its defaults vs llama.cpp's "
                         "llama-server, burst and Poisson arrivals (`python -m bench.serve`)")
    lines += ["", "Our server against llama-server's best `--parallel` at each arrival, from the table above:",
              ""] + sweep_claims(report)
    lines += ["", "Plots from the same JSON (`python -m bench.serve.plot`): "
              "[latency vs throughput](results/serve_sweep_pareto.png), "
              "[TTFT vs arrival rate](results/serve_sweep_ttft_vs_rate.png)."]
    return lines


def serve_shared_prefix_section(report: dict) -> list[str]:
    return side_by_side(report, _machine_line, "### Serving a shared system prompt: prefix caching off vs on "
                        "(`python -m bench.serve --workload shared_prefix`)")


def serve_single_stream_section(report: dict) -> list[str]:
    return side_by_side(report, _machine_line, "### Serving one user at a time: our server vs llama-server "
                        "`--parallel 1` (`python -m bench.serve --arrivals concurrency:1`)")


def serve_burst_repeat_section(report: dict) -> list[str]:
    return side_by_side(report, _machine_line, "### The burst again, after every other benchmark "
                        "(how much one run of it varies)")


def quant_speed_section(report: dict) -> list[str]:
    lines = ["### Quantized weights: one user alone and a burst, next to float32 and llama-server "
             "(`bench/quant_speed.py`)", "", _machine_line(report), "",
             "none is float32 (the GGUF dequantized at load); int4 keeps the GGUF's Q4_1 layers and Q8_0 "
             "embedding as stored; int8_from_f32 rounds every matrix of an F32 copy of the same GGUF to "
             "int8 at load. Decode tok/s = 1 / median time per output token after the first, one request "
             "at a time; prefill tok/s = tokens of the 512-1536-token prompts / their time to first token. "
             "Memory: the server's resident set at the end of the run (and its peak, which includes loading).",
             "", "| target | decode tok/s | x llama-server | prefill tok/s | RSS MiB (peak) |",
             "|---|---:|---:|---:|---:|"]
    single = report["single_stream"]
    llama = next((r for r in single if r["target"].startswith("llama")), None)
    for r in single:
        mem = r["server_memory"] or {}
        versus = f"{r['decode_tok_s'] / llama['decode_tok_s']:.2f}x" if llama else "-"
        lines.append(f"| {r['target']} | {r['decode_tok_s']:.1f} | {versus} | {r['prefill_tok_s']:.0f} | "
                     f"{mem.get('rss_mib', 0):.0f} ({mem.get('peak_rss_mib', 0):.0f}) |")
    base = next(r for r in report["burst"] if r["target"] == "none")
    ratio = {r["target"]: r.get("x_float32", r["output_tok_s"] / base["output_tok_s"]) for r in report["burst"]}
    rounds = len(report.get("burst_rounds", [None]))
    lines += ["", f"| burst of 48 requests (median of {rounds} rounds) | output tok/s | x float32 | each round | "
              "TTFT p50 s |", "|---|---:|---:|---|---:|"]
    lines += [f"| {r['target']} | {r['output_tok_s']:.1f} | {ratio[r['target']]:.2f}x | "
              f"{', '.join(f'{x:.2f}' for x in r.get('x_float32_rounds', [ratio[r['target']]]))} | "
              f"{r['ttft_p50_s']:.2f} |" for r in report["burst"]]
    lines += ["", "Targets (from the issue), as measured:", ""]
    for target, threshold in (("int4", 0.75), ("int8_from_f32", 0.5)):
        row = next((r for r in single if r["target"] == target), None)
        if row and llama:
            value = row["decode_tok_s"] / llama["decode_tok_s"]
            lines.append(f"- {target} single-stream decode: {value:.2f}x llama-server's (target >= {threshold}) - "
                         f"{'met' if value >= threshold else '**missed**'}")
    for r in report["burst"]:
        if r["target"] != "none":
            value = ratio[r["target"]]
            lines.append(f"- {r['target']} burst throughput: {value:.2f}x float32, median of {rounds} rounds "
                         f"(target >= 0.9) - "
                         f"{'met' if value >= 0.9 else '**missed**'}")
    return lines


def quant_accuracy_section(report: dict) -> list[str]:
    text = report["text"]
    lines = ["### What quantization costs in accuracy (`bench/quant_accuracy.py`)", "", _machine_line(report), "",
             f"Against float32 (`none`): the largest last-position logit difference over the 13 parity prompts, "
             f"how many of their 32-token greedy continuations are identical, and perplexity over "
             f"{text['tokens']} tokens of `{text['path']}` (Shakespeare, public domain) scored as one prompt. "
             "This GGUF's float32 weights are its Q4_1/Q8_0 blocks decoded, so `int8`/`int4` (which keep the "
             "blocks) compute the same function, and rounding the float32 weights again is exact wherever the "
             "grids match: int4 rebuilds the Q4_1 layers bit for bit (only the tied embedding/LM head goes from "
             "8 to 4 bits); int8's rounding (affine, or Q8_0's symmetric grid where that fits a block better) "
             "rebuilds both the Q4_1 layers and the Q8_0 embedding to float rounding, so on this model the int8 "
             "row says nothing about rounding genuinely float weights. The weight-error columns show which; a "
             "model with genuinely float weights was not available here (no model hub; the default model ships "
             "only as this GGUF) to measure our rounding on.", "",
             "| row | weights | MB | weight err (embedding / layers) | max logit diff | greedy = float32 "
             "| greedy = transformers | perplexity | vs float32 |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        n = r["num_prompts"]
        lines.append(f"| {r['name']} | {r['weights']} | {r['weights_bytes'] / 1e6:.0f} | "
                     f"{r['weight_error_embedding']:.2%} / {r['weight_error_layers']:.2%} | "
                     f"{r['max_abs_logit_diff_vs_none']:.1e} | {r['greedy_same_as_none']}/{n} | "
                     f"{r['greedy_same_as_transformers']}/{n} | {r['perplexity']:.3f} | "
                     f"{r['perplexity_vs_none'] - 1:+.2%} |")
    llama = report.get("llama_cpp")
    chunked = ", ".join(f"{r['name']} {r['perplexity_llama_cpp_protocol']:.3f}" for r in report["rows"])
    lines += ["", f"Perplexity in `llama-perplexity -c {llama['n_ctx'] if llama else 1024}`'s protocol (whole "
              f"chunks, each chunk's second half scored): {chunked}; llama.cpp itself on the same Q4_1 GGUF and "
              + (f"text: {llama['perplexity']:.3f} +/- {llama['plus_minus']:.3f} (it also rounds the activations "
                 "to 8 bits for its Q4_1 dot products)." if llama else "text: not measured (llama-perplexity not built).")]
    lines += ["", "Targets (from the issue), as measured on the rows rounded from float32 (the `int8`/`int4` rows "
              "meet them trivially: they are float32's function):", ""]
    lines += [f"- {t['row']}: {t['target']}: {t['value']} - {'met' if t['met'] else '**missed**'}"
              for t in report["targets"]]
    return lines


def chunking_section(report: dict) -> list[str]:
    from bench.chunking import format_table  # the benchmark's own table, so the two never disagree
    w = report["workload"]
    m = report["machine"]
    lines = ["### Chunked prefill under a burst: fixed budgets vs adaptive (`python -m bench.chunking`)", "",
             _machine_line(report) + f" Load average at start / end: {m['loadavg_start'][0]:.1f} / "
             f"{m.get('loadavg_end', [math.nan])[0]:.1f} (2 cores).", "",
             f"Workload: {w['num_streams']} closed-loop streams decoding ({w['stream_prompt_len']}-token prompts, "
             f"{w['stream_max_tokens']} output tokens each), then at {w['burst_at_s']:g} s long prompts of "
             f"{', '.join(map(str, w['long_prompt_lens']))} tokens arrive at once. Stream latency is measured from "
             "their arrival to the last long prompt's first token: ITL is every inter-token gap, TPOT the "
             "per-request mean (vLLM's). Adaptive rows name their target (`default`: none given, the engine's "
             "own, 1.5x the decodes' predicted step without prompts; `3x`: 3 times the baseline's ITL p50; "
             "`p99:fixed-64`: the streams' ITL p99 measured under that fixed budget) and use the largest fixed "
             "budget as their ceiling.", "", format_table(report), "",
             "Targets (from the issue):", ""]
    lines += [f"- {t['name']}: {t['value']:.2f} (target <= {t['threshold']}) - {'met' if t['met'] else '**missed**'}"
              for t in report["targets"]]
    bound = report.get("ttft_bound")
    if bound:
        lines += ["", f"The bound: the long prompts prefilled alone took {bound['prefill_alone_s']:.1f} s; a policy "
                  f"that keeps every stream step within {bound['factor']:g}x the streams-alone step leaves the prompts "
                  f"at most {(bound['factor'] - 1) / bound['factor']:.0%} of each step's time, so its last long prompt starts no sooner than "
                  f"{bound['least_last_ttft_s']:.1f} s, {bound['least_over_best_fixed']:.2f}x the best fixed budget's "
                  f"{bound['best_fixed_last_ttft_s']:.1f} s (`ttft_bound` in the JSON)."]
    return lines


SECTIONS = [("bench_offline.json", offline_section), ("bench_spec.json", spec_section),
            ("serve_sweep.json", serve_sweep_section), ("serve_shared_prefix.json", serve_shared_prefix_section),
            ("serve_single_stream.json", serve_single_stream_section),
            ("serve_burst_repeat.json", serve_burst_repeat_section),
            ("bench_step.json", step_section), ("quant_speed.json", quant_speed_section),
            ("quant_accuracy.json", quant_accuracy_section), ("bench_chunking.json", chunking_section)]


def main() -> None:
    blocks = []
    for name, render in SECTIONS:
        path = REPO_ROOT / "results" / name
        if path.is_file():
            blocks += render(json.loads(path.read_text())) + [""]
        else:
            blocks += [f"_{name} not present: run the benchmark that writes it._", ""]
    if "--print" in sys.argv[1:]:  # show the section without touching README.md
        print("\n".join(blocks))
        return
    readme = REPO_ROOT / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        sys.exit(f"README.md lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + START + "\n" + "\n".join(blocks) + END + tail)
    print("README.md benchmark section regenerated from results/")


if __name__ == "__main__":
    main()
