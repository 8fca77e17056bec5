"""RequestLimits: what a request is checked against before it is queued (vocabulary, context length,
KV cache size, sequences at once), as a small picklable value.

Owns the client-facing size and range errors (ValueError). Knows nothing of the engine's state: the
engine builds one from its config, and an ingress in front of replicas checks with a replica's copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllmlite.config import SchedulerConfig
from vllmlite.core.sliding_window import SlidingWindow
from vllmlite.pooling_params import PoolingParams
from vllmlite.sampling_params import SamplingParams


def truncated_prompt(token_ids: list[int], params: SamplingParams) -> list[int]:
    """The last `truncate_prompt_tokens` tokens of the prompt, or all of it if that is None."""
    k = params.truncate_prompt_tokens
    return token_ids if k is None else token_ids[-k:]


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    sliding_window: int | None = None  # then a step holds only a window's and a chunk's blocks
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens  # the largest chunk

    def check(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> int:
        """Check a prompt against the vocabulary and context length (after `truncate_prompt_tokens`);
        return the resolved max_tokens (0 for an embedding request, whose prompt may fill the context).
        Raises ValueError with a message fit for the client."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        # Built-in loops, not a generator over the ids: intake of a long prompt costs microseconds.
        if set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if isinstance(params, PoolingParams):
            if len(token_ids) > self.max_model_len:
                raise ValueError(f"the input has {len(token_ids)} tokens but this model's maximum context "
                                 f"length is {self.max_model_len} tokens")
            self._check_fits_cache(len(token_ids))
            return 0
        params.verify(vocab)
        if params.num_sequences > self.max_num_seqs:
            name = "n" if params.best_of is None else "best_of"
            raise ValueError(f"{name} asks for {params.num_sequences} sequences, more than this server runs at "
                             f"once (max_num_seqs={self.max_num_seqs})")
        token_ids = truncated_prompt(token_ids, params)
        self._check_fits_cache(len(token_ids))
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but this model's maximum context "
                             f"length is {self.max_model_len} tokens (prompt plus output)")
        if params.max_tokens is None:
            return self.max_model_len - len(token_ids)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks "
                f"for {len(token_ids)} prompt tokens plus {params.max_tokens} output tokens "
                f"({len(token_ids) + params.max_tokens}); reduce the prompt or max_tokens")
        return params.max_tokens

    def _check_fits_cache(self, num_prompt_tokens: int) -> None:
        """A prompt whose K/V (and the next token's) exceeds the whole KV cache can never run: the
        client's size error, said before queueing (the scheduler would end it in error). Under a
        sliding window only the blocks one step holds count (SlidingWindow.peak_blocks)."""
        window = SlidingWindow(self.sliding_window, self.block_size)
        peak = window.peak_blocks(num_prompt_tokens + 1, self.max_num_batched_tokens)
        if peak <= self.num_blocks:
            return
        if self.sliding_window is None:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens but this server's KV cache holds at most "
                             f"{self.num_blocks * self.block_size - 1} prompt tokens")
        raise ValueError(f"a step of this prompt needs {peak} KV cache blocks at once (sliding window "
                         f"{self.sliding_window}, chunks of up to {self.max_num_batched_tokens} tokens) but this "
                         f"server's KV cache holds {self.num_blocks}")
