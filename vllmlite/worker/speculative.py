"""Speculative decoding: proposers that guess the next k tokens, and exact verification.

A proposer fills draft tokens into the decode slots the scheduler reserved; the runner scores them
all in the same forward pass; `verify` keeps what the target model would have produced (greedy:
the longest matching prefix; sampled: rejection sampling, so the output distribution is the
target's). Knows the model and sampler, never the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from vllmlite.config import EngineConfig, SpeculativeConfig
from vllmlite.core.batch import ScheduledSequence
from vllmlite.kernels import Kernels
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.kv_dtype import make_kv
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import LoadedModel, ModelWeights, load_model
from vllmlite.worker.sampling import Sampler, SamplingBatch


class Draft(NamedTuple):
    token_ids: list[int]           # at most seq.num_draft_slots guesses
    probs: np.ndarray | None    # [len(token_ids), vocab] the draft's distribution; None = deterministic


class Proposer(ABC):
    """Guesses tokens for the decode slots the scheduler reserved. Only `propose` is required; a
    proposer that runs a model of its own also reports its KV cache and its forward passes."""

    @abstractmethod
    def propose(self, seqs: list[ScheduledSequence]) -> list[Draft]:
        """One Draft per sequence, each with at most `seq.num_draft_slots` tokens."""

    @property
    def kv_cache(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The proposer's own K/V per layer, over the target's slots (block copies apply to it too);
        [] if it keeps none."""
        return []

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_cache)

    @property
    def num_forward_passes(self) -> int:
        """Forward passes of the proposer's own model, cumulative; 0 if it has none."""
        return 0

    def verified(self, seq: ScheduledSequence, num_drafts: int, num_accepted: int) -> None:
        """Told after verification how many drafts survived (draft models roll back on it)."""

    def forget(self, request_id: str) -> None:
        """The request is gone: drop any state kept for it."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    max_n down to min_n) and propose the k tokens that followed it.

    tokens [5, 6, 7, 9, 5, 6], n = 2: the suffix [5, 6] occurred at 0, so propose [7, 9, ...].
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[ScheduledSequence]) -> list[Draft]:
        return [Draft(self._lookup(s.request.token_ids, s.num_draft_slots), None) for s in seqs]

    def _lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [len - n, n]
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start:start + k].tolist()
        return []


class DraftModelProposer(Proposer):
    """A smaller model (or the target's first layers) runs k greedy or sampled steps on its own KV.

    The draft's KV uses the target's block tables (a position's slot is the same in both), so it
    needs no allocator of its own. `_computed[request_id]` counts the positions whose draft KV is
    valid; the draft catches up from there, and rejection rolls it back.
    """

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, seed: int = 0,
                 kv_kind: str = "auto") -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        shape = (num_blocks * block_size, c.num_kv_heads, c.head_dim)
        # per layer: [slots, kv_heads, head_dim], stored as the target's (kv_kind: kernels/kv_dtype.py)
        self._kv_cache = [tuple(make_kv(kv_kind, shape, model.kernels.zeros, model.dtype) for _ in "kv")
                          for _ in range(c.num_layers)]
        self.sampler = Sampler()
        self.rng = np.random.default_rng(seed)                 # the draft's own draws
        self._computed: dict[str, tuple[int, int]] = {}        # id -> (valid positions, preemptions seen)
        self._num_forward_passes = 0

    @property
    def kv_cache(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return self._kv_cache

    @property
    def num_forward_passes(self) -> int:
        return self._num_forward_passes

    def propose(self, seqs: list[ScheduledSequence]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[np.ndarray]] = [[] for _ in seqs]
        # Step 0 feeds every position the draft has not seen (at least the last token), later
        # steps feed the previous guess: query tokens for seq i are [start_i, seq_len_i).
        starts = [self._valid_positions(s) for s in seqs]
        inputs = [s.request.token_ids[start:s.start_position + 1] for s, start in zip(seqs, starts)]
        for step in range(max(s.num_draft_slots for s in seqs)):
            active = [i for i, s in enumerate(seqs) if s.num_draft_slots > step]
            q = self._next_token_probs([seqs[i] for i in active], [inputs[i] for i in active],
                                       [starts[i] for i in active], [drafts[i] for i in active])
            for row, i in enumerate(active):
                token = _draw(q[row], self.rng)
                starts[i] += len(inputs[i])
                inputs[i] = [token]
                drafts[i].append(token)
                probs[i].append(q[row])
        return [Draft(d, np.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _valid_positions(self, seq: ScheduledSequence) -> int:
        request = seq.request
        valid, preemptions = self._computed.get(request.request_id, (0, request.num_preemptions))
        if preemptions != request.num_preemptions:
            valid = 0  # its blocks were dropped or moved: the draft's KV there is gone
        return min(valid, seq.start_position)

    def _next_token_probs(self, seqs: list[ScheduledSequence], inputs: list[list[int]], starts: list[int],
                          drafts: list[list[int]]) -> np.ndarray:
        """One draft forward pass; the processed next-token distribution per sequence. [seqs, vocab]"""
        query_lens = [len(x) for x in inputs]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        meta = build_metadata(query_lens, seq_lens, [s.block_table for s in seqs], self.block_size)
        input_ids = np.array([t for x in inputs for t in x], dtype=np.int64)           # [num_tokens]
        last_rows = meta.query_start[1:] - 1                                            # [seqs]
        logits = self.model.forward(input_ids, meta, self.kv_cache, last_rows)
        self._num_forward_passes += 1
        requests = [s.request for s in seqs]
        batch = SamplingBatch(params=[r.sampling_params for r in requests],
                              prompt_token_ids=[r.prompt_token_ids for r in requests],
                              output_token_ids=[r.output_token_ids + d for r, d in zip(requests, drafts)],
                              generators=[self.rng] * len(requests))
        return self.sampler.probs(logits, batch)

    def verified(self, seq: ScheduledSequence, num_drafts: int, num_accepted: int) -> None:
        # Valid: every position up to the last token, plus accepted guesses the draft itself fed
        # back (all but its final guess were fed back).
        fed_back = min(num_accepted, max(num_drafts - 1, 0))
        self._computed[seq.request.request_id] = (seq.start_position + 1 + fed_back,
                                                  seq.request.num_preemptions)

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)


def verify(target_probs: np.ndarray, draft: Draft, is_greedy: bool, generator: np.random.Generator) -> list[int]:
    """Tokens to emit: accepted drafts plus one token from the target (a correction or a bonus).

    target_probs [len(draft) + 1, vocab]: row j is the target's processed distribution after the
    first j drafts. Greedy: keep drafts while they equal the target's argmax. Sampled: accept draft d
    with probability min(1, p(d) / q(d)); on rejection draw from normalize(max(p - q, 0)); if all
    are accepted, draw a bonus token from the last row. This reproduces the target distribution.
    """
    if is_greedy:
        return verify_greedy(target_probs.argmax(axis=-1), draft)
    emitted = []
    for j, token in enumerate(draft.token_ids):
        p = target_probs[j]
        q = draft.probs[j] if draft.probs is not None else _one_hot(token, p.shape[0])
        if generator.random() < min(1.0, p[token] / q[token]):
            emitted.append(token)
            continue
        residual = np.maximum(p - q, 0.0)
        return emitted + [_draw(residual if residual.sum() > 0 else p, generator)]
    return emitted + [_draw(target_probs[len(emitted)], generator)]


def verify_greedy(targets: np.ndarray, draft: Draft) -> list[int]:
    """Greedy verification from the target's argmax after each draft, targets [len(draft) + 1]:
    keep drafts while they equal it, then emit its token."""
    emitted = []
    for j, token in enumerate(draft.token_ids):
        if token != targets[j]:
            break
        emitted.append(token)
    return emitted + [int(targets[len(emitted)])]


def _one_hot(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


def _draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"), len(probs) - 1))



def make_proposer(spec: SpeculativeConfig, target: LoadedModel, config: EngineConfig, num_blocks: int,
                  max_model_len: int, kernels: Kernels | None = None) -> Proposer:
    """The proposer a SpeculativeConfig names. Draft models must share the target's vocabulary."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "self_draft":
        num_layers = spec.num_draft_layers or max(1, target.config.num_layers // 4)
        if num_layers > target.config.num_layers:
            raise ValueError(f"num_draft_layers {num_layers} exceeds the model's {target.config.num_layers}")
        w = target.weights  # the draft shares the target's arrays: no extra weight memory
        weights = ModelWeights(w.embed, w.layers[:num_layers], w.final_norm, w.lm_head, w.rope_freq_factors)
        draft_config = target.config.first_layers(num_layers)
    else:
        draft = load_model(spec.model, config.dtype, config.seed + 1, config.weight_quantization)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                             f"target's ({target.config.vocab_size})")
        weights, draft_config = draft.weights, draft.config
    model = DecoderModel(draft_config, weights, max_model_len, kernels)
    return DraftModelProposer(model, num_blocks, config.cache.block_size, config.seed, config.kv_kind)
