"""Shared fixtures: the tiny seeded float64 model and factories for engines and requests."""

from __future__ import annotations

import importlib.util
import os

from paths import REPO_ROOT

# Under pytest-xdist each worker compiles into its own numba cache (the server processes a test starts
# inherit it): numba reads, changes and writes a function's cache index without a lock, so two
# processes saving signatures of one function at once could give both the same file, and a later run
# would load the other signature's machine code.
if os.environ.get("PYTEST_XDIST_WORKER") and "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = str(REPO_ROOT / ".numba_cache" / os.environ["PYTEST_XDIST_WORKER"])

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import importlib
import itertools
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, settings
from server_util import running_server

from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.engine_args import EngineArgs
from vllmlite.kernels import BACKENDS, Kernels, get_kernels
from vllmlite.models.loader import LoadedModel, load_model
from vllmlite.outputs import RequestOutput
from vllmlite.sampling_params import SamplingParams

# Property tests (tests/test_property_*.py): the same examples on every CI run (derandomized, no
# example database), random ones locally. Each test bounds its own max_examples; see
# tests/property_util.py for the long form (VLLMLITE_HYPOTHESIS_EXAMPLES).
# No deadline and no too-slow check: the machine is often shared, and a slow example is no bug.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


CI_REQUIRED_MARKERS = ("real_model", "ray", "browser")  # tests that must run, not skip, in CI


def is_ci() -> bool:
    """Running in CI (`CI=true`, as GitHub Actions and most CI systems set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_unless_ci(reason: str) -> NoReturn:
    """A real model, golden file or optional package is missing: skip the test locally, but fail
    it in CI, where the real-model tests must run rather than vanish as skips."""
    if is_ci():
        pytest.fail(f"{reason} (CI=true: a missing model, golden file or package fails the test)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)   # also from a module's top level (a missing package)


def import_or_skip_unless_ci(name: str) -> ModuleType:
    """`pytest.importorskip`, failing in CI instead of skipping."""
    try:
        return importlib.import_module(name)
    except ImportError:
        skip_unless_ci(f"{name} is not installed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skipped `real_model`, `ray` or `browser` test is a failure, whatever skipped it (a fixture's
    importorskip, a missing file or browser): those are exactly the tests a broken CI set-up would
    otherwise lose silently."""
    outcome = yield
    report = outcome.get_result()
    marker = next((m for m in CI_REQUIRED_MARKERS if item.get_closest_marker(m) is not None), None)
    if report.skipped and is_ci() and marker is not None:
        report.outcome = "failed"
        report.longrepr = f"{marker} test skipped in CI: {report.longrepr}"


