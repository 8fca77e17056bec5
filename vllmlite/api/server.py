"""The server process: the CLI `main()`, uvicorn, and the lifecycle (SIGINT/SIGTERM drain the engine,
then exit 0). Run it: `python -m vllmlite.api.server --help`.

Owns choosing the engine (in this process, in a process of its own with --engine-process, or Ray
replicas for --num-replicas > 1 or --ray-address), the start-up log and the signal handling. The app
and its routes are app.py's.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI

from vllmlite.api.app import build_app
from vllmlite.api.cli import ServerArgs, parse_config
from vllmlite.api.http_protocol import REFUSAL_SLOTS, guarded_protocol
from vllmlite.engine.client import EngineClient
from vllmlite.engine.factory import make_async_engine, make_process_engine
from vllmlite.utils.heap import freeze_startup_heap

logger = logging.getLogger("vllmlite.api.server")
FD_HEADROOM = 256  # files besides connections: the listening socket, model files, pipes, the engine's


class GracefulServer(uvicorn.Server):
    """uvicorn whose SIGINT/SIGTERM first drains the engine: new requests get 503, in-flight ones
    have `shutdown_timeout` seconds to finish, the rest are aborted; then the process exits 0.
    A second signal exits at once, with status 128 + the signal's number (as a shell reports a
    process the signal killed)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._drain_started = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_started:
            # Out now: letting uvicorn cancel the tasks in flight would log each one's traceback.
            logger.warning("signal %d again: exiting at once, without draining", sig)
            logging.shutdown()
            os._exit(128 + sig)
        self._drain_started = True
        logger.info("signal %d: draining (up to %.1f s for in-flight requests)", sig, self.shutdown_timeout)
        self.engine.begin_draining()
        threading.Thread(target=self._drain, name="vllmlite-drain", daemon=True).start()

    def _drain(self) -> None:
        self.engine.shutdown(self.shutdown_timeout)
        self.should_exit = True


def _log_startup(engine: EngineClient, config: ServerArgs) -> None:
    """The model, its memory (one replica's, behind the Ray ingress) and where the API listens."""
    summary = engine.summary()
    report = summary.memory
    logger.info("model %s (%s) served as %r, dtype %s, context %d tokens", config.model,
                summary.model_source, config.model_name, summary.dtype, summary.max_model_len)
    logger.info("memory: weights %.1f MiB, KV cache %.1f MiB (%d blocks of %d tokens, kv_cache_dtype %s, "
                "%d bytes per token), host swap %.1f MiB", report["weights"] / 2**20, report["kv_cache"] / 2**20,
                report["kv_blocks"], report["block_size"], getattr(config, "kv_cache_dtype", "auto"),
                report.get("kv_bytes_per_token", 0), report["host_swap"] / 2**20)
    logger.info("OpenAI-compatible API at http://%s:%d/v1%s", config.host, config.port,
                " (API key required)" if config.api_key else "")


def _reserve_file_descriptors(needed: int) -> None:
    """Raise the soft limit on open files to `needed` if the hard limit allows (a default of 1,024 is
    common): at the connection limit, accepting would otherwise fail with EMFILE and stall."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < needed:
            logger.warning("open files are limited to %d (ulimit -n), fewer than the %d that --limit-concurrency "
                           "needs: lower --limit-concurrency or raise the limit", raised, needed)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _reserve_file_descriptors(config.limit_concurrency + REFUSAL_SLOTS + FD_HEADROOM)
    if config.uses_ray:  # Ray is an optional extra: imported only here
        from vllmlite.api.ray.serving import add_replica_routes, launch_replicas
        engine = launch_replicas(config)
        _log_startup(engine, config)
        app = build_app(engine, config)
        add_replica_routes(app, engine)
    else:
        engine = make_process_engine(config) if config.uses_engine_process else make_async_engine(config)
        _log_startup(engine, config)
        app = build_app(engine, config)
    freeze_startup_heap()
    GracefulServer(uvicorn_config(app, config), engine, config.shutdown_timeout).run()


def uvicorn_config(app: FastAPI, config: ServerArgs) -> uvicorn.Config:
    """uvicorn for `app`, with what its HTTP/1.1 protocol lacks (http_protocol.py)."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          timeout_graceful_shutdown=5, lifespan="on",
                          http=guarded_protocol(config.header_timeout, config.limit_concurrency))


if __name__ == "__main__":
    main()
