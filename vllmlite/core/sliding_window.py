"""Which KV blocks a sliding-window model still reads, and how many blocks a request holds at most.

With a window of w tokens every layer's query at position p sees only keys p-w+1 .. p (Mistral).
Knows block sizes and token counts only: the block manager applies it to tables, the scheduler to
admission.

The placeholder contract (the one place it is written): a block all of whose positions lie before
every window a future query of its request can have is released, and its table entry becomes
`None`. Entries keep their index (entry i holds positions [i*bs, (i+1)*bs)), so the placeholders
are exactly a table's first `num_skipped_blocks` entries. The kernels, given `sliding_window`, never
read an entry wholly before a query's window, so `build_metadata` turns a placeholder into any valid
block id (0). Nothing else may read a placeholder: no copy, swap or publish touches one.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllmlite.config import ceil_div


@dataclass(frozen=True)
class SlidingWindow:
    """The window (None: full attention, nothing is ever skipped) over blocks of `block_size`.

    >>> sw = SlidingWindow(window=6, block_size=4)
    >>> sw.num_skipped_blocks(9)   # the next query sits at 9 and sees 4..9: block 0 (0..3) is out
    1
    >>> sw.num_blocks_held(9, 12)  # blocks 1 and 2 hold positions 4..11
    2
    """

    window: int | None
    block_size: int

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.window}")

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the window of the next query (at position num_computed_tokens), which
        sees positions >= num_computed_tokens - w + 1: bs 4, w 4, 8 computed -> 5 // 4 = 1 block
        (0..3 out, 4..7 still holds 5, 6, 7). Later queries sit further on, so a skipped block stays so.
        """
        if self.window is None:
            return 0
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def num_blocks_held(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Blocks a table holding `num_tokens` tokens, of which `num_computed_tokens` are computed,
        has that are not placeholders."""
        return max(0, ceil_div(num_tokens, self.block_size) - self.num_skipped_blocks(num_computed_tokens))

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request ever holds at once while its first `num_tokens` tokens are
        computed in steps of at most `max_chunk` tokens each.

        Full attention: every block, ceil(num_tokens / bs). With a window, a step computing c tokens
        after s needs positions s-w+1 .. s+c-1, which start anywhere in a block: at most
        ceil((w + c - 2) / bs) + 1 blocks. bs 4, w 6, chunk 4: ceil(8 / 4) + 1 = 3 (s = 7 reads
        2..10, blocks 0, 1, 2).
        """
        num_all = ceil_div(num_tokens, self.block_size)
        if self.window is None:
            return num_all
        return min(num_all, ceil_div(self.window + max(max_chunk, 1) - 2, self.block_size) + 1)

    def why_never_fits(self, num_prompt_tokens: int, max_chunk: int, num_blocks: int) -> str | None:
        """Why a prompt (and room for its first token) could never run alone in a cache of
        `num_blocks` blocks, as the error its request ends with; None if it fits."""
        peak = self.peak_blocks(num_prompt_tokens + 1, max_chunk)
        if peak <= num_blocks:
            return None
        if self.window is None:
            return (f"the prompt needs {num_prompt_tokens} tokens of KV cache but the whole cache holds "
                    f"{num_blocks * self.block_size}")
        return (f"a step of this prompt needs {peak} KV cache blocks at once (sliding window {self.window}, "
                f"chunks of up to {max_chunk} tokens) but the whole cache holds {num_blocks}")
