"""The engine process and its front end (engine_process.py, process_client.py) without a server: a
start-up failure surfaces as the child's own message, a loader builds the model in the child, a request
the engine refuses fails its stream alone, a long silence trips the heartbeat, and neither a shutdown
nor the parent's death leaves the process behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
from paths import REPO_ROOT
from server_util import is_running, server_config, wait_until

from vllmlite.engine.exceptions import EngineStartError
from vllmlite.engine.factory import make_process_engine
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.models.loader import LoadedModel, load_model
from vllmlite.sampling_params import SamplingParams


def named_random_model(source: str) -> LoadedModel:
    """The tiny random model under another name (a loader the engine process calls by name)."""
    loaded = load_model("random", "float64", 0)
    loaded.source = source
    return loaded


def killed_while_loading() -> LoadedModel:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def slow_read(engine, seconds: float) -> int:
    time.sleep(seconds)
    return engine.num_unfinished_requests


def frozen_objects(engine) -> int:
    return gc.get_freeze_count()


def test_the_engine_process_freezes_its_startup_heap():
    """The engine process's torch, model and block pool stay out of the collector's full collections,
    which would otherwise stall a step (utils/heap.py)."""
    engine = make_process_engine(server_config(num_blocks=64), loader=partial(named_random_model, "frozen"))

    async def read() -> int:
        engine.start()
        return await engine.run_between_steps(frozen_objects)
    try:
        assert asyncio.run(read()) > 10_000
    finally:
        engine.shutdown(timeout=0)


def test_a_bad_model_path_fails_the_start_with_the_engine_processs_message():
    with pytest.raises(EngineStartError, match="the engine process failed to start: .*no-such-model"):
        make_process_engine(server_config(model="/nonexistent/no-such-model.gguf"))


def test_an_engine_process_that_dies_while_loading_fails_the_start():
    with pytest.raises(EngineStartError, match="was killed by SIGKILL .* before its engine was ready"):
        make_process_engine(server_config(), loader=killed_while_loading)


def test_a_loader_builds_the_model_and_shutdown_leaves_no_process():
    engine = make_process_engine(server_config(num_blocks=64, heartbeat_timeout=0.3),
                                 loader=partial(named_random_model, "from-the-loader"))
    pid = engine.pid
    assert engine.summary().model_source == "from-the-loader" and engine.max_model_len == 4096
    assert pid != os.getpid() and is_running(pid)

    async def scenario() -> tuple[list, BaseException, str | None, int]:
        engine.start()
        good = engine.add_request(GenerateRequest("good", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
        bad = engine.add_request(GenerateRequest("bad", [1, 9999], SamplingParams(max_tokens=5)))
        outputs = [output async for output in good]
        with pytest.raises(ValueError) as refused:  # the engine process's own check, not the front end's
            async for _ in bad:
                pass
        # A read that holds the engine process for a second: past the heartbeat, then healthy again.
        read = asyncio.ensure_future(engine.run_between_steps(partial(slow_read, seconds=1.0)))
        await asyncio.sleep(0.6)
        silent = engine.health_error
        return outputs, refused.value, silent, await read

    outputs, refused, silent, value = asyncio.run(scenario())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
    assert "prompt token ids must be integers in [0, 258)" in str(refused)
    assert silent is not None and "unresponsive" in silent
    assert value == 0 and engine.health_error is None
    engine.shutdown(timeout=0)
    assert not engine.is_running and not is_running(pid)


def test_the_engine_process_exits_when_its_parent_is_killed():
    script = ("from vllmlite.api.cli import ServerArgs\n"
              "from vllmlite.engine.factory import make_process_engine\n"
              "engine = make_process_engine(ServerArgs(model='random', dtype='float64', num_blocks=64))\n"
              "print(engine.pid, flush=True)\n"
              "import time; time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        child = int(parent.stdout.readline())
        assert is_running(child)
        parent.kill()
        parent.wait(timeout=30)
        assert wait_until(lambda: not is_running(child), 10), "the engine process outlived its parent"
    finally:
        parent.kill()
        parent.stdout.close()
