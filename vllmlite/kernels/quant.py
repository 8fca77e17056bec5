"""Weight-only quantized matrices: int8 and int4 in blocks of 32 along the input dimension.

The block formats are GGUF's, so a GGUF tensor already stored in one of them is used as stored:

    int8  symmetric, like Q8_0:  w = scale * q,        q int8 in [-127, 127]
          or affine:             w = scale * q + min,  q int8 in [-128, 127]
    int4  affine,    like Q4_1:  w = scale * q + min,  q in [0, 15], two per byte

Float weights are rounded to the affine forms (`quantize_rows`): the block's range [low, high]
spread over all 256 or 16 levels. For int8, a block takes Q8_0's symmetric grid (min 0) instead
where that fits it better, so a block is never rounded more coarsely than Q8_0 would, and weights
that were decoded from Q4_0/Q4_1/Q8_0 blocks (an F32 copy of such a GGUF) come back as they were,
to float rounding. Q8_0 tensors as a GGUF stores them have no mins.

Packing follows ggml: in each block of 32, int4 byte j holds element j in its low nibble and
element j + 16 in its high nibble. Q4_0 (w = scale * (q - 8)) is int4 with min = -8 * scale.
Scales and mins are float32 here (GGUF stores float16; widening is exact).

Two forms:

- `BlockRows`: row-major blocks as GGUF stores them, qs [rows, blocks, 32 or 16]. The loader
  reorders and stacks rows in this form (undoing llama.cpp's Q/K permutation, fusing QKV).
- `QuantizedMatrix`: what the kernels read. Rows are grouped in tiles of TILE, and within a tile
  the TILE rows' bytes for one (block, byte position) sit side by side:
  qs[tile, block, j, lane] is byte j of `block` in row tile * TILE + lane. A kernel's innermost
  loop then runs over the TILE rows with unit stride: one weight byte per row, one activation
  value broadcast to all of them (llama.cpp repacks Q4_0 the same way for its x86/ARM GEMV),
  and a tile is read front to back, one stream the hardware prefetcher follows (with the byte
  position outermost, the 16 streams of a tile ran at a quarter of the memory bandwidth).
  Scales and mins are [tile, block, lane]. Rows past the matrix's last (padding) are zero.

Going from one form to the other reorders bytes; nothing is rounded. `dequantize` is the
readable definition of what a quantized matrix means; the kernels multiply by the packed bytes
without building the float matrix (vllmlite/kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

BLOCK = 32
TILE = 64  # rows per tile of a QuantizedMatrix
FORMATS = ("int8", "int4")
ROUNDING_ROWS = 4096  # rows rounded at a time by `quantize_rows`


@dataclass(frozen=True)
class BlockRows:
    """A [rows, cols] matrix as row-major blocks: qs int8 [rows, blocks, 32] or uint8 [rows,
    blocks, 16] (packed nibbles), scales and mins float32 [rows, blocks] (mins None: symmetric int8)."""

    format: str
    qs: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    def take(self, index) -> BlockRows:
        """The rows `index` selects (a slice or an index array), in that order."""
        return BlockRows(self.format, self.qs[index], self.scales[index],
                         None if self.mins is None else self.mins[index])

    @staticmethod
    def concat(parts: list[BlockRows]) -> BlockRows:
        """Stack matrices of one format row-wise (e.g. Q, K and V into one QKV matrix)."""
        fmt = parts[0].format
        if any(p.format != fmt for p in parts):
            raise ValueError(f"cannot stack matrices stored in different formats {[p.format for p in parts]}")
        mins = None
        if any(p.mins is not None for p in parts):   # a symmetric part has mins of zero
            mins = np.concatenate([np.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
        return BlockRows(fmt, np.concatenate([p.qs for p in parts]), np.concatenate([p.scales for p in parts]), mins)


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] matrix in tiles of TILE rows (see the module docstring)."""

    format: str               # "int8" or "int4"
    num_rows: int
    qs: np.ndarray            # int8 [tiles, blocks, 32, TILE] or uint8 [tiles, blocks, 16, TILE]
    scales: np.ndarray        # float32 [tiles, blocks, TILE]
    mins: np.ndarray | None   # float32 [tiles, blocks, TILE]; None for symmetric int8 (Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.scales.shape[1] * BLOCK

    @property
    def size(self) -> int:
        return self.num_rows * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes + (self.mins.nbytes if self.mins is not None else 0)

    @cached_property
    def grouped_qs(self) -> np.ndarray:
        """qs regrouped for 4-byte integer dot products (VNNI's vpdpbusd: unsigned bytes times signed
        ones, each 4 summed into a 32-bit lane; AVX2's vpmaddubsw reads the same lanes): uint8 [tiles, blocks, bytes / 4, TILE, 4], where
        [t, b, g, lane, k] is qs[t, b, 4g + k, lane], offset by 128 for int8 (so unsigned: q + 128).
        Made on the first integer product that reads it (vllmlite/kernels/numba/byte_dots.py), then kept:
        as many bytes again as qs, not counted in nbytes."""
        tiles, blocks, num_bytes = self.qs.shape[:3]
        grouped = self.qs.reshape(tiles, blocks, num_bytes // 4, 4, TILE).transpose(0, 1, 2, 4, 3)
        grouped = np.ascontiguousarray(grouped).view(np.uint8)
        return grouped if self.format == "int4" else grouped ^ np.uint8(128)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {FORMATS}, got {fmt!r}")


def quantize_rows(weight: np.ndarray, fmt: str) -> BlockRows:
    """Round a float [rows, cols] matrix to `fmt`, block by block (round to nearest)."""
    _check_format(fmt)
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"quantization needs the input dimension to be a multiple of {BLOCK}, got {cols}")
    if rows > ROUNDING_ROWS:   # a few float32 temporaries of this size each, not of the whole matrix
        return BlockRows.concat([quantize_rows(weight[i:i + ROUNDING_ROWS], fmt) for i in range(0, rows, ROUNDING_ROWS)])
    blocks = weight.astype(np.float32).reshape(rows, cols // BLOCK, BLOCK)
    levels = 255 if fmt == "int8" else 15
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scales = (high - low) / levels
    q = np.clip(np.rint((blocks - low[..., None]) / _nonzero(scales)[..., None]), 0, levels)
    if fmt == "int4":
        return BlockRows("int4", pack_nibbles(q.astype(np.uint8)), scales, low)
    # int8: levels 0..255 stored as -128..127, the min moved up by 128 steps; a block that
    # Q8_0's symmetric grid fits better (one decoded from Q8_0 sits on it exactly) takes that
    # grid instead, with a min of 0.
    q, mins = q - 128, low + 128 * scales
    sym_scales = np.abs(blocks).max(axis=-1) / 127
    sym_q = np.clip(np.rint(blocks / _nonzero(sym_scales)[..., None]), -127, 127)
    error = ((q * scales[..., None] + mins[..., None] - blocks) ** 2).sum(axis=-1)
    sym_error = ((sym_q * sym_scales[..., None] - blocks) ** 2).sum(axis=-1)
    symmetric = sym_error <= error
    return BlockRows("int8", np.where(symmetric[..., None], sym_q, q).astype(np.int8),
                     np.where(symmetric, sym_scales, scales), np.where(symmetric, np.float32(0), mins))


def _nonzero(scales: np.ndarray) -> np.ndarray:
    """Scales to divide by: an all-equal block has scale 0 (its weight is then all in the min, or 0)."""
    return np.where(scales == 0, 1, scales)


def quantize(weight: np.ndarray, fmt: str) -> QuantizedMatrix:
    return tile(quantize_rows(weight, fmt))


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] values in [0, 15] -> [..., 16] bytes: element j low, element j + 16 high."""
    return q[..., :16] | (q[..., 16:] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values in [0, 15]."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def tile(m: BlockRows) -> QuantizedMatrix:
    """Group the rows in tiles of TILE, padding the last tile with zero rows."""
    rows = m.qs.shape[0]
    num_tiles = -(-rows // TILE)

    def tiled(a: np.ndarray) -> np.ndarray:   # [rows, blocks, ...] -> [tiles, blocks, ..., TILE]
        padded = np.zeros((num_tiles * TILE,) + a.shape[1:], a.dtype)
        padded[:rows] = a
        return np.ascontiguousarray(np.moveaxis(padded.reshape(num_tiles, TILE, *a.shape[1:]), 1, -1))
    return QuantizedMatrix(m.format, rows, tiled(m.qs), tiled(m.scales),
                           None if m.mins is None else tiled(m.mins))


def untile(m: QuantizedMatrix) -> BlockRows:
    """The row-major blocks of `m` (the inverse of `tile`)."""
    def rows(a: np.ndarray) -> np.ndarray:   # [tiles, blocks, ..., TILE] -> [rows, blocks, ...]
        flat = np.moveaxis(a, -1, 1)
        return flat.reshape(-1, *flat.shape[2:])[:m.num_rows]
    return BlockRows(m.format, rows(m.qs), rows(m.scales), None if m.mins is None else rows(m.mins))


def scale_rows(m: np.ndarray | QuantizedMatrix, factor: float, num_rows: int | None = None
               ) -> np.ndarray | QuantizedMatrix:
    """A copy of `m` with its first `num_rows` rows (all by default) times `factor`: a quantized
    matrix scales those rows' block scales and mins, its integers untouched."""
    if not isinstance(m, QuantizedMatrix):
        out = m.copy()
        out[:num_rows] *= factor
        return out
    rows = untile(m)
    scales = rows.scales.copy()
    scales[:num_rows] *= factor
    mins = None
    if rows.mins is not None:
        mins = rows.mins.copy()
        mins[:num_rows] *= factor
    return tile(BlockRows(rows.format, rows.qs, scales, mins))


