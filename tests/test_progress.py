"""Progress bars (tqdm) where a person waits: shown on a terminal, silent in logs and pipes."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from bench.report import ProgressBar
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import load_model


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_model_warm_up_shows_a_bar_on_a_terminal_only(tiny_model, monkeypatch):
    model = DecoderModel(tiny_model.config, tiny_model.weights, 64)
    for stream, shows in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        model.warm_up()
        assert ("Warming up kernels" in stream.getvalue()) is shows
        assert ("4/4" in stream.getvalue()) is shows


@pytest.mark.parametrize("kernels, compiles", [("numba", True), ("numpy", False)])
def test_the_engine_says_it_compiles_kernels_before_it_waits_for_them(make_engine, caplog, kernels, compiles):
    """A log line, not a bar: it shows in a server's log and a pipe too, before the first start's
    silent compilation (numpy has nothing to compile)."""
    with caplog.at_level(logging.INFO, logger="vllmlite.engine.llm_engine"):
        make_engine(kernels=kernels)
    messages = [r.getMessage() for r in caplog.records]
    ready = next(i for i, m in enumerate(messages) if "ready in" in m)
    compiling = [i for i, m in enumerate(messages) if "compiling kernels" in m]
    assert compiling == ([ready - 1] if compiles else [])


@pytest.mark.real_model
def test_loading_the_default_gguf_shows_its_layers(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    loaded = load_model("default", "float32", 0)
    shown = terminal.getvalue()
    assert f"Loading {loaded.source.rsplit('/', 1)[-1]}" in shown
    assert f"{loaded.config.num_layers}/{loaded.config.num_layers}" in shown


def test_the_benchmarks_bar_counts_requests_and_errors(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = ProgressBar(4, "burst")
    for is_error in (False, True, False, False):
        bar.advance(is_error)
    bar.close()
    assert "burst" in terminal.getvalue() and "4/4" in terminal.getvalue() and "errors=1" in terminal.getvalue()