# Test files of a minute or more (`--durations` of a CI run on 2 cores), run first: pytest-xdist
# hands whole files (--dist loadfile) to its processes in collection order, so one of these last
# would keep one process busy while the others sat idle at the end of the run.
SLOW_FILES = (
    "tests/models/test_torch_backend.py",
    "tests/api/test_api_fuzz.py",
    "tests/bench/test_quant_speed.py",
    "tests/api/ray/test_ray_serving.py",
    "tests/worker/test_cuda_graphs.py",
    "tests/worker/test_real_structured.py",
    "tests/worker/test_multi_step.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """The slow files' tests first (SLOW_FILES), each file's tests in their own order."""
    missing = [path for path in SLOW_FILES if not (REPO_ROOT / path).is_file()]
    if missing:   # a moved or renamed file would silently go back to its place in the order
        raise pytest.UsageError(f"tests/conftest.py SLOW_FILES names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def _torch_backends() -> list:
    """The torch kernels where torch is installed (the cuda extra): on the CPU, and on a GPU under the
    `cuda` mark (skipped without one)."""
    if importlib.util.find_spec("torch") is None:
        return []
    return ["torch", "torch-triton", pytest.param("torch-cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=sorted(BACKENDS) + _torch_backends())
def kernels(request) -> Kernels:
    """Each kernel backend in turn: tests that take this fixture run on every one (torch's through
    tests/torch_facade.py, which speaks numpy arrays: its torch operations, its Triton kernels in
    Triton's interpreter, and both on a GPU)."""
    if request.param.startswith("torch"):
        from torch_facade import NumpyFacade, triton_interpreted_without_a_gpu
        device = "cuda" if request.param == "torch-cuda" else "cpu"
        if device == "cuda" and not cuda_available():
            pytest.skip("no CUDA device")
        if request.param == "torch-triton" and not triton_interpreted_without_a_gpu():
            pytest.skip("triton is not installed")
        return NumpyFacade(device, triton=request.param != "torch")   # on CUDA: the Triton kernels
    return get_kernels(request.param)


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """2 layers, hidden 64, 4 heads / 2 KV heads, byte vocabulary, float64."""
    return load_model("random", dtype="float64", seed=0)


def engine_on(loaded: LoadedModel, dtype: str = "float64", quantization: str = "none",
              **overrides) -> LLMEngine:
    """An engine over a model already loaded (the random one), with any EngineArgs knob given by
    name (an unknown one is a TypeError); 256 KV blocks unless said."""
    args = EngineArgs(model="random", dtype=dtype, quantization=quantization, **{"num_blocks": 256, **overrides})
    return LLMEngine(args.create_engine_config(), loaded)


@pytest.fixture
def make_engine(tiny_model) -> Callable[..., LLMEngine]:
    def factory(**overrides) -> LLMEngine:
        return engine_on(tiny_model, **overrides)
    return factory


def make_prompts(count: int, seed: int = 0, min_len: int = 1, max_len: int = 40) -> list[list[int]]:
    """Random byte-token prompts of varied lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(count)]


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_completion(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]],
                      arrivals: dict[int, int] | None = None) -> list[RequestOutput]:
    """Add requests (request i at step arrivals.get(i, 0)), step until done, checking block
    invariants after every step. Returns outputs in request order and asserts nothing leaked."""
    arrivals = arrivals or {}
    finished: dict[str, RequestOutput] = {}
    for step in itertools.count():
        for i, (prompt, params) in enumerate(requests):
            if arrivals.get(i, 0) == step:
                engine.add_request(str(i), prompt, params)
        if step > max(arrivals.values(), default=0) and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.block_manager.check_invariants()
        assert step < 100_000, "engine did not finish"
    assert_no_leaks(engine)
    return [finished[str(i)] for i in range(len(requests))]


def step_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until nothing is left, checking block invariants after every step; the finished
    outputs by request id, once nothing leaked."""
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.block_manager.check_invariants()
    assert_no_leaks(engine)
    return finished


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every block is free or cached, and no request state remains anywhere."""
    engine.block_manager.check_invariants()
    stats = engine.get_stats()
    assert stats.scheduler.num_kv_blocks_free == stats.scheduler.num_kv_blocks
    assert (stats.scheduler.num_running, stats.scheduler.num_waiting, stats.scheduler.num_swapped) == (0, 0, 0)
    assert not engine.scheduler.requests  # no request state left behind, forks included
    assert stats.num_unfinished_requests == 0 and not engine.has_unfinished_requests()


@pytest.fixture
def make_async(make_engine):
    """Started AsyncLLMEngines over the tiny model, with metrics; AsyncLLMEngine's own keywords
    (max_queue, request_timeout, heartbeat_timeout) and any engine knob by name. Shut down after."""
    engines: list[AsyncLLMEngine] = []

    def factory(max_queue=None, request_timeout=None, heartbeat_timeout=None, **engine_overrides) -> AsyncLLMEngine:
        engine = AsyncLLMEngine(make_engine(**engine_overrides), EngineMetrics("random"), max_queue=max_queue,
                                request_timeout=request_timeout, heartbeat_timeout=heartbeat_timeout)
        engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown(timeout=0)
        assert not engine.is_running


@pytest.fixture(scope="module")
def server(tiny_model):
    """A live server on the tiny model, shared by one test module's tests (a module may define its own)."""
    with running_server(tiny_model) as live:
        yield live


@pytest.fixture
def client(server) -> openai.OpenAI:
    """The official OpenAI client against `server`; no retries, so a failure shows at once."""
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
