"""A GGUF file's metadata and tensors, read straight from the bytes.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array before anything
can be read: 19 s for a 262k-token vocabulary (Gemma 3's) on one core, paid on every load. Here
metadata values come out as Python values in one pass (strings decoded, numeric arrays through
numpy), about 0.3 s for the same file, and tensors are views into one read-only memory map, shaped
as GGUFReader shapes them (quantized types as bytes), so `gguf.quants.dequantize` reads them as is.
Knows the GGUF format (version 2 and 3, little-endian) and nothing of models or tokenizers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types: id -> struct format of a scalar (8 = string, 9 = array, handled apart).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# Tensor types numpy can hold as they are stored; every other type is viewed as its bytes.
PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """The attributes of `gguf.ReaderTensor` the loaders read."""

    name: str
    tensor_type: Any          # gguf.GGMLQuantizationType
    shape: tuple[int, ...]    # GGUF order: innermost dimension first
    data: np.ndarray          # numpy order (reversed shape); quantized types as [..., bytes per row]


class GGUFFile:
    """`fields`: every metadata key -> its Python value (str, int, float, bool, or a list of them).
    `tensors`: name -> GGUFTensor, in file order. Raises ValueError for anything not a GGUF file we read."""

    def __init__(self, path: str | PathLike[str]) -> None:
        self.path = str(path)
        self._data = np.memmap(path, mode="r")
        self._buffer = memoryview(self._data)
        if bytes(self._buffer[:4]) != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self._offset = 4
        version = self._scalar("I")
        if version not in VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported ({VERSIONS}; a version "
                             "with the low bytes zero is a big-endian file, which is not supported either)")
        num_tensors, num_fields = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise ValueError(f"{self.path}: tensor {name!r} listed twice")
            self.tensors[name] = self._tensor(name, dims, type_id, start + offset)

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        start, self._offset = self._offset, self._offset + length
        return str(self._buffer[start:self._offset], "utf-8", errors="replace")

    def _value(self, type_id: int) -> Any:
        if type_id in SCALARS:
            return self._scalar(SCALARS[type_id])
        if type_id == STRING:
            return self._string()
        if type_id != ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {type_id}")
        item_type, count = self._scalar("I"), self._scalar("Q")
        if item_type in SCALARS and item_type != 7:   # numeric: one numpy read
            dtype = np.dtype("<" + SCALARS[item_type])
            values = np.frombuffer(self._buffer, dtype, count, self._offset)
            self._offset += dtype.itemsize * count
            return values.tolist()
        return [self._value(item_type) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar("I")
        dims = tuple(self._scalar("Q") for _ in range(num_dims))
        return name, dims, self._scalar("I"), self._scalar("Q")

    def _tensor(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown type {type_id}") from None
        shape = tuple(reversed(dims))
        num_elements = int(np.prod(dims, dtype=np.int64))
        if kind.name in PLAIN_TYPES:
            dtype = np.dtype(PLAIN_TYPES[kind.name])
            count = num_elements
        else:   # blocks of block_size elements in type_size bytes, each row whole blocks
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), num_elements // block_size * type_size
            shape = (*shape[:-1], shape[-1] // block_size * type_size)
        if offset + count * dtype.itemsize > len(self._data):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        data = np.frombuffer(self._buffer, dtype, count, offset).reshape(shape)
        return GGUFTensor(name, kind, dims, data)
