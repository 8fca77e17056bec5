"""Decode steps replayed as CUDA graphs: the forward pass of a batch of one-token queries, captured
at start for a ladder of batch sizes (1, 2, 4, 8, then every 16 up to max_num_seqs) and padded up
to the next, as vLLM does. A replay costs one launch instead of a few hundred kernel launches from
Python, which is most of a small model's decode step on a fast GPU.

Everything a captured pass reads lives in static device buffers, refilled before each replay by
one host-to-device copy of a pinned staging buffer: token ids, positions, KV slots, the attention
tiles (kernels/torch/triton_attention.py) and the block tables, sized for the longest sequence
max_model_len allows. Padding rows decode token 0 at position 0 into a scratch block that no
request owns (the runner allocates one block more than the block manager hands out), so they
never touch a request's K/V. The graphs share one workspace of their own, never the eager
passes', which grows and moves.

Only decode-only steps replay (no prefill chunk, guesses, pooling or prompt logprobs): everything
else runs eagerly, as does every step with `enforce_eager`.

Multi-step decoding (`num_scheduler_steps` > 1, `launch_steps`): a greedy decode step replays its graph
up to that many times back to back. The host stages every pass's positions and slots at once (one
copy to the device); between passes the device copies each row's argmax into the next pass's input
ids, so the host waits once, for every pass's tokens, instead of once a token: its scheduling,
update and output work is paid once for the passes together. Off a GPU nothing is captured and
`run` executes the same padded pass on the same static buffers eagerly: how the tests check all
of this but the capture on the CPU.

Async scheduling (`launch_steps` with `after`): the next step's passes are queued behind a step
still running, their first input ids gathered on the device from that step's tokens, whose copy to
the host was queued before them. The staging and the host copy of the tokens alternate between two
pinned buffers, so a launch never overwrites what a launch still queued will read.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllmlite.config import ceil_div
from vllmlite.kernels.attention_metadata import AttentionMetadata
from vllmlite.kernels.torch import triton_attention
from vllmlite.models.decoder import DecoderModel, KVCache, Workspace

logger = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    """The captured batch sizes: [1, 2, 4, 8, 16, 32, ...] up to and including max_batch.
    >>> batch_ladder(40)
    [1, 2, 4, 8, 16, 32, 40]"""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, block_size: int, scratch_block: int,
                 max_batch: int, max_model_len: int, max_steps: int = 1, pipelined: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.sizes = batch_ladder(max_batch)
        self.max_blocks = ceil_div(max_model_len, block_size)
        b = max_batch = self.sizes[-1]
        # One int64 staging buffer, [ids | positions | slots | tiles (4 per row) | block tables].
        self._fields = {"ids": (0, b), "positions": (b, 2 * b), "slots": (2 * b, 3 * b), "tiles": (3 * b, 7 * b),
                        "tables": (7 * b, (7 + self.max_blocks) * b)}
        size = (7 + self.max_blocks) * b
        self.replay = model.kernels.device.type == "cuda"
        device = model.kernels.device
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=self.replay)
        self._staged = self._host.numpy()
        self._device = torch.zeros(size, dtype=torch.int64, device=device)
        # Multi-step decoding: every pass's staging, and every pass's tokens, [passes, ...]; the host's
        # buffers twice (for the launch queued behind a running one: async scheduling).
        self.max_steps = max_steps
        self.pipelined = pipelined
        if max_steps > 1 or pipelined:
            self._steps_host = torch.zeros((2, max_steps, size), dtype=torch.int64, pin_memory=self.replay)
            self._steps_device = torch.zeros((max_steps, size), dtype=torch.int64, device=device)
            self._tokens = torch.zeros((max_steps, b), dtype=torch.int64, device=device)
            self._tokens_host = torch.zeros((2, max_steps, b), dtype=torch.int64, pin_memory=self.replay)
            self._num_launches = 0
        self._workspace = Workspace.allocate(model.config, max_batch, model.dtype, model.kernels)
        self._rows = torch.arange(max_batch, device=model.kernels.device)   # every row's logits
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def view(self, name: str, device: bool = True, staged: np.ndarray | None = None):
        """Field `name` of the device buffer, or of a staging buffer (the one `run` stages in unless
        `staged` is given)."""
        start, end = self._fields[name]
        if device:
            return self._device[start:end]
        return (self._staged if staged is None else staged)[start:end]

    def capture(self) -> float:
        """Capture a graph for each batch size of the ladder, largest first (the smaller ones reuse
        its memory pool). Returns the seconds it took."""
        if not self.replay:
            return 0.0
        start = time.perf_counter()
        pool = None
        for batch in reversed(self.sizes):
            self._stage(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                        np.zeros((0, 1), np.int64), batch)
            self._device.copy_(self._host)
            self._forward(batch)   # warm: Triton compiles, cuBLAS picks its kernels, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            pool = graph.pool()
            self._graphs[batch] = (graph, logits)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def fits(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_seq_len <= self.max_blocks * self.block_size

    def run(self, input_ids: np.ndarray, meta: AttentionMetadata) -> torch.Tensor:
        """The logits [num_seqs, vocab] of a decode-only step (one query per sequence), on the device."""
        num_seqs = len(input_ids)
        batch = next(b for b in self.sizes if b >= num_seqs)
        self._stage(input_ids, meta.positions, meta.slot_mapping, meta.block_tables, batch)
        self._device.copy_(self._host, non_blocking=True)
        return self._launch(batch)[:num_seqs]

    def launch_steps(self, input_ids: np.ndarray, meta: AttentionMetadata, lookahead: np.ndarray,
                     after: np.ndarray | None = None) -> PendingTokens:
        """Queue 1 + lookahead.max() greedy decode passes back to back; their tokens, [passes,
        num_seqs], come from the returned PendingTokens. Pass j gives row i the token pass j - 1
        chose for it, at position + j, while j <= lookahead[i] (the slots its block table holds);
        past that the row repeats its last position with its K/V sent to the scratch block, and its
        tokens are not to be used.

        `after` (async scheduling): instead of input_ids, each row's first token is the previous
        launch's token at (pass after[i][0], row after[i][1]), read on the device."""
        num_seqs, num_steps = len(meta.positions), int(lookahead.max()) + 1
        batch = next(b for b in self.sizes if b >= num_seqs)
        rows, scratch_slot = np.arange(num_seqs), self.scratch_block * self.block_size
        parity = self._num_launches % 2
        self._num_launches += 1
        host = self._steps_host[parity]
        staged = host.numpy()
        # With `after`, pass 0's ids are indices into the previous launch's tokens, flattened.
        first = input_ids if after is None else after[:, 0] * self._tokens.shape[1] + after[:, 1]
        for j in range(num_steps):
            positions = meta.positions + np.minimum(j, lookahead)
            slots = meta.block_tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
            self._stage(first, positions, np.where(j <= lookahead, slots, scratch_slot), meta.block_tables,
                        batch, staged[j])
        self._steps_device[:num_steps].copy_(host[:num_steps], non_blocking=True)
        tokens = self._tokens[:num_steps, :batch]
        for j in range(num_steps):
            self._device.copy_(self._steps_device[j])
            ids = self.view("ids")[:batch]
            if j:
                ids.copy_(tokens[j - 1])
            elif after is not None:
                ids.copy_(self._tokens.view(-1)[ids])
            self.model.kernels.device_argmax(self._launch(batch), out=tokens[j])
        out = self._tokens_host[parity, :num_steps]
        out.copy_(self._tokens[:num_steps], non_blocking=True)   # whole rows: one contiguous copy, not waited for
        return PendingTokens(out[:, :num_seqs], _recorded_event() if self.replay else None)

    def _launch(self, batch: int) -> torch.Tensor:
        """The logits [batch, vocab] of the pass staged on the device: the graph replayed (off a GPU,
        the same pass run eagerly)."""
        if not self.replay:
            return self._forward(batch)
        graph, logits = self._graphs[batch]
        graph.replay()
        return logits

    def _stage(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
               batch: int, staged: np.ndarray | None = None) -> None:
        """Fill a staging buffer's first `batch` rows: the step's sequences, then padding."""
        n = len(ids)
        scratch_slot = self.scratch_block * self.block_size
        self.view("ids", False, staged)[:batch] = np.concatenate([ids, np.zeros(batch - n, np.int64)])
        self.view("positions", False, staged)[:batch] = np.concatenate([positions, np.zeros(batch - n, np.int64)])
        self.view("slots", False, staged)[:batch] = np.concatenate([slots, np.full(batch - n, scratch_slot)])
        tiles = self.view("tiles", False, staged).reshape(-1, 4)[:batch]  # (first row, rows, sequence, position)
        order = np.concatenate([np.argsort(-positions, kind="stable"), np.arange(n, batch)])   # as make_tiles'
        tiles[:, 0] = tiles[:, 2] = order
        tiles[:, 1] = 1
        tiles[:n, 3], tiles[n:, 3] = positions[order[:n]], 0
        table = self.view("tables", False, staged).reshape(-1, self.max_blocks)[:batch]
        table[:n, :tables.shape[1]] = tables
        table[n:] = self.scratch_block

    def _forward(self, batch: int) -> torch.Tensor:
        """The model's own forward pass on the static buffers' first `batch` rows and the graphs'
        workspace."""
        c = self.model.config
        meta = AttentionMetadata(self.view("positions")[:batch], np.arange(batch + 1), np.ones(batch, np.int64),
                                 self.view("slots")[:batch], self.view("tables").view(-1, self.max_blocks)[:batch],
                                 self.block_size)
        # The attention launch the torch kernels would plan for this batch, on the static tiles.
        rows = triton_attention.tile_rows(c.num_heads, c.num_kv_heads, long=False)
        plan = triton_attention.short_query_plan(batch * c.num_kv_heads, self.max_model_len,
                                                 self.model.kernels.num_sms)
        meta.kernel_cache["torch.tiles"] = [(self.view("tiles").view(-1, 4)[:batch], rows, *plan)]
        meta.kernel_cache["torch.block_tables"] = meta.block_tables
        return self.model.forward_logits(self.view("ids")[:batch], meta, self.kv_cache, self._rows[:batch],
                                         workspace=self._workspace)


class PendingTokens:
    """The tokens [passes, num_seqs] of a launch of decode passes, on their way to the host."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self._host = host
        self._done = done

    def wait(self) -> np.ndarray:
        """The tokens, once the device has made them (a copy: the buffer serves a later launch)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.numpy().copy()


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event
