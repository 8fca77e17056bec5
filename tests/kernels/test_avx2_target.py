"""The kernels that choose their instructions by the CPU (key_products' vector width, byte_dots'
byte products) at AVX2's choice on an AVX-512 machine: their tests re-run in a process whose numba
compiles for a Haswell (AVX2 and FMA, no AVX-512), which any AVX-512 machine can run, so such a
machine checks both forms. On an AVX2 machine the files' own tests are that check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllmlite.kernels.numba import byte_dots, key_products

REPO = Path(__file__).resolve().parents[2]
AVX2_TARGET = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma"}


@pytest.mark.skipif(key_products.WIDTH == 8 and byte_dots.ISA == "avx2",
                    reason="this machine compiles for AVX2 already: the files' own tests check it")
def test_the_kernels_compiled_for_avx2_on_an_avx512_machine(tmp_path):
    """Without AVX-512 the key products keep 8 floats a register (16 registers), and the integer
    kernel's block products are vpmaddubsw's, and the decode kernel holds int8 K's integer products
    in plain IR that it never takes: the key products' tests, the int8 decode kernel against the
    reference, the integer kernel's tests and int8 K's emulated products, compiled for AVX2."""
    script = ("import sys, pytest\n"
              "from vllmlite.kernels.numba import byte_dots, key_products\n"
              "assert key_products.WIDTH == 8 and key_products.KEYS == 8, key_products.WIDTH\n"
              "assert byte_dots.ISA == 'avx2', byte_dots.ISA\n"
              "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-n', '0', "
              "'tests/kernels/test_key_products.py', 'tests/kernels/test_int_dot.py', "
              "'tests/kernels/test_kv_cache_dtype.py::test_numba_int8_decodes_read_in_place_match_the_reference', "
              "'tests/kernels/test_int8_scores.py::test_integer_score_products_are_the_definitions_sums[128-3-True]', "
              "'tests/kernels/test_int8_scores.py::test_attention_over_int8_keys_uses_the_rounded_queries']))\n")
    env = {**os.environ, **AVX2_TARGET, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout and "skipped" not in result.stdout, \
        result.stdout[-3000:]
