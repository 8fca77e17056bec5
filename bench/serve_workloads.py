"""The serving benchmark's workloads, built from the offline benchmark's generator (`workload.py`)
as token-id prompts, so every server sees exactly the same prompt tokens.

Owns the three workload shapes and the tokenizer lookup; loads no weights and sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serve_client import BenchPrompt
from workload import BenchRequest, LengthRange, WorkloadSpec, make_requests, system_prompt_tokens, with_system_prompt

from vllmlite.config import ceil_div
from vllmlite.model_source import RANDOM_MODEL, resolve_model
from vllmlite.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, read_gguf_fields

BASE, SHARED_PREFIX, LONG_MIX = "base", "shared_prefix", "long_mix"
WORKLOADS = (BASE, SHARED_PREFIX, LONG_MIX)
LONG_EVERY = 3  # in the long-prompt mix, every third request gets a long prompt


@dataclass(frozen=True)
class Lengths:
    """Length ranges of one benchmark size (full or --quick)."""

    prompts: LengthRange
    outputs: LengthRange
    long_prompts: LengthRange
    system_prompt_len: int


FULL = Lengths(LengthRange(17, 251), LengthRange(20, 192), LengthRange(512, 1536), 256)
QUICK = Lengths(LengthRange(8, 48), LengthRange(8, 24), LengthRange(64, 128), 32)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[BenchPrompt]
    max_model_len: int  # the longest request the ranges allow (prompt + output), in whole 16-token blocks

    @property
    def description(self) -> str:
        return {BASE: "the offline benchmark's lognormal set (bench/bench.py)",
                SHARED_PREFIX: "the same prompts behind one shared system prompt",
                LONG_MIX: f"the base set with every {LONG_EVERY}rd prompt replaced by a long one"}[self.name]


def load_tokenizer(model: str) -> tuple[Tokenizer, str]:
    """The tokenizer of `model` without its weights, and the resolved source (a GGUF path, a
    directory or "random")."""
    source = resolve_model(model)
    if source == RANDOM_MODEL:
        return ByteTokenizer(), source
    if Path(source).is_dir():
        return HFTokenizer.from_directory(source), source
    import gguf
    return HFTokenizer.from_gguf_fields(read_gguf_fields(gguf.GGUFReader(source), prefix="")), source


def _round_to_blocks(num_tokens: int, block_size: int = 16) -> int:
    return ceil_div(num_tokens, block_size) * block_size


def build_workload(name: str, tokenizer: Tokenizer, num_requests: int, lengths: Lengths, seed: int) -> Workload:
    """`base`: the offline benchmark's requests (same seed, same lengths, same prompts);
    `shared_prefix`: those behind one system prompt; `long_mix`: every third prompt long."""
    spec = WorkloadSpec(num_requests, lengths.prompts, lengths.outputs, lengths.system_prompt_len, seed)
    base = make_requests(tokenizer, spec)
    longest_prompt = lengths.prompts.high
    if name == SHARED_PREFIX:
        base = with_system_prompt(base, system_prompt_tokens(tokenizer, lengths.system_prompt_len))
        longest_prompt += lengths.system_prompt_len
    elif name == LONG_MIX:
        longs = make_requests(tokenizer, WorkloadSpec(num_requests, lengths.long_prompts, lengths.outputs, 0, seed + 1))
        base = [BenchRequest(r.request_id, (longs[i] if i % LONG_EVERY == LONG_EVERY - 1 else r).prompt_token_ids,
                             r.max_tokens) for i, r in enumerate(base)]
        longest_prompt = lengths.long_prompts.high
    elif name != BASE:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    prompts = [BenchPrompt(r.request_id, list(r.prompt_token_ids), r.max_tokens) for r in base]
    return Workload(name, prompts, _round_to_blocks(longest_prompt + lengths.outputs.high))
