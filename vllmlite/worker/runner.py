"""The model runner: owns the KV tensors, flattens a SchedulerOutput into one batch, runs the
forward pass, samples and verifies speculative guesses. It reads requests but never changes
scheduler state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from vllmlite.core.batch import RunnerOutput, ScheduledSequence, SchedulerOutput
from vllmlite.core.request import Request
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.kv_dtype import make_kv
from vllmlite.models.decoder import DecoderModel
from vllmlite.pooling_params import PoolingType
from vllmlite.worker.sampling import Sampler, SamplingBatch
from vllmlite.worker.speculative import Draft, Proposer, verify, verify_greedy
from vllmlite.worker.structured_output import GrammarMasker

if TYPE_CHECKING:
    from vllmlite.worker.cuda_graphs import PendingTokens

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, num_host_blocks: int,
                 stop_token_ids: frozenset[int], proposer: Proposer | None = None,
                 cuda_graphs: tuple[int, int, int, bool] | None = None, kv_kind: str = "auto") -> None:
        """cuda_graphs: (largest batch, max_model_len, passes per multi-step decode, async scheduling)
        of the decode steps to replay as CUDA graphs (worker/cuda_graphs.py; captured by
        `capture_graphs`), None to run every step eagerly. kv_kind: what K/V are stored as, auto (the model's dtype) or a packed
        kind of kernels/kv_dtype.py (fp16, bf16, int8; numpy memory only), in both device and host caches."""
        c = model.config
        self.model = model
        self.block_size = block_size
        self.stop_token_ids = stop_token_ids
        self.sampler = Sampler()
        if model.kernels.name == "torch":   # sampled where the logits are
            from vllmlite.worker.torch_sampling import TorchSampler
            self.sampler = TorchSampler()
        self.proposer = proposer
        k = self.kernels = model.kernels
        # With graphs, one block more than the block manager hands out: the padding rows' scratch block.
        shape = ((num_blocks + (cuda_graphs is not None)) * block_size, c.num_kv_heads, c.head_dim)
        # Where the model computes; numpy's zeros map pages lazily, so an unused part of a large budget
        # costs no RAM.
        self.kv_cache = [(make_kv(kv_kind, shape, k.zeros, model.dtype), make_kv(kv_kind, shape, k.zeros, model.dtype))
                         for _ in range(c.num_layers)]       # per layer: [slots, kv_heads, head_dim]
        host_shape = (num_host_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.host_cache = [tuple(make_kv(kv_kind, host_shape, k.host_zeros, model.dtype) for _ in "kv")
                           for _ in range(c.num_layers)] if num_host_blocks else []
        self.num_forward_passes = 0
        self.graphs = None
        if cuda_graphs is not None:
            from vllmlite.worker.cuda_graphs import DecodeGraphs  # torch: only on a GPU
            self.graphs = DecodeGraphs(model, self.kv_cache, block_size, num_blocks, *cuda_graphs)
        self.grammar_masker: GrammarMasker | None = None  # made when a constrained request first samples
        # Test-only: called with each step's SchedulerOutput before the forward pass.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    def capture_graphs(self) -> float:
        """Capture the decode graphs (if any); returns the seconds it took."""
        return self.graphs.capture() if self.graphs is not None else 0.0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_cache)

    @property
    def host_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.host_cache)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Propose guesses, run one forward pass over every scheduled token (guesses included),
        then sample or verify. The step's block copies must be applied first (`copy_blocks`).

        Rerunning a sequence alone after a failed batch is safe: it rewrites the same K/V into the
        same slots; what it draws from the request's generator is the caller's to restore."""
        if not out.scheduled:
            return RunnerOutput()
        if self.fault_hook is not None:
            self.fault_hook(out)
        seqs = out.scheduled
        if self._multi_step(seqs):
            return self._execute_multi_step(seqs)
        drafts = self._propose(seqs)
        # This step's inputs per sequence: its tokens, then its guesses.
        tokens = [s.token_ids + d.token_ids if d.token_ids else s.token_ids for s, d in zip(seqs, drafts)]
        query_lens = [len(ts) for ts in tokens]
        input_ids = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64,
                                count=sum(query_lens))                               # [num_tokens]
        seq_lens = [s.start_position + n for s, n in zip(seqs, query_lens)]
        meta = build_metadata(query_lens, seq_lens, [s.block_table for s in seqs], self.block_size)
        ends = (meta.query_start[1:] - 1).tolist()                                   # [num_seqs] last rows
        # Rows whose logits are needed: sampling rows (forks of one parent share a row), every
        # row of a sequence with guesses, and prompt rows scored for prompt logprobs.
        sample_rows = [ends[i] for i, s in enumerate(seqs) for _ in s.samplers if not drafts[i].token_ids]
        spec_rows = [r for i, d in enumerate(drafts) if d.token_ids
                     for r in range(ends[i] - len(d.token_ids), ends[i] + 1)]
        prompt_rows, prompt_next, prompt_owners = _prompt_logprob_rows(seqs, ends)
        rows = np.concatenate([np.array(sample_rows + spec_rows, dtype=np.int64), prompt_rows])
        unique_rows, inverse = np.unique(rows, return_inverse=True)
        result = RunnerOutput()
        # The requests that draw a token from their sequence's last row, in row order.
        samplers = [r for s, d in zip(seqs, drafts) if not d.token_ids for r in s.samplers]
        if any(s.pooling is not None for s in seqs):
            pool_rows, pool_owners = _pooling_rows(seqs, meta.query_start)
            logits, hidden = self.model.forward_with_hidden(input_ids, meta, self.kv_cache, unique_rows, pool_rows)
            _pool(hidden, pool_owners, result)
        elif self._replays(seqs, drafts, prompt_owners, meta):
            # Decode only: every sequence samples its one row, so the rows wanted are all rows, in order.
            logits = self.graphs.run(input_ids, meta)
        else:
            logits = self.model.forward_logits(input_ids, meta, self.kv_cache, unique_rows)
        self.num_forward_passes += 1
        on_device = not isinstance(logits, np.ndarray)
        if on_device and not spec_rows and not prompt_owners and all(map(is_plain_greedy, samplers)):
            # Nothing but argmax: one integer per row leaves the device (on the host the sampler's
            # own argmax is as cheap, so the CPU paths keep one route).
            _record_sampled(samplers, self.kernels.argmax(logits)[inverse], result)
            return result
        logits = logits[self.kernels.to_device(inverse) if on_device else inverse]   # [rows, vocab], in row order
        num_sample, num_spec = len(sample_rows), len(spec_rows)
        self._sample(samplers, logits[:num_sample], result)
        self._verify([(s, d) for s, d in zip(seqs, drafts) if d.token_ids],
                     logits[num_sample:num_sample + num_spec], result)
        if prompt_owners:
            self._prompt_logprobs(logits[num_sample + num_spec:], prompt_next, prompt_owners, result)
        return result

    def _replays(self, seqs: list[ScheduledSequence], drafts: list[Draft], prompt_owners: list,
                 meta) -> bool:
        """Whether this step is a captured decode graph's: one query per sequence, nothing but sampling."""
        return (self.graphs is not None and len(meta.positions) == len(seqs) and not prompt_owners
                and not any(d.token_ids for d in drafts) and self.graphs.fits(len(seqs), int(meta.seq_lens.max())))

    def _multi_step(self, seqs: list[ScheduledSequence], passes_wanted: bool = True) -> bool:
        """Whether this step replays decode passes back to back: every sequence decodes one token for
        itself alone, plainly greedy, within the captured graphs; and (`passes_wanted`) some have
        lookahead slots."""
        graphs = self.graphs
        if graphs is None or self.proposer is not None:
            return False
        if passes_wanted and (graphs.max_steps == 1 or not any(s.num_draft_slots for s in seqs)):
            return False
        if not passes_wanted and not graphs.pipelined:
            return False
        return (all(len(s.token_ids) == 1 and s.pooling is None and len(s.samplers) == 1 and is_plain_greedy(s.request)
                    for s in seqs)
                and graphs.fits(len(seqs), max(s.seq_len + s.num_draft_slots for s in seqs)))

    def _execute_multi_step(self, seqs: list[ScheduledSequence]) -> RunnerOutput:
        return self._launch_multi_step(seqs).result()

    def _launch_multi_step(self, seqs: list[ScheduledSequence], after: PendingStep | None = None) -> PendingStep:
        """1 + k decode passes for a sequence with k lookahead slots, queued on the device: its k + 1
        greedy tokens, of which the first k will have K/V. `after`: the step still running whose
        last token of each of these sequences is its input (async scheduling)."""
        lookahead = np.fromiter((s.num_draft_slots for s in seqs), dtype=np.int64, count=len(seqs))
        meta = build_metadata([1] * len(seqs), [s.seq_len for s in seqs], [s.block_table for s in seqs],
                              self.block_size)
        if after is None:
            input_ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=len(seqs))
            tokens = self.graphs.launch_steps(input_ids, meta, lookahead)
        else:   # (pass, row) of each sequence's last token in `after`
            last = np.array([after.last_token[s.request.request_id] for s in seqs], dtype=np.int64).reshape(-1, 2)
            tokens = self.graphs.launch_steps(None, meta, lookahead, after=last)
        self.num_forward_passes += int(lookahead.max()) + 1
        return PendingStep(seqs, lookahead, tokens)

    def can_launch(self, out: SchedulerOutput) -> bool:
        """Whether `launch` can queue this step: async scheduling is on and the graphs replay its
        passes (greedy decodes only); else it is to be `execute`d."""
        return bool(out.scheduled) and self._multi_step(out.scheduled, passes_wanted=False)

    def launch(self, out: SchedulerOutput, after: PendingStep | None = None) -> PendingStep:
        """Queue a decode step's passes (`can_launch`) without waiting for its tokens (async
        scheduling). `after`: the step still running whose last tokens are this one's inputs
        (scheduler.schedule_ahead's). The step's block copies must be applied first (`copy_blocks`)."""
        if self.fault_hook is not None:
            self.fault_hook(out)
        return self._launch_multi_step(out.scheduled, after)

    def is_model_healthy(self) -> bool:
        """Whether the model runs a forward pass that holds no request (the warm-up's, on scratch K/V):
        tells a fault of one request's data from a fault of the model itself."""
        try:
            self.model.warm_up()
        except Exception:
            logger.exception("the model fails a forward pass without any request")
            return False
        return True

    def _propose(self, seqs: list[ScheduledSequence]) -> list[Draft]:
        """A Draft per sequence: empty unless the scheduler reserved guess slots for it."""
        drafts = [Draft([], None)] * len(seqs)
        speculating = [i for i, s in enumerate(seqs) if s.num_draft_slots]
        if self.proposer is not None and speculating:
            for i, draft in zip(speculating, self.proposer.propose([seqs[i] for i in speculating])):
                drafts[i] = draft  # proposers fill at most num_draft_slots guesses
        return drafts

    def _sample(self, samplers: list[Request], logits: np.ndarray, result: RunnerOutput) -> None:
        """One token per sampler from its row of logits [num_samplers, vocab]."""
        if not samplers:
            return
        constrained = any(r.grammar is not None for r in samplers)
        batch = self._batch(samplers, [r.output_token_ids for r in samplers],
                            self._allowed_mask([(r.grammar, []) for r in samplers]) if constrained else None)
        sampled = self.sampler(logits, batch)
        _record_sampled(samplers, sampled.token_ids, result, sampled.logprobs)

    def _verify(self, spec: list[tuple[ScheduledSequence, Draft]], logits: np.ndarray,
                result: RunnerOutput) -> None:
        """Score every guess: row j of a sequence is the target's view after its first j guesses."""
        if not spec:
            return
        requests, outputs = [], []
        for seq, draft in spec:
            for j in range(len(draft.token_ids) + 1):
                requests.append(seq.request)
                outputs.append(seq.request.output_token_ids + draft.token_ids[:j])
        masks = self._allowed_mask([(seq.request.grammar, draft.token_ids) for seq, draft in spec])
        probs = self.sampler.probs(logits, self._batch(requests, outputs, masks))   # [rows, vocab]
        # Greedy verification needs each row's argmax only; sampled verification reads the rows of
        # its sequence (on a GPU: those rows alone come to the host).
        targets = self.kernels.argmax(probs)
        start = 0
        for seq, draft in spec:
            request, num_rows = seq.request, len(draft.token_ids) + 1
            rows = slice(start, start + num_rows)
            emitted = verify_greedy(targets[rows], draft) if request.sampling_params.is_greedy else \
                verify(self.kernels.to_numpy(probs[rows]), draft, False, request.generator)
            request_id = request.request_id
            result.sampled_token_ids[request_id] = emitted
            result.num_drafts[request_id] = len(draft.token_ids)
            result.num_accepted[request_id] = len(emitted) - 1
            k = request.sampling_params.logprobs
            if k is not None:
                result.logprobs[request_id] = self.sampler.compute_logprobs(logits[start:start + len(emitted)],
                                                                        np.array(emitted), [k] * len(emitted))
            self.proposer.verified(seq, len(draft.token_ids), len(emitted) - 1)
            start += num_rows

    def _batch(self, requests: list, outputs: list, allowed_mask: np.ndarray | None) -> SamplingBatch:
        return SamplingBatch(params=[r.sampling_params for r in requests],
                             prompt_token_ids=[r.prompt_token_ids for r in requests],
                             output_token_ids=outputs, generators=[r.generator for r in requests],
                             stop_token_ids=self.stop_token_ids, allowed_mask=allowed_mask)

    def _allowed_mask(self, entries: list) -> np.ndarray | None:
        """What the grammars allow at each sampling row ([rows, vocab] bool), None if no row has one;
        entries are (grammar state or None, guesses) per sequence, as GrammarMasker.masks takes."""
        if all(state is None for state, _ in entries):
            return None
        if self.grammar_masker is None:
            self.grammar_masker = GrammarMasker(self.model.config.vocab_size)
        return self.grammar_masker.masks(entries)

    def _prompt_logprobs(self, logits: np.ndarray, next_ids: np.ndarray, owners: list, result: RunnerOutput) -> None:
        """Logprob of each next prompt token under the logits one position before it."""
        top = [r.sampling_params.prompt_logprobs for r in owners]
        for request, entry in zip(owners, self.sampler.compute_logprobs(logits, next_ids, top)):
            result.prompt_logprobs.setdefault(request.request_id, []).append(entry)

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """Swap-out first (its device blocks may be reused below), then swap-in, then copy-on-write
        (in the draft model's KV too, which shares the block tables)."""
        draft_kv = self.proposer.kv_cache if self.proposer is not None else []
        for pairs, src_of, dst_of in ((out.blocks_to_swap_out, self.kv_cache, self.host_cache),
                                      (out.blocks_to_swap_in, self.host_cache, self.kv_cache),
                                      (out.blocks_to_copy, self.kv_cache + draft_kv, self.kv_cache + draft_kv)):
            if not pairs:
                continue
            src = self._slots([p[0] for p in pairs])
            dst = self._slots([p[1] for p in pairs])
            for (src_k, src_v), (dst_k, dst_v) in zip(src_of, dst_of):
                self.kernels.copy_slots(src_k, dst_k, src, dst)
                self.kernels.copy_slots(src_v, dst_v, src, dst)

    def _slots(self, block_ids: list[int]) -> np.ndarray:
        """Every slot of the given blocks: [2, 5] with block_size 2 -> [4, 5, 10, 11]."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return (ids[:, None] * self.block_size + np.arange(self.block_size)[None, :]).reshape(-1)


def is_plain_greedy(request: Request) -> bool:
    """Argmax of the raw logits and nothing else: no grammar, and params that ask for nothing more
    (SamplingParams.is_plain_greedy)."""
    return request.grammar is None and request.sampling_params.is_plain_greedy


def _record_sampled(samplers: list[Request], token_ids: np.ndarray, result: RunnerOutput,
                    logprobs: list | None = None) -> None:
    """One sampled token (and its logprobs, if asked) per sampler, in order."""
    for j, (request, token_id) in enumerate(zip(samplers, token_ids.tolist())):
        result.sampled_token_ids[request.request_id] = [token_id]
        if logprobs is not None and logprobs[j] is not None:
            result.logprobs[request.request_id] = [logprobs[j]]


def _pooling_rows(seqs: list[ScheduledSequence], query_start: np.ndarray) -> tuple[np.ndarray, list]:
    """Rows whose final-norm hidden states an embedding request pools, and (request, pooling, number
    of rows) per such sequence, in row order.
    Example: query_start [0, 3, 8], seq 0 MEAN, seq 1 LAST -> rows [0, 1, 2, 7]."""
    rows, owners = [], []
    for i, seq in enumerate(seqs):
        if seq.pooling is None:
            continue
        start, end = int(query_start[i]), int(query_start[i + 1])
        span = range(start, end) if seq.pooling is PoolingType.MEAN else range(end - 1, end)
        rows.extend(span)
        owners.append((seq.request, seq.pooling, len(span)))
    return np.array(rows, dtype=np.int64), owners


def _pool(hidden: np.ndarray, owners: list, result: RunnerOutput) -> None:
    """Each embedding sequence's share of `hidden` [num_rows, hidden_size]: its last row, or the
    sum of its rows (float64, so a mean over many chunks loses nothing)."""
    start = 0
    for request, pooling, num_rows in owners:
        rows = hidden[start:start + num_rows]
        result.pooled[request.request_id] = (rows[-1].astype(np.float64) if pooling is PoolingType.LAST
                                             else rows.sum(axis=0, dtype=np.float64))
        start += num_rows


def _prompt_logprob_rows(seqs: list, ends: list[int]) -> tuple[np.ndarray, np.ndarray, list]:
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


class PendingStep:
    """A multi-step decode step queued on the device: its tokens, once `result` waits for them."""

    def __init__(self, seqs: list[ScheduledSequence], lookahead: np.ndarray, tokens: PendingTokens) -> None:
        self.seqs = seqs
        self._lookahead = lookahead
        self._tokens = tokens
        # Where each sequence's last token will be among the step's tokens: (pass, row).
        self.last_token = {s.request.request_id: (k, row) for row, (s, k) in enumerate(zip(seqs, lookahead.tolist()))}

    def result(self) -> RunnerOutput:
        """Wait for the tokens: a sequence with k lookahead slots gets its k + 1 greedy tokens, of
        which the first k now have K/V (reported as accepted, as a verified guess is)."""
        tokens = self._tokens.wait().T.tolist()    # [num_seqs][passes]
        result = RunnerOutput()
        for seq, k, row in zip(self.seqs, self._lookahead.tolist(), tokens):
            result.sampled_token_ids[seq.request.request_id] = row[:k + 1]
            result.num_accepted[seq.request.request_id] = k
        return result
