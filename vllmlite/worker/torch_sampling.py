"""The sampler on the device: worker/sampling.py's operations, in its order and with its meaning,
on torch tensors where the logits are (a GPU's), so a step copies to the host only what it
returns: a token id per row, and the logprobs a request asked for.

What is not a [batch, vocab] operation stays on the host, where it is a few Python lists: which
(row, token) pairs a penalty, bias, bad word or min_tokens touches (worker/sampling.py's helpers
make them), and one uniform per random row drawn from the request's own generator, so a seeded
request draws exactly what it draws on the CPU paths. Grammar masks come packed (32 tokens a word,
as llguidance fills them) and are unpacked here.

Floats: float64 throughout, as the numpy sampler (a GPU does it for the rows of one step in well
under a millisecond; the plain-greedy rows never come here, see ModelRunner).
Imported only with the torch kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from vllmlite.worker.sampling import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    TokenLogprobs,
    _check_ids,
    _flat_token_ids,
)

BITS = torch.arange(32, dtype=torch.int32)


class TorchSampler:
    """Stateless; all randomness comes from the per-row generators in the batch (as Sampler)."""

    @staticmethod
    def compute_logprobs(logits: torch.Tensor, token_ids: np.ndarray, num_top: list[int]) -> list[TokenLogprobs]:
        """This module's compute_logprobs (what the runner also scores guesses and prompts with)."""
        return compute_logprobs(logits, token_ids, num_top)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """One token per row of `logits` [batch, vocab] (not modified)."""
        Sampler.check_shape(logits, batch)
        processed = self.processed_logits(logits, batch)
        token_ids = processed.argmax(dim=1)                                   # [batch]; final for greedy rows
        random_rows = batch.rows_where(lambda p: not p.is_greedy)
        if random_rows.size:
            rows = torch.from_numpy(random_rows).to(logits.device)
            probs = self._filtered_probs(processed[rows], batch, random_rows)
            uniforms = np.array([batch.generators[i].random() for i in random_rows])
            token_ids[rows] = inverse_cdf(probs, torch.from_numpy(uniforms).to(probs))
        token_ids = token_ids.cpu().numpy()
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, batch))

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sampler.processed_logits on the device: a new [batch, vocab] tensor."""
        Sampler.check_shape(logits, batch)
        x = logits.to(torch.float64, memory_format=torch.contiguous_format, copy=True)
        vocab = x.shape[1]
        if batch.allowed_mask is not None:
            x.masked_fill_(~allowed_on(batch.allowed_mask, vocab, x.device), float("-inf"))
        self._apply_penalties(x, batch)
        pairs = [(i, t, b) for i in batch.rows_where(lambda p: bool(p.logit_bias))
                 for t, b in batch.params[i].logit_bias.items()]
        if pairs:
            rows, tokens = (np.array([p[k] for p in pairs], dtype=np.int64) for k in (0, 1))
            _check_ids("logit_bias token ids", tokens, vocab)
            x.view(-1).index_add_(0, self._on(rows * vocab + tokens, x),
                                  torch.tensor([b for _, _, b in pairs], dtype=x.dtype, device=x.device))
        for i in batch.rows_where(lambda p: p.allowed_token_ids is not None):
            allowed = np.asarray(batch.params[i].allowed_token_ids, dtype=np.int64)
            _check_ids("allowed_token_ids", allowed, vocab)
            keep = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            keep[self._on(allowed, x)] = True
            x[i].masked_fill_(~keep, float("-inf"))
        mask_tokens(x, batch.bad_word_pairs(), "bad_words token ids")
        mask_tokens(x, batch.min_tokens_pairs(), "stop token ids")
        return x

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sampler.probs on the device: [batch, vocab], greedy rows one-hot at their argmax."""
        processed = self.processed_logits(logits, batch)
        probs = torch.zeros_like(processed)
        probs.scatter_(1, processed.argmax(dim=1, keepdim=True), 1.0)
        random_rows = batch.rows_where(lambda p: not p.is_greedy)
        if random_rows.size:
            rows = self._on(random_rows, probs)
            probs[rows] = self._filtered_probs(processed[rows], batch, random_rows)
        return probs

    @staticmethod
    def _on(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(like.device)

    def _apply_penalties(self, x: torch.Tensor, batch: SamplingBatch) -> None:
        """Repetition over prompt and output tokens, frequency and presence over output tokens."""
        rows = batch.rows_where(lambda p: p.needs_penalties)
        if rows.size == 0:
            return
        vocab, flat = x.shape[1], x.view(-1)
        outputs = _flat_token_ids([batch.output_token_ids[i] for i in rows], rows, vocab)
        prompts = _flat_token_ids([batch.prompt_token_ids[i] for i in rows], rows, vocab)
        seen = np.unique(np.concatenate([prompts, outputs]))
        rp = self._on(np.array([batch.params[i].repetition_penalty for i in seen // vocab]), x).to(x.dtype)
        seen_t = self._on(seen, x)
        values = flat[seen_t]
        flat[seen_t] = torch.where(values > 0, values / rp, values * rp)
        generated, counts = np.unique(outputs, return_counts=True)
        params = [batch.params[i] for i in generated // vocab]
        shift = np.array([p.frequency_penalty for p in params]) * counts + np.array([p.presence_penalty for p in params])
        flat.index_add_(0, self._on(generated, x), -self._on(shift, x).to(x.dtype))

    def _filtered_probs(self, logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
        """Temperature, top-k, softmax, top-p, min-p, renormalize (Sampler._filtered_probs)."""
        params = [batch.params[i] for i in rows]
        vocab = logits.shape[1]
        scaled = logits / self._on(np.array([p.temperature for p in params]), logits).to(logits.dtype)[:, None]
        top_k = np.array([min(p.top_k or vocab, vocab) for p in params])
        if (top_k < vocab).any():   # keep logits >= the k-th largest (ties at the k-th kept)
            kth = scaled.sort(dim=1, descending=True).values.gather(1, self._on(top_k - 1, scaled)[:, None])
            scaled = torch.where(scaled >= kth, scaled, float("-inf"))
        top = scaled.max(dim=1, keepdim=True).values
        infinite = torch.isposinf(top)                   # softmax's limit: uniform over the +inf logits
        probs = torch.where(infinite, torch.isposinf(scaled).to(scaled.dtype),
                            torch.exp(scaled - torch.where(infinite, 0.0, top)))
        probs = probs / probs.sum(dim=1, keepdim=True)
        top_p = np.array([p.top_p for p in params])
        if (top_p < 1.0).any():   # the smallest highest-first prefix with mass >= top_p
            sorted_probs, order = probs.sort(dim=1, descending=True, stable=True)
            mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
            keep_sorted = mass_before < self._on(top_p, probs).to(probs.dtype)[:, None]
            probs = torch.where(torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted), probs, 0.0)
        min_p = np.array([p.min_p for p in params])
        if (min_p > 0).any():
            threshold = self._on(min_p, probs).to(probs.dtype)[:, None] * probs.max(dim=1, keepdim=True).values
            probs = torch.where(probs >= threshold, probs, 0.0)
        return probs / probs.sum(dim=1, keepdim=True)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: np.ndarray, batch: SamplingBatch) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * batch.num_rows
        rows = batch.rows_where(lambda p: p.logprobs is not None)
        if rows.size:
            found = compute_logprobs(logits[torch.from_numpy(rows).to(logits.device)], token_ids[rows],
                                     [batch.params[i].logprobs for i in rows])
            for i, entry in zip(rows, found):
                out[i] = entry
        return out


def allowed_on(mask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """A grammar mask on the device as [rows, vocab] bool: given so, or packed as llguidance fills
    it ([rows, words] int32, bit t % 32 of word t // 32 is token t), unpacked there."""
    if mask.dtype == np.bool_:
        return torch.from_numpy(mask).to(device)
    words = torch.from_numpy(mask).to(device)                                     # [rows, words]
    bits = (words[:, :, None] >> BITS.to(device)) & 1                             # [rows, words, 32]
    return bits.reshape(len(mask), -1)[:, :vocab].bool()


def mask_tokens(logits: torch.Tensor, pairs: list[tuple[int, int]], name: str) -> None:
    """In place: logits[row, token] -> -inf for each pair, except in a row that would be left with
    no finite logit (sampling._mask_tokens)."""
    if not pairs:
        return
    rows, tokens = (np.array([p[k] for p in pairs], dtype=np.int64) for k in (0, 1))
    _check_ids(name, tokens, logits.shape[1])
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    mask[torch.from_numpy(rows).to(logits.device), torch.from_numpy(tokens).to(logits.device)] = True
    nothing_left = (mask | ~torch.isfinite(logits)).all(dim=1, keepdim=True)
    logits.masked_fill_(mask & ~nothing_left, float("-inf"))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token per row: the first index whose cumulative mass exceeds u * total (sampling._inverse_cdf)."""
    cdf = probs.cumsum(dim=1)
    return (cdf <= (uniforms * cdf[:, -1])[:, None]).sum(dim=1)


def compute_logprobs(logits: torch.Tensor, token_ids: np.ndarray, num_top: list[int]) -> list[TokenLogprobs]:
    """sampling.compute_logprobs on the device: only the chosen and top entries reach the host."""
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=1)
    ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(logits.device)
    chosen = logprobs.gather(1, ids[:, None])                                     # [n, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).cpu().numpy()
    max_top = min(max(num_top, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs[:, :0], ids[:, None][:, :0]
    if max_top:
        top_values, top_ids = logprobs.sort(dim=1, descending=True, stable=True)  # ties: lower id first
    top_values, top_ids = top_values[:, :max_top].cpu().numpy(), top_ids[:, :max_top].cpu().numpy()
    chosen = chosen[:, 0].cpu().numpy()
    return [TokenLogprobs(int(token_ids[i]), float(chosen[i]), int(ranks[i]),
                          [(int(t), float(v)) for t, v in zip(top_ids[i, :k], top_values[i, :k])])
            for i, k in enumerate(num_top)]
