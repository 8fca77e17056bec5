"""The KV cache's storage dtype (vLLM's kv_cache_dtype) for the numpy-memory backends.

`auto` keeps K and V as plain arrays of the model's dtype, as before. Any other dtype stores one
layer's K (or V) as a `PackedKV`: `data` [num_slots, kv_heads, head_dim] in the storage dtype and,
for int8, `scales` [num_slots, kv_heads, groups] float32, indexed by the same slots as the data:

  fp16  numpy float16 (round to nearest); reads widen exactly.
  bf16  uint16, the top half of each float32 (numpy has no bfloat16), rounded to nearest even;
        reads put the half back on top of 16 zero bits.
  int8  symmetric, one float32 scale per (token, KV head, group of INT8_GROUP elements of head_dim,
        or the whole head when head_dim is no multiple of it): scale = max |x| over the group / 127,
        q = rint(x / scale) in [-127, 127], read as q * scale, so |x - read| <= scale / 2 per element.
        Groups of 16 (half llama.cpp's Q8_0 blocks), of K and V turned as below: on the default model,
        32-token greedy continuations of 80 prompts identical to float32 K/V's (`python -m
        bench.kv_agreement`, results/kv_agreement.json): groups of 32 unturned 59, turned 67, groups
        of 16 turned 73, groups of 64 turned 64. On the 13 parity prompts alone one prompt is 8% and
        float rounding moves it: groups of 32 scored 10, and 12 turned in a first try whose q R was
        rounded otherwise.

int8 stores K and V turned by an orthogonal matrix R over head_dim (`rotation`: a normalized
Hadamard matrix, or its blocks where head_dim is no power of two), as QuaRot does for its 4-bit
caches: a channel far larger than the rest is spread over all of them, so the group scales step
finer. Attention does not change under a rotation of q, K and V together: the backends' write_kv
stores k R and v R (`storing`), their paged_attention attends with q R and turns the output back
by R^T (`attending`; the numba backend does both inside its write_kv and paged_attention), and
the kernels in between are the ones every dtype uses. So a PackedKV's
int8 values are k R, not k. As four 64 x 64 products a layer the turns cost a 32 x 512 decode step of
the default model about 4 ms, 6% of its matrix products' time (results/kv_rotation_step.json); as
butterflies (`turn`, and numba/hadamard.py) about 1.4 ms (results/kv_turn_butterflies.json).

Attention over int8 K rounds each head's query to 16 bits (`round_queries`, in `attending`; the
numba backend inside its paged_attention), so that q . k is a sum of integer products, each group's
scaled once: the numba decode kernel multiplies them as integers where the CPU has AVX-512 VNNI
(numba/key_products.py). Every path (decode, short queries, prefill tiles, the reference) attends
with the same rounded q, so chunking and batching still never change a token. 8-bit queries, one
VNNI instruction where 16-bit ones take two, kept 9 of the 13 parity prompts' greedy tokens where
float queries kept 12; 16-bit ones keep 12 (results/kv_int_scores_avx512.json).

Why per token (and head and group), not per block: a token's stored K/V depends on that token alone. A write
never touches earlier tokens (no requantizing a block's earlier tokens when a larger value comes,
which would change K/V earlier steps already attended to, and make the cache depend on how a prompt
was chunked), so prefix caching, recompute after preemption and chunked prefill all store the same
bytes, and copy-on-write and swaps copy the scales with their slots (`copy_slots`). The cost is
4 bytes per (token, KV head, group) for K and for V: with head_dim 64, 80 bytes against float32's
256 (3.2x smaller), and the same ratio at 128; `kv_bytes_per_token` counts them.

Reading: the reference gathers a group's blocks and widens them (`gather_blocks`); the numba
backend's attention kernels widen each block as they reach it, into scratch that stays in cache
(numba/kv_read.py), or for int8 decodes in registers inside the products (numba/block_products.py),
so int8 reads about a quarter of float32's bytes.
The torch backend stores `auto` (config.py refuses the packed kinds there, naming kv_cache_dtype,
except the half dtype it computes in, which is what auto stores) and `fp8`, which only it stores:

  fp8   float8 e4m3 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, finite to +-448), one
        byte an element and no scale (vLLM's default scale of 1.0): x is clipped to +-448 and
        rounded to nearest even; the kernels widen it to the compute dtype as they read (torch's
        TorchKernels.write_kv and paged_attention, the Triton kernels). Half of bf16's bytes, so
        twice the blocks in the same memory and half the bytes a decode reads. Per token like the
        others: prefix caching, chunking and preemption store the same bytes.
"""

from __future__ import annotations

import functools

import numpy as np

