"""`python -m bench.serve ...`: run the serving benchmark (see bench/serve/benchmark.py)."""

from bench.serve.benchmark import main

main()
