"""The serving benchmark, in the manner of `vllm bench serve`: `python -m bench.serve --help`.

    benchmark   the command line and the run loop: targets x arrivals, the JSON report
    client      one streamed completion: SSE parsing and per-request timing
    metrics     arrival processes and the per-run summary (percentiles, throughput)
    targets     the servers under test: our server, llama-server, or a URL; their lifetimes
    merge       `python -m bench.serve.merge`: replace one target's runs in a results JSON
    plot        `python -m bench.serve.plot`: the sweep's plots (needs matplotlib)

Workloads come from bench/workload.py and every table from bench/report.py.
"""
