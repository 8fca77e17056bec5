"""The engine on a CUDA GPU (device="cuda", bfloat16, random weights) next to transformers' own
continuous batching on the same weights, in the same run.

    python -m bench.gpu                                   # all shapes, 256 requests (an H200: minutes)
    python -m bench.gpu --shapes qwen3-0.6b --num-requests 64 --skip-hf    # a quick look
    python -m bench.gpu --device cpu --shapes tiny --num-requests 32 --output-len 32 --out /tmp/smoke.json
                                                          # a CPU smoke of the offline and HTTP rows only

For each model shape (Llama-architecture random weights at the sizes of Qwen3-0.6B, Llama-3.2-1B
and Llama-3.1-8B; one set of weights, made by transformers and copied into ours):
  offline   nano-vllm's workload: N requests, prompts of 100-1024 random tokens, `--output-len` tokens
            each (ignore_eos), output tokens/s; transformers' `generate_batch` (paged SDPA) on the
            same prompts beside it
  decode    one greedy decode step's forward pass and device argmax at batch 1/32/256 (context 512,
            eager), next to the GEMM-only bound: the same matrix products replayed as one CUDA graph
  single    one request alone, decode tokens/s (first token to last; tokens/s over the whole request,
            prefill included, beside it), next to the memory-bandwidth bound (bytes of weights and KV
            read per token over the device's measured copy bandwidth) and transformers' `generate`
            with its static cache
  http      the offline workload as one burst of HTTP requests to the OpenAI server on the GPU, next to
            the offline run (the default GGUF cannot travel to the GPU machine, over its 64 MiB limit,
            so the served model is the shape's random one); its engine runs in an engine process of its
            own (the server's default on cuda), which builds the same weights itself (`shape_model`; its
            KV cache is sized around this process's copy, still on the GPU), or with --no-engine-process
            on a thread of the server's process
`--kv-cache-dtype fp8` runs ours on float8 K/V (half of bf16's bytes), and the offline run and the
decode steps at batch 1 and 256 once more on bf16 K/V beside it.
`--timeline DIR` records every engine step of the offline run and of the burst (in the engine process
too) and sums them up in the row: where a burst's time goes against the offline run's.
Raw results: results/bench_gpu.json (machine, command, every number). Run one shape per process
(`--shapes qwen3-0.6b`, ...): transformers' `generate_batch` keeps its cache after it returns, and
the next shape's engine finds the GPU full.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np
import torch

from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.config import ModelConfig
from vllmlite.engine.engine_process import ModelLoader
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine_args import EngineArgs
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.models.loader import LayerWeights, LoadedModel, ModelWeights, random_weights
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import ByteTokenizer

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied embeddings
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 64, 128256, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256, False),
    "tiny": (64, 128, 2, 4, 2, 16, 512, False),   # the CPU smoke's (--device cpu), not in the default run
}
DEFAULT_SHAPES = ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b")
BLOCK_SIZE = 16


def hf_model(shape: str):
    """transformers' LlamaForCausalLM at `shape`, randomly initialized, bf16 on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, inter, layers, heads, kv, head_dim, vocab, tied = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=4096, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


class WideByteTokenizer(ByteTokenizer):
    """The byte tokenizer over a random model's whole vocabulary, so the server can detokenize what
    random weights generate (the shapes' real tokenizers cannot travel): ids past the byte
    vocabulary read as printable ASCII (32 + t % 95), text as a real tokenizer's pieces mostly are.
    (They read as byte t % 256 until 2026-12-02: random weights' greedy output then repeated bytes
    that never close a UTF-8 character, and the incremental detokenizer, whose window moves only at
    a closed character, decoded a window as long as the output for every token: 1.8 s of the
    Qwen3-0.6B burst's 6.3 s on the H200's host, py-spy.)"""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def _token_bytes(self, token_id: int, skip_special: bool) -> bytes:
        if token_id < 258:
            return super()._token_bytes(token_id, skip_special)
        return bytes([32 + token_id % 95])


