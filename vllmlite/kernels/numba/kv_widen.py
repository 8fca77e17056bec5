"""The numba backend's reading of packed KV caches (kv_cache_dtype fp16, bf16, int8; the format is
vllmlite/kernels/kv_dtype.py's): the blocks a step's tables name, widened in one compiled pass into
buffers the step's first layer allocates and every layer reuses, for the unchanged attention
kernels to read with the tables renumbered. Numba has no float16, so 16-bit values are looked up in
a table of all 65,536 (256 KB, cache resident) instead.

SmolLM2, one decode pass of 8 sequences of 512 tokens on 2 busy cores (rough, whole-model timings):
numpy's gather, cast and scale into fresh arrays made int8 K/V 260 ms against float32's 87; this pass
into reused buffers, 84 against 92 (noise: about float32's time).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllmlite.kernels.attention_metadata import AttentionMetadata
from vllmlite.kernels.kv_dtype import PackedKV, renumbered_metadata
from vllmlite.kernels.numba.jit import parallel

# Every 16-bit pattern's float32 value, as fp16 and as bf16 (the top half of a float32).
_BITS = np.arange(1 << 16, dtype=np.uint32)
TABLES = {"fp16": _BITS.astype(np.uint16).view(np.float16).astype(np.float32),
          "bf16": (_BITS << 16).view(np.float32)}


@parallel
def _widen_16(data, table, block_ids, block_size, out):  # pragma: no cover - compiled
    """out[b * bs + t] = table[data[block_ids[b] * bs + t]]: data [slots, kv, d] uint16 bits."""
    for b in prange(block_ids.shape[0]):
        first, base = block_ids[b] * block_size, b * block_size
        for t in range(block_size):
            for h in range(data.shape[1]):
                for i in range(data.shape[2]):
                    out[base + t, h, i] = table[data[first + t, h, i]]


@parallel
def _widen_int8(data, scales, block_ids, block_size, out):  # pragma: no cover - compiled
    """out[b * bs + t] = data[s] * scales[s] (per KV head and group), s = block_ids[b] * bs + t."""
    group = data.shape[2] // scales.shape[2]
    for b in prange(block_ids.shape[0]):
        first, base = block_ids[b] * block_size, b * block_size
        for t in range(block_size):
            for h in range(data.shape[1]):
                for g in range(scales.shape[2]):
                    scale = scales[first + t, h, g]
                    for i in range(g * group, (g + 1) * group):
                        out[base + t, h, i] = data[first + t, h, i] * scale


def widen_step(k_cache: PackedKV, v_cache: PackedKV, meta: AttentionMetadata, dtype):
    """kv_dtype.widen_step, compiled: (k, v, renumbered metadata), k and v in buffers of the step."""
    renumbered = renumbered_metadata(meta)
    block_ids = renumbered.kernel_cache["kv_dtype block_ids"]
    shape = (len(block_ids) * meta.block_size, *k_cache.shape[1:])
    key = f"kv_dtype widened {np.dtype(dtype).name}"
    buffers = meta.kernel_cache.get(key)
    if buffers is None or buffers[0].shape != shape:
        buffers = meta.kernel_cache[key] = (np.empty(shape, dtype), np.empty(shape, dtype))
    for cache, out in zip((k_cache, v_cache), buffers):
        if cache.kind == "int8":
            _widen_int8(cache.data, cache.scales, block_ids, meta.block_size, out)
        else:
            _widen_16(cache.data.view(np.uint16), TABLES[cache.kind], block_ids, meta.block_size, out)
    return buffers[0], buffers[1], renumbered
