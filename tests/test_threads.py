"""Start-up settings: the thread pools' environment (set when vllmlite comes before numpy, a warning
when it cannot be) and the scheduler defaults every entry point shares."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENGINE = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
          "from vllmlite import LLMEngine\n"
          "from vllmlite.config import EngineConfig\n"
          "from vllmlite.threads import THREAD_ENV_APPLIED\n"
          "import os\n"
          "LLMEngine(EngineConfig(model='random', dtype='float64'))\n"
          "print('applied', THREAD_ENV_APPLIED, os.environ['OPENBLAS_THREAD_TIMEOUT'])\n")


@pytest.mark.parametrize("numpy_first", [False, True])
def test_engine_warns_only_when_numpy_was_imported_first(numpy_first):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY")}
    code = ("import numpy\n" if numpy_first else "import vllmlite\n") + ENGINE
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"applied {not numpy_first} 4" in result.stdout
    assert ("numpy was imported before vllmlite" in result.stderr) == numpy_first


def test_every_entry_point_starts_from_the_engines_scheduler_defaults():
    """The server and the LLM class build EngineArgs, whose defaults are the engine's own
    (the scheduler's were chosen by the sweep)."""
    from vllmlite.api.cli import ServerArgs, parse_config
    from vllmlite.config import EngineConfig, SchedulerConfig
    from vllmlite.engine_args import EngineArgs
    from vllmlite.llm import LLM
    for config in (EngineArgs().create_engine_config(), ServerArgs().create_engine_config(),
                   parse_config([], {}).create_engine_config()):
        assert config == EngineConfig() and config.scheduler == SchedulerConfig()
    assert LLM("random").engine.config == EngineConfig(model="random")
