"""EngineArgs is the one settings source: every knob's default is written once, and the CLI flags,
the VLLMLITE_* variables, LLM(**kwargs) and the tests' engine factory all reach the same EngineConfig."""

from __future__ import annotations

import ast
import json
import logging
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from vllmlite import engine_args as engine_args_module
from vllmlite.api.cli import OPTIONS, ServerArgs, parse_config
from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig, TraceConfig
from vllmlite.engine_args import ENGINE_ARG_NAMES, EngineArgs

REPO = Path(__file__).resolve().parents[1]
KNOBS = frozenset(f.name for f in fields(ServerArgs))
RUNTIME_CONFIGS = (CacheConfig, SchedulerConfig, EngineConfig, TraceConfig)
# Where a knob's default could be written: every class in the package, and the parameters of the
# surfaces that take knobs (the offline API, the CLI, EngineArgs itself, the tests' engine factory).
SURFACE_FUNCTIONS = {"vllmlite/llm.py": None, "vllmlite/api/cli.py": None, "vllmlite/engine_args.py": None,
                     "tests/conftest.py": {"engine_on", "make_engine"}}

# Every engine knob set away from its default, as a Python value and as CLI text.
VALUES = {"model": "random", "tokenizer": "random", "dtype": "float64", "seed": 7, "max_model_len": 100,
          "block_size": 8, "num_blocks": 50, "kv_cache_memory": 1 << 20, "enable_prefix_caching": False,
          "preemption_mode": "swap", "swap_space": 0.01, "max_num_seqs": 3, "max_num_batched_tokens": 32,
          "batching": "static", "prefill_chunking": "adaptive", "target_tpot_ms": 120.0,
          "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
          "kernels": "numpy", "quantization": "none", "tensor_parallel_size": 1, "kv_cache_dtype": "auto",
          "trust_remote_code": True, "enforce_eager": True, "disable_custom_all_reduce": True,
          "cpu_offload_gb": 2.0, "disable_log_stats": True, "pooling": "mean", "trace_ring_size": 10,
          "trace_max_events": 5, "debug_store_prompts": True, "runner": "pooling"}
NOT_IN_VALUES = {"gpu_memory_utilization",  # exclusive with kv_cache_memory; tested on its own
                 "device",  # cuda needs a GPU to build an engine; tested below and in tests/models/test_torch_backend.py
                 "num_scheduler_steps",  # exclusive with speculative_config; tested below
                 "async_scheduling",  # exclusive with adaptive chunking; tested below
                 "int_dot"}  # needs quantization int8/int4 (float32); tested below and in tests/engine/test_int_dot_engine.py


def as_text(value) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def as_flags(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, as_text(value)]
    return argv


# --- defaults written once ------------------------------------------------------------------------