STORAGE = {"fp16": np.float16, "bf16": np.uint16, "int8": np.int8}
BACKEND_KINDS = {"fp8": 1}   # kinds stored as the backend's own arrays (not PackedKV), with their itemsize
FP8_MAX = 448.0   # e4m3's largest finite value: fp8 clips to it
SCALE_BYTES = 4   # one float32 scale per (token, KV head, group), int8 only
INT8_MAX = 127
INT8_GROUP = 16   # elements of head_dim sharing one int8 scale
QUERY_MAX = 32767   # attention over int8 K rounds each head's query to 16 bits (`round_queries`)


def int8_groups(head_dim: int) -> int:
    """Scales per (token, KV head) in int8: head_dim / INT8_GROUP, or 1 if it does not divide."""
    return head_dim // INT8_GROUP if head_dim % INT8_GROUP == 0 else 1


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kind: str, model_itemsize: int) -> int:
    """Bytes of K and V (scales included) one token holds across all layers."""
    itemsize = model_itemsize if kind == "auto" else BACKEND_KINDS.get(kind) or np.dtype(STORAGE[kind]).itemsize
    per_head = head_dim * itemsize
    per_head += SCALE_BYTES * int8_groups(head_dim) if kind == "int8" else 0
    return 2 * num_layers * num_kv_heads * per_head


class PackedKV:
    """One layer's K or V in a storage dtype other than the compute dtype (module docstring)."""

    def __init__(self, kind: str, shape: tuple[int, int, int]) -> None:
        self.kind = kind
        self.data = np.zeros(shape, STORAGE[kind])   # numpy's zeros map pages lazily
        self.scales = np.zeros((*shape[:2], int8_groups(shape[2])), np.float32) if kind == "int8" else None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def store(self, slots: np.ndarray, x: np.ndarray) -> None:
        """x [tokens, kv_heads, head_dim] into `slots`."""
        data, scales = encode(self.kind, x)
        self.data[slots] = data
        if scales is not None:
            self.scales[slots] = scales

    def read(self, slots, dtype=np.float32) -> np.ndarray:
        """The values at `slots` (any numpy index of the slot axis), widened to `dtype`."""
        return decode(self.kind, self.data[slots], None if self.scales is None else self.scales[slots], dtype)


def make_kv(kind: str, shape: tuple[int, int, int], zeros, dtype):
    """One layer's K (or V) cache: the backend's own array, zeros(shape, dtype) for auto and
    zeros(shape, kind) for a kind of BACKEND_KINDS (the backend names its dtype), else a PackedKV."""
    if kind == "auto" or kind in BACKEND_KINDS:
        return zeros(shape, dtype if kind == "auto" else kind)
    return PackedKV(kind, shape)


