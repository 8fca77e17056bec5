"""Paged attention in Triton for the short queries of a step (decodes, speculative verification):
each query token reads its own sequence's keys and values straight from the paged cache through
the block table, never gathering a copy. float32 products run in full float32 ("ieee", not TF32),
so greedy tokens match the CPU paths; bfloat16 and float16 ones on the tensor cores.

One program per (query token, KV head): it holds that KV head's group of query heads as one
[GROUP, head_dim] tile (grouped-query attention without repeating K/V), walks the context in
tiles of BLOCK_N positions (each position's page looked up in the block table, so BLOCK_N is
independent of the block size), and keeps an online softmax in float32. A query at position p
sees keys 0..p of its sequence, which is also the causal mask inside a multi-token query.

Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (the tests' way to check it without a GPU).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context positions per tile


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, rows_ptr, seq_of_row_ptr, positions_ptr,
                            block_tables_ptr, scale,
                            stride_q_tok, stride_q_head, stride_q_d, stride_o_tok, stride_o_head, stride_o_d,
                            stride_bt_seq, block_size, num_kv_heads,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)                           # the query's row in q and out
    seq = tl.load(seq_of_row_ptr + i)
    num_keys = tl.load(positions_ptr + i) + 1                          # keys 0..position
    g = tl.arange(0, GROUP_PAD)                                        # [GROUP_PAD] query heads of this KV head
    d = tl.arange(0, HEAD_PAD)                                         # [HEAD_PAD] (a power of 2, >= 16)
    d_valid = d < HEAD_DIM
    head = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & d_valid[None, :]
    q = tl.load(q_ptr + row * stride_q_tok + head[:, None] * stride_q_head + d[None, :] * stride_q_d,
                mask=q_mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)                # running max
    denom = tl.zeros([GROUP_PAD], tl.float32)                          # running sum of exp
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                              # [BLOCK_N] context positions
        valid = n < num_keys
        block_id = tl.load(block_tables_ptr + seq * stride_bt_seq + n // block_size, mask=valid, other=0)
        slot = block_id.to(tl.int64) * block_size + n % block_size
        kv_offset = (slot[:, None] * num_kv_heads + kv_head) * HEAD_DIM + d[None, :]   # [BLOCK_N, HEAD_PAD]
        kv_mask = valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale   # [GROUP_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + row * stride_o_tok + head[:, None] * stride_o_head + d[None, :] * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                         seq_of_row: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                         block_size: int, out: torch.Tensor) -> None:
    """out[rows] = attention of q[rows] over their sequences' paged context, written in place.

    q, out [num_tokens, heads, head_dim], any strides; caches [slots, kv_heads, head_dim] contiguous; rows [num_rows] the query rows to compute;
    seq_of_row, positions [num_rows] each row's sequence (a block-table row) and position;
    block_tables [num_seqs, max_blocks] int.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(len(rows), num_kv_heads)](
        q, k_cache, v_cache, out, rows, seq_of_row, positions, block_tables, 1.0 / math.sqrt(head_dim),
        *q.stride(), *out.stride(), block_tables.stride(0), block_size, num_kv_heads,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # float32 exact, as the references; half: tensor cores