def model_config(shape: str) -> ModelConfig:
    hidden, inter, layers, heads, kv, head_dim, vocab, tied = SHAPES[shape]
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
                       tie_word_embeddings=tied)


def record_steps(path: Path | None) -> Callable[[], None]:
    """From now on, every LLMEngine.step() of this process appends a JSON line to `path`: its start
    (time.perf_counter: the system's monotonic clock, the same in every process), its seconds, its
    outputs and the requests running and waiting after it. Returns the undo. None: records nothing."""
    if path is None:
        return lambda: None
    original = LLMEngine.step

    def step(engine: LLMEngine) -> list:
        start = time.perf_counter()
        outputs = original(engine)
        line = {"start": start, "seconds": time.perf_counter() - start, "outputs": len(outputs),
                "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting)}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return outputs

    LLMEngine.step = step

    def undo() -> None:
        LLMEngine.step = original
    return undo


def step_summary(path: Path, start: float, end: float) -> dict:
    """What the steps recorded in `path` between `start` and `end` (perf_counter seconds) did: how many,
    their seconds in all, the time outside them (the engine's loop, its pipes, waiting for work), when
    the first began and the last ended, and when the first step ran with the most requests in the
    engine (running or waiting: a burst's intake done, unless some finished before), from `start`."""
    steps = [s for s in map(json.loads, path.read_text().splitlines()) if start <= s["start"] <= end]
    if not steps:
        return {"steps": 0}
    busy = sum(s["seconds"] for s in steps)
    last_end = steps[-1]["start"] + steps[-1]["seconds"]
    peak = max(steps, key=lambda s: s["running"] + s["waiting"])   # the first of the largest
    return {"steps": len(steps), "busy_s": busy, "outside_steps_s": last_end - steps[0]["start"] - busy,
            "first_step_s": steps[0]["start"] - start, "all_in_s": peak["start"] - start,
            "last_step_end_s": last_end - start, "span_s": end - start}


def shape_model_recording(shape: str, device: str, path: Path) -> LoadedModel:
    """shape_model's, in an engine process that records its steps to `path` (record_steps)."""
    record_steps(path)
    return shape_model(shape, device)


def shape_model(shape: str, device: str) -> LoadedModel:
    """The shape's random model as the runs serve it: on cuda transformers' weights in our layout (the
    same every time: seeded), on the CPU seeded numpy weights. A loader an engine process calls by name."""
    if device == "cuda":
        return our_model(hf_model(shape))
    config = model_config(shape)
    return LoadedModel(config, random_weights(config, np.dtype("float32"), 0), WideByteTokenizer(config.vocab_size),
                       "random")


def our_model(hf) -> LoadedModel:
    """The same weights in vllmlite's layout (fused QKV and gate/up), on the GPU already."""
    c, m = hf.config, hf.model
    config = ModelConfig(architecture="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
                         num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=500000.0, tie_word_embeddings=c.tie_word_embeddings)
    def fused(*linears) -> torch.Tensor:
        return torch.cat([linear.weight for linear in linears]).data

    layers = [LayerWeights(layer.input_layernorm.weight.data,
                           fused(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), None,
                           layer.self_attn.o_proj.weight.data, layer.post_attention_layernorm.weight.data,
                           fused(layer.mlp.gate_proj, layer.mlp.up_proj), layer.mlp.down_proj.weight.data)
              for layer in m.layers]
    embed = m.embed_tokens.weight.data
    lm_head = embed if c.tie_word_embeddings else hf.lm_head.weight.data
    return LoadedModel(config, ModelWeights(embed, layers, m.norm.weight.data, lm_head, None),
                       WideByteTokenizer(c.vocab_size), "random")


WARM_SEED = 100   # the warm-up's prompts: fresh_prompts(..., WARM_SEED)


def fresh_prompts(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths with other random ids, for a run after one on `prompts` in the same
    engine: the same ones would be found in the prefix cache, and their prefill skipped."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, len(p)).tolist() for p in prompts]


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """nano-vllm's bench: prompts of 100-1024 random token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(100, 1025))).tolist() for _ in range(num_requests)]


def engine_knobs(device: str, max_num_seqs: int, max_len: int, num_scheduler_steps: int = 1,
                 kv_cache_dtype: str = "auto", async_scheduling: bool = False) -> dict:
    """The engine's knobs in every run, offline and served (on the CPU the KV cache takes its default size)."""
    knobs = dict(model="random", device=device, max_num_seqs=max_num_seqs, max_model_len=max_len,
                 max_num_batched_tokens=8192, num_scheduler_steps=num_scheduler_steps, kv_cache_dtype=kv_cache_dtype,
                 async_scheduling=async_scheduling)
    if device == "cuda":
        return knobs | dict(dtype="bfloat16", gpu_memory_utilization=0.85)
    return knobs | dict(dtype="float32")


def make_engine(loaded: LoadedModel, max_num_seqs: int, max_len: int, num_scheduler_steps: int = 1,
                device: str = "cuda", kv_cache_dtype: str = "auto", async_scheduling: bool = False) -> LLMEngine:
    args = EngineArgs(**engine_knobs(device, max_num_seqs, max_len, num_scheduler_steps, kv_cache_dtype,
                                     async_scheduling))
    return LLMEngine(args.create_engine_config(), loaded)


def synchronize(engine: LLMEngine) -> None:
    """Wait for the device's queued work (on the CPU there is none)."""
    if engine.config.device == "cuda":
        torch.cuda.synchronize()


def run_ours(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str = "run",
             detokenize: bool = False) -> dict:
    """The workload offline; token ids only (as transformers' generate_batch gives them) unless `detokenize`.
    Also when the first token of any request came out (first_token_s after the start) and how many
    that request had then (tokens_at_first_token)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=detokenize)
    synchronize(engine)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    generated, steps, first = 0, 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first, tokens_at_first = time.perf_counter() - start, len(output.outputs[0].token_ids)
            if output.finished:
                generated += len(output.outputs[0].token_ids)
        steps += 1
    synchronize(engine)
    seconds = time.perf_counter() - start
    return {"output_tokens": generated, "seconds": seconds, "output_tok_s": generated / seconds, "steps": steps,
            "first_token_s": first, "tokens_at_first_token": tokens_at_first if first is not None else 0}


def run_hf(hf, prompts: list[list[int]], output_len: int) -> dict:
    from transformers.generation import GenerationConfig
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    hf.set_attn_implementation("paged|sdpa")
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {"output_tokens": generated, "seconds": seconds, "output_tok_s": generated / seconds}


def http_burst(model: LoadedModel | ModelLoader, prompts: list[list[int]], output_len: int, device: str = "cuda",
               num_scheduler_steps: int = 1, kv_cache_dtype: str = "auto", bursts: int = 1,
               async_scheduling: bool = False) -> dict:
    """The offline workload as a burst of HTTP requests: the OpenAI server (its app and uvicorn in this
    process, with the settings `python -m vllmlite.api.server` gives them) on an engine built as
    make_engine's, every request sent at once from a client in another process (/v1/completions with
    the prompt's token ids, greedy, ignore_eos, not streamed). `model` is the model itself, served by
    an engine thread in this process, or a loader (ModelLoader), which an engine process of its own
    calls to build it. The warm request and every burst after the first send fresh prompts
    (`fresh_prompts`)."""
    import multiprocessing
    import threading

    import uvicorn

    from vllmlite.api.app import build_app
    from vllmlite.api.cli import ServerArgs
    from vllmlite.api.server import uvicorn_config
    from vllmlite.engine.factory import make_async_engine, make_process_engine
    from vllmlite.utils.heap import freeze_startup_heap
    args = ServerArgs(**engine_knobs(device, 256, 1024 + output_len + 16, num_scheduler_steps, kv_cache_dtype,
                                     async_scheduling),
                      max_queue=4 * len(prompts), port=0, log_level="warning")
    in_process = isinstance(model, LoadedModel)
    engine = make_async_engine(args, model) if in_process else make_process_engine(args, model)
    # The server's own uvicorn settings (its guarded HTTP/1.1 protocol), on a free port.
    server = uvicorn.Server(uvicorn_config(build_app(engine, args), args))
    freeze_startup_heap()   # as the server's main does: a full collection then skips torch, transformers, the model
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    vocab = engine.tokenizer.vocab_size
    sets = [prompts] + [fresh_prompts(prompts, vocab, seed) for seed in range(1, bursts)]
    client = context.Process(target=burst_client, args=(f"http://127.0.0.1:{port}", sets, output_len, results,
                                                        fresh_prompts(prompts[:1], vocab, WARM_SEED)[0]))
    client.start()
    result = results.get(timeout=600)
    client.join()
    server.should_exit = True
    thread.join(timeout=60)
    engine.shutdown(timeout=10)
    return {**result, "engine_process": not in_process}


def burst_client(url: str, bursts: list[list[list[int]]], output_len: int, results, warm_prompt: list[int]) -> None:
    """After one warm request, send every prompt of each of `bursts` at once, one burst after the other;
    put the first burst's (tokens, seconds, tok/s) on `results`, with the later ones' under "repeats"."""
    import asyncio
    from urllib.parse import urlsplit

    address = urlsplit(url)

    async def one(prompt: list[int], max_tokens: int) -> int:
        status, body = await post_json(address.hostname, address.port, "/v1/completions", {
            "model": "random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body!r:.500}")
        return body["usage"]["completion_tokens"]

    async def burst(prompts: list[list[int]]) -> dict:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, output_len) for p in prompts))
        seconds = time.perf_counter() - start
        return {"output_tokens": sum(counts), "seconds": seconds, "output_tok_s": sum(counts) / seconds,
                "start": start, "end": start + seconds}   # perf_counter: the same clock as the server's

    async def run() -> dict:
        await one(warm_prompt, 4)
        first = await burst(bursts[0])
        return first | ({"repeats": [await burst(p) for p in bursts[1:]]} if len(bursts) > 1 else {})
    try:
        results.put(asyncio.run(run()))
    except Exception as error:   # reported, so the server side never waits on a dead client
        results.put({"error": repr(error)[:2000]})


async def post_json(host: str, port: int, path: str, body: dict) -> tuple[int, object]:
    """(status, decoded JSON) of one POST on a connection of its own (HTTP/1.1, closed after).

    The burst's load generator: its cost per request does not grow with the requests in flight.
    httpx's pool scans every connection whenever a response is closed; with 256 in flight that
    scan took 1.2 of the 3.2 s a stubbed burst measured (py-spy, on 2 EPYC cores), so the client,
    not the server, set the burst's pace."""
    import asyncio
    import json
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            payload = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            raise RuntimeError("a chunked response: this client reads Content-Length bodies only")
        else:
            payload = await reader.read()   # to the end of the connection
        return status, json.loads(payload)
    finally:
        writer.close()


def cuda_time(fn, reps: int = 20) -> float:
    """Median seconds of fn() by CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def decode_inputs(batch: int, context: int):
    """(metadata, input ids) of a decode step of `batch` sequences at `context` tokens, each in its own
    shuffled blocks."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    rng = np.random.default_rng(batch)
    ids = rng.permutation(batch * blocks_per_seq).reshape(batch, blocks_per_seq)
    return build_metadata([1] * batch, [context] * batch, ids.tolist(), BLOCK_SIZE), rng.integers(0, 1000, batch)


def decode_step(engine: LLMEngine, batch: int, context: int) -> dict:
    """One decode forward pass (each of `batch` sequences at `context` tokens) next to its GEMM-only
    bound replayed as a CUDA graph."""
    model, kv = engine.runner.model, engine.runner.kv_cache
    meta, input_ids = decode_inputs(batch, context)
    rows = np.arange(batch)

    def eager():     # the forward pass launched from Python and a device argmax
        meta.kernel_cache.clear()   # a new step: its index arrays are moved to the device again
        model.kernels.argmax(model.forward_logits(input_ids, meta, kv, rows))

    graphs = engine.runner.graphs

    def replayed():  # what the engine runs for a greedy decode step: the captured graph and a device argmax
        model.kernels.argmax(graphs.run(input_ids, meta))
    eager_step = cuda_time(eager)
    step = cuda_time(replayed) if graphs is not None else eager_step
    w, buf = model.weights, model.workspace(batch)
    logits = torch.empty((batch, w.lm_head.shape[0]), dtype=model.dtype, device="cuda")

    linear = model.kernels.linear   # the model's own products, on its own buffers

    def gemms():
        for layer in w.layers:
            linear(buf.hidden, layer.wqkv, buf.qkv)
            linear(buf.attn, layer.wo, buf.out)
            linear(buf.hidden, layer.w_gate_up, buf.gate_up)
            linear(buf.act, layer.w_down, buf.out)
        linear(buf.hidden, w.lm_head, logits)
    gemms()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemms()
    bound = cuda_time(graph.replay)
    return {"batch": batch, "context": context, "step_ms": step * 1e3, "eager_step_ms": eager_step * 1e3,
            "gemm_graph_ms": bound * 1e3, "ratio": step / bound}


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second."""
    src = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / cuda_time(lambda: dst.copy_(src))


SINGLE_PROMPT_LEN = 128


def single_prompt(vocab: int) -> list[int]:
    return workload(1, vocab, seed=7)[0][:SINGLE_PROMPT_LEN]


def single_stream(engine: LLMEngine, vocab: int, output_len: int, bandwidth: float) -> dict:
    """One request alone: tok_s over the whole request (its prompt's prefill included, as before
    2026-12-02), and decode_tok_s from its first token to its last (what the bound bounds: a decode
    reads the weights and the KV once a token); fraction_of_bound is decode_tok_s's."""
    prompt = single_prompt(vocab)
    run_ours(engine, [prompt], 8, "single-warm")
    result = run_ours(engine, [prompt], output_len, "single")
    decode_tok_s = (result["output_tokens"] - result["tokens_at_first_token"]) / (result["seconds"] - result["first_token_s"])
    weight_bytes = engine.weights_bytes
    kv_bytes = engine.kv_bytes_per_token * (len(prompt) + output_len / 2)   # the mean context's KV, as stored
    bound = bandwidth / (weight_bytes + kv_bytes)
    return {"tok_s": result["output_tok_s"], "decode_tok_s": decode_tok_s, "output_tokens": result["output_tokens"],
            "bandwidth_bound_tok_s": bound, "fraction_of_bound": decode_tok_s / bound}


def single_stream_hf(hf, vocab: int, output_len: int) -> dict:
    """transformers' own `generate` for the same one request, with its static cache, for at most 64
    tokens. transformers compiles the forward pass for a static cache by default, for the cache's
    length: the warm-up call generates as many tokens as the timed one, so the timed call reuses
    what it compiled. (Timed after generate_batch with a shorter warm-up, earlier runs measured 1-10
    tok/s; run 16, warmed so and before generate_batch, 264-292.)"""
    output_len = min(output_len, 64)
    hf.set_attn_implementation("sdpa")    # generate_batch may have left it on the paged one, which needs its cache
    ids = torch.tensor([single_prompt(vocab)], device="cuda")
    kwargs = dict(do_sample=False, cache_implementation="static", eos_token_id=None, pad_token_id=0)
    hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)    # warm: compiles
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    torch.cuda.synchronize()
    generated = out.shape[1] - ids.shape[1]
    return {"tok_s": generated / (time.perf_counter() - start), "output_tokens": int(generated)}


def bench_shape(shape: str, args, bandwidth: float, row: dict, save) -> dict:
    """Fill `row` with the shape's measurements, calling save() after each (a run cut short keeps
    what it measured). On the CPU (a smoke): the offline and HTTP rows only."""
    cuda = args.device == "cuda"
    hf = hf_model(shape) if cuda else None
    loaded = our_model(hf) if cuda else shape_model(shape, "cpu")
    vocab = loaded.config.vocab_size
    prompts = workload(args.num_requests, vocab)
    warm = fresh_prompts(prompts[:4], vocab, WARM_SEED)   # compiles the kernels; its prompts are not the run's
    row.update({"shape": shape, "device": args.device, "num_requests": len(prompts),
                "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len,
                "kv_cache_dtype": args.kv_cache_dtype})
    row["num_scheduler_steps"] = steps = args.num_scheduler_steps
    row["async_scheduling"] = ahead = args.async_scheduling
    max_len = 1024 + args.output_len + 16
    if cuda and ahead and not args.skip_sync:   # the same run with each step waited for before the next, beside
        engine = make_engine(loaded, max_num_seqs=256, max_len=max_len, num_scheduler_steps=steps,
                             kv_cache_dtype=args.kv_cache_dtype)
        run_ours(engine, warm, 4, "warm")
        row["ours_sync"] = run_ours(engine, prompts, args.output_len)
        row["single_sync"] = single_stream(engine, loaded.config.vocab_size, args.output_len, bandwidth)
        save()
        print(f"{shape}: ours without async scheduling {row['ours_sync']['output_tok_s']:.0f} out tok/s, "
              f"one stream {row['single_sync']['decode_tok_s']:.0f}", flush=True)
        del engine
        free_device_memory()
    if cuda and args.kv_cache_dtype != "auto" and not args.skip_auto_kv:   # the same run with the model's dtype's K/V
        engine = make_engine(loaded, max_num_seqs=256, max_len=max_len, num_scheduler_steps=steps)
        run_ours(engine, warm, 4, "warm")
        row["ours_auto_kv"] = run_ours(engine, prompts, args.output_len)
        row["decode_auto_kv"] = [decode_step(engine, b, 512) for b in (1, 256)]
        save()
        print(f"{shape}: ours with auto (bf16) K/V {row['ours_auto_kv']['output_tok_s']:.0f} out tok/s", flush=True)
        del engine
        free_device_memory()
    if cuda and steps > 1 and not args.skip_one_pass:   # the same run one pass a step, beside
        engine = make_engine(loaded, max_num_seqs=256, max_len=max_len, kv_cache_dtype=args.kv_cache_dtype)
        run_ours(engine, warm, 4, "warm")
        row["ours_one_pass_a_step"] = run_ours(engine, prompts, args.output_len)
        row["single_one_pass_a_step"] = single_stream(engine, loaded.config.vocab_size, args.output_len, bandwidth)
        save()
        print(f"{shape}: ours, one pass a step, {row['ours_one_pass_a_step']['output_tok_s']:.0f} out tok/s", flush=True)
        del engine
        free_device_memory()
    engine = make_engine(loaded, max_num_seqs=256, max_len=max_len, num_scheduler_steps=steps, device=args.device,
                         kv_cache_dtype=args.kv_cache_dtype, async_scheduling=ahead)
    run_ours(engine, warm, 4, "warm")
    offline_log = args.timeline / f"offline_{shape}.jsonl" if args.timeline else None
    undo = record_steps(offline_log)
    start = time.perf_counter()
    row["ours"] = run_ours(engine, prompts, args.output_len)
    undo()
    if offline_log:
        row["ours"]["timeline"] = step_summary(offline_log, start, time.perf_counter())
    save()
    print(f"{shape}: ours {row['ours']['output_tok_s']:.0f} out tok/s"
          + (f", steps {row['ours']['timeline']}" if "timeline" in row["ours"] else ""), flush=True)
    if args.repeat:   # again, on fresh prompts of the same lengths: the process's one-time costs paid
        row["ours_repeat"] = run_ours(engine, fresh_prompts(prompts, vocab, 1), args.output_len, "repeat")
        save()
        print(f"{shape}: ours again {row['ours_repeat']['output_tok_s']:.0f} out tok/s", flush=True)
    if args.offline_text:   # the same run with the text the server must produce (detokenized)
        row["ours_with_text"] = run_ours(engine, fresh_prompts(prompts, vocab, 2), args.output_len, "text",
                                         detokenize=True)
        save()
        print(f"{shape}: ours with text {row['ours_with_text']['output_tok_s']:.0f} out tok/s", flush=True)
    if cuda:
        row["decode"] = [decode_step(engine, b, 512) for b in (1, 32, 256)]
        row["single"] = single_stream(engine, loaded.config.vocab_size, args.output_len, bandwidth)
        save()
    del engine
    free_device_memory()   # the engine's CUDA graphs and KV cache go before the next one needs the memory
    if not args.skip_http:
        http_log = args.timeline / f"http_{shape}.jsonl" if args.timeline else None
        if args.engine_process:
            served = partial(shape_model_recording, shape, args.device, http_log) if http_log else \
                partial(shape_model, shape, args.device)
            undo = lambda: None  # noqa: E731
        else:
            served, undo = loaded, record_steps(http_log)
        row["http"] = http_burst(served, prompts, args.output_len, args.device, num_scheduler_steps=steps,
                                 kv_cache_dtype=args.kv_cache_dtype, bursts=2 if args.repeat else 1,
                                 async_scheduling=ahead)
        undo()
        if http_log and "start" in row["http"]:
            row["http"]["timeline"] = step_summary(http_log, row["http"]["start"], row["http"]["end"])
        if "error" not in row["http"]:
            row["http"]["fraction_of_offline"] = row["http"]["output_tok_s"] / row["ours"]["output_tok_s"]
            if "ours_with_text" in row:
                row["http"]["fraction_of_offline_with_text"] = \
                    row["http"]["output_tok_s"] / row["ours_with_text"]["output_tok_s"]
            if "repeats" in row["http"]:   # the second burst against the second offline run
                row["http"]["fraction_of_offline_repeat"] = \
                    row["http"]["repeats"][-1]["output_tok_s"] / row["ours_repeat"]["output_tok_s"]
        save()
        print(f"{shape}: HTTP burst {row['http']}", flush=True)
        free_device_memory()
    if cuda and not args.skip_hf:   # one stream first, on a model generate_batch has not touched yet
        try:
            row["single_transformers_static"] = single_stream_hf(hf, loaded.config.vocab_size, args.output_len)
            print(f"{shape}: transformers static-cache one stream "
                  f"{row['single_transformers_static']['tok_s']:.0f} tok/s", flush=True)
        except Exception as error:
            row["single_transformers_error"] = repr(error)[:2000]
        save()
    if cuda and not (args.skip_hf or args.skip_hf_batch):
        try:
            row["transformers"] = run_hf(hf, prompts, args.output_len)
        except Exception as error:  # recorded, not fatal: our own rows still count
            row["transformers_error"] = repr(error)[:2000]
            print(f"{shape}: transformers failed: {error!r}", flush=True)
        else:
            row["ratio_vs_transformers"] = row["ours"]["output_tok_s"] / row["transformers"]["output_tok_s"]
            print(f"{shape}: transformers {row['transformers']['output_tok_s']:.0f} out tok/s", flush=True)
        save()
    del hf, loaded
    free_device_memory()
    return row


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile(shape: str, batch: int, out_dir: Path) -> None:
    """Where a decode step's time goes: cProfile of engine.step() and torch.profiler's table, written
    to out_dir (a look, not a result)."""
    import cProfile
    import pstats
    hf = hf_model(shape)
    engine = make_engine(our_model(hf), max_num_seqs=batch, max_len=2048)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(workload(batch, engine.model_config.vocab_size)):
        engine.add_request(f"p{i}", prompt[:200], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    with open(out_dir / "step_cprofile.txt", "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    (out_dir / "step_torch_profile.txt").write_text(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n"
        + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke of the offline and HTTP rows only (try --shapes tiny)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="multi-step decoding's passes per step for our runs (offline, single, HTTP); "
                             "above 1 the offline and single runs are also made with one pass a step")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="our runs with async scheduling (the next decode step queued while one runs); the "
                             "offline and single runs are also made without it, beside")
    parser.add_argument("--skip-sync", action="store_true",
                        help="with --async-scheduling, leave out the runs without it")
    parser.add_argument("--skip-one-pass", action="store_true",
                        help="leave out the one-pass-a-step runs beside multi-step decoding")
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers (generate_batch and one stream)")
    parser.add_argument("--skip-hf-batch", action="store_true",
                        help="leave out transformers' generate_batch only (its one stream still runs)")
    parser.add_argument("--skip-http", action="store_true", help="leave out the HTTP server's burst")
    parser.add_argument("--repeat", action="store_true",
                        help="run the offline workload and the HTTP burst twice each (the second time on fresh "
                             "prompts of the same lengths) and compare the second runs too")
    parser.add_argument("--timeline", type=Path,
                        help="a folder: every engine step of the offline run and of the HTTP burst (in the engine "
                             "process or thread) as JSON lines there, summed up in the row (steps, their seconds, "
                             "the time outside them, when the first began)")
    parser.add_argument("--offline-text", action="store_true",
                        help="also run the offline workload detokenized, as the server must (the offline "
                             "rate is token ids only, as transformers' generate_batch gives)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="our engines' K/V storage (auto: bf16, the model's dtype); with fp8 the offline run "
                             "and two decode steps are also made with auto K/V, beside")
    parser.add_argument("--skip-auto-kv", action="store_true",
                        help="with --kv-cache-dtype fp8, leave out the runs with auto K/V")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="serve the HTTP burst from an engine process of its own, as the server does on "
                             "cuda by default (no: from an engine thread in the server's process)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_gpu.json")
    parser.add_argument("--profile", type=Path, help="only profile decode steps (batch 256), writing here")
    args = parser.parse_args()
    if args.timeline:
        args.timeline.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile(args.shapes.split(",")[0], 256, args.profile)
        return
    cuda = args.device == "cuda"
    bandwidth = copy_bandwidth() if cuda else 0.0
    report = {"what": __doc__.split("\n")[0], "command": module_command("bench.gpu"), "machine": machine_info(),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": []}
    for shape in args.shapes.split(","):
        row: dict = {}
        report["rows"].append(row)
        bench_shape(shape, args, bandwidth, row, lambda: write_json(args.out, report))
    for row in report["rows"]:
        print(summary_line(row))


def summary_line(row: dict) -> str:
    hf = row.get("transformers", {}).get("output_tok_s")
    line = f"{row['shape']:>14}: ours {row['ours']['output_tok_s']:8.0f} tok/s"
    if "ours_sync" in row:
        line += (f" (async scheduling; without: {row['ours_sync']['output_tok_s']:.0f}, one stream "
                 f"{row['single_sync']['decode_tok_s']:.0f})")
    if hf:
        line += f", transformers {hf:8.0f}, x{row['ratio_vs_transformers']:.1f}"
    if "decode" in row:
        line += "; decode step/GEMM-graph " + " ".join(f"b{d['batch']} {d['step_ms']:.2f}/{d['gemm_graph_ms']:.2f} ms"
                                                       for d in row["decode"])
    if "single" in row:
        line += (f"; single {row['single']['tok_s']:.0f} tok/s, decode {row['single']['decode_tok_s']:.0f} tok/s = "
                 f"{row['single']['fraction_of_bound']:.0%} of bound")
    if "single_transformers_static" in row:
        line += f" (transformers static {row['single_transformers_static']['tok_s']:.0f})"
    if "fraction_of_offline" in row.get("http", {}):
        where = "an engine process" if row["http"].get("engine_process") else "an engine thread"
        line += f"; HTTP {row['http']['fraction_of_offline']:.0%} of offline ({where})"
        if "fraction_of_offline_repeat" in row["http"]:
            line += f", repeated {row['http']['fraction_of_offline_repeat']:.0%}"
    return line


if __name__ == "__main__":
    main()