def encode(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """x [..., head_dim] as stored: (data, scales [...] or None)."""
    x = np.asarray(x, dtype=np.float32)
    if kind == "fp16":
        return x.astype(np.float16), None
    if kind == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16), None   # round to nearest even
    num_groups = int8_groups(x.shape[-1])
    groups = x.reshape(*x.shape[:-1], num_groups, x.shape[-1] // num_groups)             # [..., G, g]
    scales = np.abs(groups).max(axis=-1) / np.float32(INT8_MAX)                          # [..., G]
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(groups / safe[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q.reshape(x.shape), scales.astype(np.float32)


def decode(kind: str, data: np.ndarray, scales: np.ndarray | None, dtype=np.float32) -> np.ndarray:
    """Stored values back in `dtype`: encode's inverse up to its rounding."""
    if kind == "fp16":
        return data.astype(dtype)
    if kind == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)
    num_groups = scales.shape[-1]
    groups = data.reshape(*data.shape[:-1], num_groups, data.shape[-1] // num_groups).astype(np.float32)
    return (groups * scales[..., None]).reshape(data.shape).astype(dtype, copy=False)


def write(k_cache: PackedKV, v_cache: PackedKV, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """write_kv for packed caches."""
    k_cache.store(slot_mapping, k)
    v_cache.store(slot_mapping, v)


def copy_slots(src: PackedKV, dst: PackedKV, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    """The data and the scales of src_slots into dst_slots (copy-on-write, swap out and in)."""
    dst.data[dst_slots] = src.data[src_slots]
    if src.scales is not None:
        dst.scales[dst_slots] = src.scales[src_slots]


@functools.cache
def rotation(head_dim: int, dtype=np.float32) -> np.ndarray | None:
    """The orthogonal R [head_dim, head_dim] int8 K/V are stored under: Sylvester's Hadamard matrix
    over 1/sqrt(n), n the largest power of two dividing head_dim (block diagonal if n < head_dim);
    None where n is 1 (odd head_dim: stored unturned)."""
    n = head_dim & -head_dim
    if n == 1:
        return None
    block = np.ones((1, 1))
    while len(block) < n:
        block = np.block([[block, block], [block, -block]])
    return np.kron(np.eye(head_dim // n), block / np.sqrt(n)).astype(dtype)


def turn(x: np.ndarray) -> np.ndarray:
    """x [..., head_dim] @ rotation(head_dim) as butterflies (a fast Walsh-Hadamard transform): steps 1,
    2, 4, ..., n / 2, each replacing the pair (j, j + step) within blocks of 2 * step by their sum
    and difference, then the scale 1 / sqrt(n): 6 additions an element at n = 64 where the product
    takes 64 multiply-adds. The numba backend (numba/hadamard.py) keeps this order, bit for bit.
    A new array; x itself where the rotation is None."""
    head_dim = x.shape[-1]
    n = head_dim & -head_dim
    if n == 1:
        return x
    y, step = x.reshape(-1, head_dim), 1
    while step < n:
        pairs = y.reshape(len(y), head_dim // (2 * step), 2, step)
        y = np.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), axis=2).reshape(len(y), head_dim)
        step *= 2
    return (y * x.dtype.type(1 / np.sqrt(n))).reshape(x.shape)


def turned(cache) -> bool:
    """Whether `cache` stores turned K/V (int8's)."""
    return isinstance(cache, PackedKV) and cache.kind == "int8"


def storing(write_kv):
    """A backend's write_kv that stores k R and v R in an int8 cache (module docstring); with
    unturned=True it stores them as they are (what the tests measure the rotation against)."""
    @functools.wraps(write_kv)
    def write(k_cache, v_cache, k, v, slot_mapping, unturned: bool = False) -> None:
        if turned(k_cache) and not unturned:
            k, v = turn(k), turn(v)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
    return write


def rounds_queries(cache) -> bool:
    """Whether attention over `cache` as K rounds its queries (`round_queries`): int8's does."""
    return isinstance(cache, PackedKV) and cache.kind == "int8"


def round_queries(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [..., head_dim] -> (integers int16 [..., head_dim], scales float32 [...]): each head's query
    rounded to 16 bits: with m = max |q| over the head, scale = m / QUERY_MAX and integers =
    rint(q * (QUERY_MAX / m)) (a product, not q / scale: the compiled rounding then takes one
    division a head, not one an element), all 0 where m is 0. Over an int8 K cache attention uses
    integers * scale for q (`attending`), so that q . k is a sum of integer products scaled per
    group, which the numba backend multiplies as integers (numba/key_products.py)."""
    q = np.asarray(q, dtype=np.float32)
    top = np.abs(q).max(axis=-1)
    inverse = np.float32(QUERY_MAX) / np.where(top > 0, top, np.float32(QUERY_MAX))   # 1 where m is 0
    ints = np.clip(np.rint(q * inverse[..., None]), -QUERY_MAX, QUERY_MAX).astype(np.int16)
    return ints, top / np.float32(QUERY_MAX)


def rounded_queries(q: np.ndarray) -> np.ndarray:
    """The queries attention uses over an int8 K cache: `round_queries`' integers times their scales, in q's dtype."""
    ints, scales = round_queries(q)
    return (ints * scales[..., None]).astype(q.dtype, copy=False)


def attending(paged_attention):
    """A backend's paged_attention over an int8 cache: with q R rounded to 16 bits a head
    (`rounded_queries`), its output turned back by R^T = R (R is symmetric); unturned=True as
    `storing`'s (q rounded, not turned)."""
    @functools.wraps(paged_attention)
    def attend(q, k_cache, v_cache, meta, out, unturned: bool = False, **options) -> None:
        turning = turned(k_cache) and not unturned
        q = turn(q) if turning else q
        paged_attention(rounded_queries(q) if rounds_queries(k_cache) else q, k_cache, v_cache, meta, out, **options)
        if turning:
            out[...] = turn(out)
    return attend


def gather_blocks(cache, block_ids: np.ndarray, block_size: int, dtype) -> np.ndarray:
    """cache's blocks `block_ids` (any shape of ids) as [*ids.shape, block_size, kv_heads, head_dim] in
    `dtype`: a plain cache indexed, a packed one widened."""
    num_slots, num_kv_heads, head_dim = cache.shape
    if not isinstance(cache, PackedKV):
        return cache.reshape(-1, block_size, num_kv_heads, head_dim)[block_ids]
    data = cache.data.reshape(-1, block_size, num_kv_heads, head_dim)[block_ids]
    scales = None if cache.scales is None else \
        cache.scales.reshape(-1, block_size, num_kv_heads, cache.scales.shape[-1])[block_ids]
    return decode(cache.kind, data, scales, dtype)
