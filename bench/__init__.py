"""vllmlite's benchmarks. Run each from the repository root as a module, `python -m bench.<name>`
(the offline benchmark also as `python bench/bench.py`); each writes its JSON to results/, and
`python -m bench.update_readme` renders the README's numbers from those files.

    bench            the offline benchmark: sequential vs static batching vs the paged engine
    spec_bench       speculative decoding, one request at a time
    step_bench       one forward pass next to its GEMM-only bound
    quant_bench      the linear layers alone, quantized vs float32
    quant_speed      quantized serving speed next to float32 and llama-server
    quant_accuracy   what quantization costs in logits, greedy agreement and perplexity
    kv_agreement     greedy agreement of each KV cache dtype with float32 K/V on 80 prompts
    serve/           the serving benchmark against OpenAI-compatible servers (`python -m bench.serve`)
    update_readme    README.md's benchmark section from results/*.json

Shared by them: workload (every workload), report (provenance, tables), measure (the offline
benchmark's measurements), static_batching (its static-batching driver).
"""
