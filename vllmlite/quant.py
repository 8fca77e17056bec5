"""Weight-only quantized matrices: int8 and int4 in blocks of 32 along the input dimension.

The layouts are GGUF's, so a GGUF tensor already stored in one of them is used as stored:

    int8  symmetric, like Q8_0:  w = scale * q,        q int8 in [-127, 127]
    int4  affine,    like Q4_1:  w = scale * q + min,  q in [0, 15], two per byte

Packing follows ggml: in each block of 32, int4 byte j holds element j in its low nibble and
element j + 16 in its high nibble. Q4_0 (w = scale * (q - 8)) is int4 with min = -8 * scale.
Scales and mins are float32 here (GGUF stores float16; widening is exact).

The quants are kept position-major: qs[row, j, block] is the j-th byte (int4) or value (int8) of
each block, so a kernel's innermost loop runs over blocks with unit stride and no sum across lanes
per block (a prototype measured 25 ms against 37 ms in ggml's block-major order for the default
model's 30 layers, one token, 2 AVX2 cores). Reading a GGUF tensor reorders its bytes; nothing is
rounded.

`dequantize` is the readable definition of what a quantized matrix means; the kernels multiply by
the packed bytes without building the float matrix (see vllmlite/kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
FORMATS = ("int8", "int4")


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] matrix in blocks of BLOCK along cols (cols a multiple of BLOCK)."""

    format: str               # "int8" or "int4"
    qs: np.ndarray            # int8 [rows, 32, blocks] or uint8 [rows, 16, blocks] (packed nibbles)
    scales: np.ndarray        # float32 [rows, blocks]
    mins: np.ndarray | None   # float32 [rows, blocks] for int4, None for int8

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes + (self.mins.nbytes if self.mins is not None else 0)

    def rows(self, index) -> QuantizedMatrix:
        """The rows `index` selects (a slice, an index array): rows are independent of each other."""
        return QuantizedMatrix(self.format, self.qs[index], self.scales[index],
                               None if self.mins is None else self.mins[index])


def _blocks(weight: np.ndarray) -> np.ndarray:
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"quantization needs the input dimension to be a multiple of {BLOCK}, got {cols}")
    return weight.astype(np.float32).reshape(rows, cols // BLOCK, BLOCK)


def quantize(weight: np.ndarray, fmt: str) -> QuantizedMatrix:
    """Round a float [rows, cols] matrix to `fmt`, block by block (round to nearest)."""
    blocks = _blocks(weight)
    if fmt == "int8":
        scales = np.abs(blocks).max(axis=-1) / 127
        safe = np.where(scales == 0, 1, scales)[..., None]
        qs = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
        return QuantizedMatrix("int8", _position_major(qs), scales.astype(np.float32), None)
    if fmt == "int4":
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        scales = (high - low) / 15
        safe = np.where(scales == 0, 1, scales)[..., None]
        q = np.clip(np.rint((blocks - low[..., None]) / safe), 0, 15).astype(np.uint8)
        return QuantizedMatrix("int4", pack_nibbles(q), scales.astype(np.float32), low.astype(np.float32))
    raise ValueError(f"quantization must be one of {FORMATS}, got {fmt!r}")


def _position_major(blocks: np.ndarray) -> np.ndarray:
    """[rows, blocks, k] (block-major, as GGUF stores them) -> [rows, k, blocks]."""
    return np.ascontiguousarray(blocks.transpose(0, 2, 1))


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[rows, blocks, 32] values in [0, 15] -> [rows, 16, blocks] bytes: element j low, j + 16 high."""
    return _position_major(q[..., :16] | (q[..., 16:] << 4))


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, 16, blocks] bytes -> [rows, blocks, 32] values in [0, 15]."""
    packed = qs.transpose(0, 2, 1)
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def dequantize(m: QuantizedMatrix) -> np.ndarray:
    """The float32 [rows, cols] matrix that `m` stands for."""
    rows, cols = m.shape
    if m.format == "int8":
        blocks = m.qs.transpose(0, 2, 1).astype(np.float32) * m.scales[..., None]
    else:
        blocks = unpack_nibbles(m.qs).astype(np.float32) * m.scales[..., None] + m.mins[..., None]
    return blocks.reshape(rows, cols)


# GGUF block layouts (ggml-common.h): float16 scale (and min), then the quants.
_GGUF_BLOCKS = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
}


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedMatrix:
    """A GGUF tensor's raw bytes (Q8_0, Q4_0 or Q4_1), [rows, cols] in numpy order, as stored."""
    if type_name not in _GGUF_BLOCKS:
        raise ValueError(f"GGUF type {type_name} is not int8/int4 blocks ({sorted(_GGUF_BLOCKS)})")
    rows, cols = shape
    blocks = np.ascontiguousarray(data).view(_GGUF_BLOCKS[type_name]).reshape(rows, cols // BLOCK)
    scales = blocks["d"].astype(np.float32)
    qs = _position_major(blocks["qs"])                           # [rows, 32 or 16, blocks]
    if type_name == "Q8_0":
        return QuantizedMatrix("int8", qs, scales, None)
    mins = blocks["m"].astype(np.float32) if type_name == "Q4_1" else -8 * scales
    return QuantizedMatrix("int4", qs, scales, mins)


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Stack matrices of one format row-wise (e.g. Q, K and V into one QKV matrix)."""
    fmt = parts[0].format
    if any(p.format != fmt for p in parts):
        raise ValueError("cannot stack matrices of different formats")
    return QuantizedMatrix(fmt, np.concatenate([p.qs for p in parts]), np.concatenate([p.scales for p in parts]),
                           None if fmt == "int8" else np.concatenate([p.mins for p in parts]))