def _literal(node: ast.expr | None):
    """The value of a default written as a literal (through knob(x, ...) or field(default=x)), else None."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "knob":
        node = node.args[0]
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field":
        node = next((k.value for k in node.keywords if k.arg == "default"), None)
    if node is None:
        return None
    literal_nodes = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.List, ast.operator, ast.unaryop, ast.Load)
    if not all(isinstance(n, literal_nodes) for n in ast.walk(node)):
        return None  # a reference such as CacheConfig.block_size
    return eval(compile(ast.Expression(node), "<default>", "eval"))


def literal_defaults(source: str, where: str, functions: set[str] | None = None) -> Iterator[tuple]:
    """(knob, value, place) for each literal non-None default of a knob-named class field, or of a
    parameter of a function (all of them, or those named in `functions`)."""
    for node in ast.walk(ast.parse(source)):
        pairs: list[tuple[str, ast.expr]] = []
        if isinstance(node, ast.ClassDef):
            pairs = [(s.target.id, s.value) for s in node.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None]
        elif isinstance(node, ast.FunctionDef) and (functions is None or node.name in functions):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = [(p.arg, d) for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)]
            pairs += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for name, default in pairs:
            value = _literal(default)
            if name in KNOBS and value is not None:
                yield name, value, f"{where}:{default.lineno} {node.name}"


def duplicated_defaults(sites: list[tuple]) -> list[str]:
    seen: dict[tuple, str] = {}
    duplicates = []
    for name, value, place in sites:
        key = (name, repr(value))
        if key in seen:
            duplicates.append(f"{name}={value!r} at {seen[key]} and {place}")
        seen.setdefault(key, place)
    return duplicates


def package_sites() -> list[tuple]:
    sites = []
    for path in sorted((REPO / "vllmlite").rglob("*.py")) + [REPO / "tests" / "conftest.py"]:
        relative = str(path.relative_to(REPO))
        class_only = relative not in SURFACE_FUNCTIONS
        functions = set() if class_only else SURFACE_FUNCTIONS[relative]
        sites += literal_defaults(path.read_text(), relative, functions)
    return sites


def test_no_knob_default_is_written_twice():
    assert duplicated_defaults(package_sites()) == []


def test_the_duplicate_check_catches_a_copied_default():
    copied = ("class ServerArgs(EngineArgs):\n    block_size: int = knob(16, 'tokens per block')\n"
              "def __init__(self, model='random', *, max_num_seqs=64): ...\n")
    assert [d.split(" at ")[0] for d in duplicated_defaults(package_sites() + list(literal_defaults(copied, "x")))] \
        == ["block_size=16", "max_num_seqs=64"]


def test_engine_args_take_the_runtime_configs_defaults_by_reference():
    """A knob the runtime configs hold reads its default from them: `knob(CacheConfig.block_size, ...)`.
    The one exception is dtype, whose default is vLLM's "auto", which stands for EngineConfig's."""
    tree = ast.parse((REPO / "vllmlite" / "engine_args.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs").body
    defaults = {s.target.id: s.value.args[0] for s in body if isinstance(s, ast.AnnAssign)}
    for config_class in RUNTIME_CONFIGS:
        for f in fields(config_class):
            if f.name in defaults and f.name != "dtype":
                reference = defaults[f.name]
                assert isinstance(reference, ast.Attribute) and reference.attr == f.name \
                    and reference.value.id in {c.__name__ for c in RUNTIME_CONFIGS}, f.name
    assert EngineArgs.dtype == "auto" and EngineArgs().resolved_dtype == EngineConfig.dtype
    assert EngineArgs().create_engine_config() == EngineConfig()


# --- every surface reaches the same EngineConfig -------------------------------------------------------

def test_values_cover_every_engine_knob():
    assert set(VALUES) | NOT_IN_VALUES == ENGINE_ARG_NAMES


def test_flags_variables_kwargs_and_the_factory_build_the_same_engine_config(make_engine):
    from vllmlite.llm import LLM
    expected = EngineArgs(**VALUES).create_engine_config()
    assert expected.cache == CacheConfig(block_size=8, num_blocks=50, kv_cache_memory=1 << 20,
                                         enable_prefix_caching=False, preemption_mode="swap", swap_space=0.01)
    assert expected.scheduler == SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32, max_model_len=100,
                                                 batching="static", prefill_chunking="adaptive",
                                                 target_tpot_ms=120.0)
    assert (expected.dtype, expected.seed, expected.kernels, expected.speculative.num_speculative_tokens,
            expected.pooling) == ("float64", 7, "numpy", 2, "mean")
    assert expected.trace == TraceConfig(trace_ring_size=10, trace_max_events=5, debug_store_prompts=True)
    environ = {option.env: as_text(VALUES[option.field]) for option in OPTIONS if option.field in VALUES}
    assert parse_config(as_flags(VALUES), {}).create_engine_config() == expected
    assert parse_config([], environ).create_engine_config() == expected
    assert LLM(**VALUES).engine.config == expected
    factory_values = {k: v for k, v in VALUES.items() if k != "model"}
    assert make_engine(**factory_values).config == expected


def test_async_scheduling_from_flag_variable_or_keyword_and_needs_fixed_chunking():
    for args in (parse_config(["--async-scheduling"], {}), parse_config([], {"VLLMLITE_ASYNC_SCHEDULING": "1"}),
                 EngineArgs(async_scheduling=True)):
        assert args.create_engine_config().scheduler.async_scheduling is True
    assert EngineArgs().create_engine_config().scheduler.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling needs prefill_chunking 'fixed'"):
        EngineArgs(async_scheduling=True, prefill_chunking="adaptive").create_engine_config()


def test_num_scheduler_steps_from_flag_variable_or_keyword():
    for args in (parse_config(["--num-scheduler-steps", "8"], {}), parse_config([], {"VLLMLITE_NUM_SCHEDULER_STEPS": "8"}),
                 EngineArgs(num_scheduler_steps=8)):
        assert args.create_engine_config().scheduler.num_scheduler_steps == 8


def test_int_dot_from_flag_variable_or_keyword_and_off_by_default():
    for args in (parse_config(["--quantization", "int4", "--int-dot"], {}),
                 parse_config([], {"VLLMLITE_QUANTIZATION": "int4", "VLLMLITE_INT_DOT": "true"}),
                 EngineArgs(quantization="int4", int_dot=True)):
        config = args.create_engine_config()
        assert (config.weight_quantization, config.int_dot) == ("int4", True)
    from vllmlite.llm import LLM
    assert LLM(model="random", quantization="int4", int_dot=True).engine.config.int_dot is True
    assert parse_config(["--quantization", "int4"], {}).create_engine_config().int_dot is False
    assert parse_config(["--quantization", "int4", "--int-dot", "--no-int-dot"], {}).create_engine_config().int_dot is False


def test_int_dot_flag_without_quantization_is_a_usage_error_naming_the_knob(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--int-dot"], {})
    assert "int_dot multiplies quantized weights as integers" in capsys.readouterr().err


def test_device_cuda_computes_in_bfloat16_on_the_torch_kernels_from_flag_or_variable():
    for config in (parse_config(["--device", "cuda"], {}).create_engine_config(),
                   parse_config([], {"VLLMLITE_DEVICE": "cuda"}).create_engine_config()):
        assert (config.device, config.dtype, config.kernel_backend) == ("cuda", "bfloat16", "torch")
    config = parse_config(["--device", "cuda", "--dtype", "float32"], {}).create_engine_config()
    assert (config.dtype, config.load_dtype) == ("float32", "float32")
    with pytest.raises(ValueError, match="torch kernels"):
        EngineArgs(device="cuda", kernels="numba").create_engine_config()
    with pytest.raises(ValueError, match="device must be one of"):
        EngineArgs(device="tpu").create_engine_config()


def test_a_flag_wins_over_its_variable_which_wins_over_the_default():
    environ = {"VLLMLITE_BLOCK_SIZE": "8", "VLLMLITE_MAX_NUM_SEQS": "5", "VLLMLITE_ENFORCE_EAGER": "true"}
    args = parse_config(["--block-size", "32", "--no-enforce-eager"], environ)
    assert (args.block_size, args.max_num_seqs, args.enforce_eager) == (32, 5, False)
    assert args.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens


@pytest.mark.parametrize("argv, environ, message", [
    (["--tensor-parallel-size", "2"], {}, "tensor_parallel_size must be 1"),
    (["--gpu-memory-utilization", "1.5"], {}, "gpu_memory_utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1G"], {}, "give one"),
    (["--kv-cache-memory", "lots"], {}, "is not a byte size"),
    ([], {"VLLMLITE_ALLOWED_ORIGINS": "*"}, "VLLMLITE_ALLOWED_ORIGINS='*'"),
    (["--allowed-origins", '{"a": 1}'], {}, "not a JSON list of strings"),
    (["--tokenizer", "other/tokenizer"], {}, "tokenizer must be unset or the model"),
])
def test_bad_cli_input_is_a_usage_error_naming_the_knob(argv, environ, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv, environ)
    assert message in capsys.readouterr().err


def test_cors_lists_parse_from_json():
    args = parse_config(["--allowed-origins", '["http://a.example"]', "--allow-credentials"],
                        {"VLLMLITE_ALLOWED_METHODS": '["GET", "POST"]'})
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) \
        == (("http://a.example",), ("GET", "POST"), ("*",), True)


# --- vLLM's knobs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, resolved", [("auto", "float32"), ("float", "float32"), ("float32", "float32"),
                                             ("float64", "float64"), ("bfloat16", "float32"),
                                             ("float16", "float32"), ("half", "float32")])
def test_dtype_names_map_to_the_computed_dtype(dtype, resolved, caplog):
    with caplog.at_level(logging.INFO, logger="vllmlite.engine_args"):
        assert EngineArgs(dtype=dtype).create_engine_config().dtype == resolved
    half = dtype in ("bfloat16", "float16", "half")
    assert any(r.levelno == logging.WARNING and "computes in float32" in r.message for r in caplog.records) == half


@pytest.mark.parametrize("values, message", [
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": 0.5, "kv_cache_memory": 1 << 20}, "kv_cache_memory and gpu_memory_utilization"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype must be one of"),
    ({"cpu_offload_gb": -1}, "cpu_offload_gb must be >= 0"),
    ({"tokenizer": "gpt2"}, "tokenizer must be unset or the model"),
    ({"block_size": 0}, "block_size must be an integer"),
    ({"trace_ring_size": -1}, "trace_ring_size must be >= 0"),
    ({"trace_max_events": 0}, "trace_max_events must be >= 1"),
    ({"prefill_chunking": "greedy"}, "prefill_chunking must be one of"),
    ({"target_tpot_ms": 0}, "target_tpot_ms must be > 0"),
    ({"async_scheduling": "yes"}, "async_scheduling must be True or False, got 'yes'"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),
    ({"enforce_eager": 1}, "enforce_eager must be True or False, got 1"),
])
def test_impossible_values_are_a_value_error_naming_the_knob(values, message):
    with pytest.raises(ValueError) as error:
        EngineArgs(**values).create_engine_config()
    assert message in str(error.value)


def test_gpu_memory_utilization_is_a_fraction_of_the_available_ram(monkeypatch):
    monkeypatch.setattr(engine_args_module, "available_memory_bytes", lambda: 8 << 30)
    assert EngineArgs(gpu_memory_utilization=0.25).create_engine_config().cache.kv_cache_memory == 2 << 30
    assert EngineArgs(gpu_memory_utilization=1).create_engine_config().cache.kv_cache_memory == 8 << 30
    assert EngineArgs().create_engine_config().cache.kv_cache_memory is None  # the engine's default budget


def test_available_memory_is_some_positive_number_of_bytes():
    assert engine_args_module.available_memory_bytes() > 1 << 20


def test_gpu_only_knobs_are_logged_as_ignored_only_when_set(caplog):
    with caplog.at_level(logging.INFO, logger="vllmlite.engine_args"):
        EngineArgs(enforce_eager=True, cpu_offload_gb=4, trust_remote_code=True).create_engine_config()
        EngineArgs(enforce_eager=False).create_engine_config()
    assert sorted(r.message.split(":")[0] for r in caplog.records) == [
        "ignoring cpu_offload_gb=4", "ignoring enforce_eager=True", "ignoring trust_remote_code=True"]


def test_the_tokenizer_may_name_the_model_itself(tmp_path):
    model = tmp_path / "model"
    args = EngineArgs(model=str(model), tokenizer=str(tmp_path / "." / "model"))
    assert args.create_engine_config().model == str(model)