def dequantize_block_rows(m: BlockRows) -> np.ndarray:
    """The float32 [rows, cols] matrix that `m` stands for."""
    rows, num_blocks = m.scales.shape
    if m.format == "int8":
        blocks = m.qs.astype(np.float32) * m.scales[..., None]
        if m.mins is not None:
            blocks += m.mins[..., None]
    else:
        blocks = unpack_nibbles(m.qs).astype(np.float32) * m.scales[..., None] + m.mins[..., None]
    return blocks.reshape(rows, num_blocks * BLOCK)


def dequantize(m: QuantizedMatrix, rows: np.ndarray | None = None) -> np.ndarray:
    """The float32 matrix that `m` stands for, or only its `rows` (an index array: embedding lookup)."""
    if rows is None:
        return dequantize_block_rows(untile(m))
    tiles, lanes = np.divmod(np.asarray(rows), TILE)
    picked = BlockRows(m.format, m.qs[tiles, :, :, lanes], m.scales[tiles, :, lanes],
                       None if m.mins is None else m.mins[tiles, :, lanes])
    return dequantize_block_rows(picked)


# GGUF block layouts (ggml-common.h): float16 scale (and min), then the quants.
_GGUF_BLOCKS = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
}
GGUF_TYPES = tuple(_GGUF_BLOCKS)


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockRows:
    """A GGUF tensor's raw bytes (Q8_0, Q4_0 or Q4_1), [rows, cols] in numpy order, as stored."""
    if type_name not in _GGUF_BLOCKS:
        raise ValueError(f"GGUF type {type_name} is not int8/int4 blocks ({sorted(_GGUF_BLOCKS)})")
    rows, cols = shape
    blocks = np.ascontiguousarray(data).view(_GGUF_BLOCKS[type_name]).reshape(rows, cols // BLOCK)
    scales = blocks["d"].astype(np.float32)
    if type_name == "Q8_0":
        return BlockRows("int8", blocks["qs"], scales, None)
    mins = blocks["m"].astype(np.float32) if type_name == "Q4_1" else -8 * scales
    return BlockRows("int4", blocks["qs"], scales, mins)
