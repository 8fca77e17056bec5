"""The model runner: owns the KV tensors, flattens a SchedulerOutput into one batch, runs the
forward pass and samples. It reads requests but never changes scheduler state.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from vllmlite.attention import build_metadata
from vllmlite.batch import RunnerOutput, SchedulerOutput
from vllmlite.model import LlamaModel
from vllmlite.sampling import Sampler, SamplingBatch, compute_logprobs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_host_blocks: int,
                 stop_token_ids: frozenset[int]) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        self.stop_token_ids = stop_token_ids
        self.sampler = Sampler()
        shape = (num_blocks * block_size, c.num_kv_heads, c.head_dim)
        # np.zeros maps pages lazily, so an unused part of a large budget costs no RAM.
        self.kv_cache = [(np.zeros(shape, model.dtype), np.zeros(shape, model.dtype))
                         for _ in range(c.num_layers)]       # per layer: [slots, kv_heads, head_dim]
        host_shape = (num_host_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.host_cache = [(np.zeros(host_shape, model.dtype), np.zeros(host_shape, model.dtype))
                           for _ in range(c.num_layers)] if num_host_blocks else []
        self.num_forward_passes = 0
        # Test-only: called with each step's SchedulerOutput before the forward pass.
        self.fault_hook: Optional[Callable[[SchedulerOutput], None]] = None

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_cache)

    @property
    def host_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.host_cache)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply block copies, run one forward pass over every scheduled token, sample."""
        self._copy_blocks(out)
        if not out.scheduled:
            return RunnerOutput()
        if self.fault_hook is not None:
            self.fault_hook(out)
        seqs = out.scheduled
        input_ids = np.array([t for s in seqs for t in s.token_ids], dtype=np.int64)  # [num_tokens]
        positions = np.concatenate([np.arange(s.start_position, s.seq_len) for s in seqs])
        meta = build_metadata([len(s.token_ids) for s in seqs], [s.seq_len for s in seqs],
                              [s.block_table for s in seqs], self.block_size)
        # The last row of each sequence that samples; forks of one parent share that row.
        ends = np.cumsum([len(s.token_ids) for s in seqs]) - 1                        # [num_seqs]
        sampling = [(i, r) for i, s in enumerate(seqs) for r in s.samplers]
        sample_rows = np.array([ends[i] for i, _ in sampling], dtype=np.int64)        # [num_samples]
        prompt_rows, prompt_next, prompt_owners = _prompt_logprob_rows(seqs, ends)
        rows = np.concatenate([sample_rows, prompt_rows])
        unique_rows, inverse = np.unique(rows, return_inverse=True)
        logits = self.model.forward(input_ids, positions, meta, self.kv_cache, unique_rows)
        self.num_forward_passes += 1
        result = RunnerOutput()
        if prompt_owners:
            self._prompt_logprobs(logits[inverse[len(sample_rows):]], prompt_next, prompt_owners, result)
        if not sampling:
            return result
        requests = [r for _, r in sampling]
        batch = SamplingBatch(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            stop_token_ids=self.stop_token_ids,
        )
        sampled = self.sampler(logits[inverse[:len(sample_rows)]], batch)             # [num_samples]
        for j, request in enumerate(requests):
            result.sampled_token_ids[request.request_id] = [int(sampled.token_ids[j])]
            if sampled.logprobs[j] is not None:
                result.logprobs[request.request_id] = [sampled.logprobs[j]]
        return result

    @staticmethod
    def _prompt_logprobs(logits: np.ndarray, next_ids: np.ndarray, owners: list, result: RunnerOutput) -> None:
        """Logprob of each next prompt token under the logits one position before it."""
        top = [r.sampling_params.prompt_logprobs for r in owners]
        for request, entry in zip(owners, compute_logprobs(logits, next_ids, top)):
            result.prompt_logprobs.setdefault(request.request_id, []).append(entry)

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        """Swap-out first (its device blocks may be reused below), then swap-in, then copy-on-write."""
        for pairs, src_of, dst_of in ((out.blocks_to_swap_out, self.kv_cache, self.host_cache),
                                      (out.blocks_to_swap_in, self.host_cache, self.kv_cache),
                                      (out.blocks_to_copy, self.kv_cache, self.kv_cache)):
            if not pairs:
                continue
            src = self._slots([p[0] for p in pairs])
            dst = self._slots([p[1] for p in pairs])
            for (src_k, src_v), (dst_k, dst_v) in zip(src_of, dst_of):
                dst_k[dst] = src_k[src]
                dst_v[dst] = src_v[src]

    def _slots(self, block_ids: list[int]) -> np.ndarray:
        """Every slot of the given blocks: [2, 5] with block_size 2 -> [4, 5, 10, 11]."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return (ids[:, None] * self.block_size + np.arange(self.block_size)[None, :]).reshape(-1)


def _prompt_logprob_rows(seqs: list, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """Rows whose logits score the next prompt token, for requests that asked for prompt logprobs.

    Position p predicts token p + 1; positions already scored (before a preemption) are skipped.
    Example: prompt of 5 tokens computed in one chunk -> positions 0..3 score tokens 1..4.
    """
    rows, next_ids, owners = [], [], []
    for seq, end in zip(seqs, ends):
        request = seq.request
        if request.sampling_params.prompt_logprobs is None:
            continue
        first_row = end - len(seq.token_ids) + 1
        start = max(seq.start_position, len(request.prompt_logprobs))
        for position in range(start, min(seq.seq_len, request.num_prompt_tokens - 1)):
            rows.append(first_row + position - seq.start_position)
            next_ids.append(request.token_ids[position + 1])
            owners.append(request)
    return np.array(rows, dtype=np.int64), np.array(next_ids, dtype=np.int64), owners
