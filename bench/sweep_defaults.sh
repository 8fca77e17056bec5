#!/usr/bin/env bash
# The sweep that chose the server's scheduler defaults (max_num_seqs, max_num_batched_tokens):
# our server launched once per pair on the 48-request burst, all in one run, one after another.
#   bash bench/sweep_defaults.sh                       # about 15 minutes on 2 cores
#   SEQS="16 32" TOKENS="256" bash bench/sweep_defaults.sh --arrivals burst,poisson:4
# Extra arguments go to `python -m bench.serve`. Results: results/serve_defaults_sweep.json.
set -euo pipefail
cd "$(dirname "$0")/.."
launches=()
for seqs in ${SEQS:-16 32 64}; do
    for tokens in ${TOKENS:-128 256 512}; do
        launches+=(--launch "seqs${seqs}_tokens${tokens}=--max-num-seqs ${seqs} --max-num-batched-tokens ${tokens}")
    done
done
exec python -m bench.serve "${launches[@]}" --arrivals burst --out results/serve_defaults_sweep.json "$@"
