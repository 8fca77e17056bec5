"""GGUFFile against gguf's own GGUFReader (the oracle): the same metadata values and the same tensor
views, on llama.cpp's vocabulary files, the family goldens and a file written here with every value
type; and clear errors for files it cannot read."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from paths import GOLDENS

from vllmlite.utils.gguf_file import GGUFFile


def assert_same_as_gguf_reader(path: Path, nested: tuple[str, ...] = ()) -> None:
    """`nested`: keys of arrays of arrays, which GGUFReader's `contents()` flattens into one list."""
    reader = gguf.GGUFReader(str(path))
    ours = GGUFFile(path)
    assert {k: v for k, v in ours.fields.items() if k not in nested} == {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.") and key not in nested}
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.tensor_type == tensor.tensor_type and mine.shape == tuple(int(d) for d in tensor.shape)
        assert mine.data.dtype == tensor.data.dtype and mine.data.shape == tensor.data.shape
        assert np.array_equal(mine.data, tensor.data, equal_nan=True), tensor.name


@pytest.mark.parametrize("path", sorted(GOLDENS.glob("families/*/model.gguf")), ids=lambda p: p.parent.name)
def test_family_goldens_read_as_gguf_reads_them(path):
    assert_same_as_gguf_reader(path)


def test_every_value_type_and_quantized_tensors(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "▁b"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path, nested=("t.nested",))
    ours = GGUFFile(path)
    assert ours.fields["t.str"] == "héllo ▁world" and ours.fields["t.strs"] == ["a", "", "▁b"]
    assert ours.fields["t.nested"] == [[1, 2], [3]] and ours.fields["t.bools"] == [True, False]
    assert ours.tensors["q8"].data.shape == (4, 2 * 34)     # two Q8_0 blocks of 34 bytes per row


def test_llama_cpp_vocabularies_read_as_gguf_reads_them():
    from conftest import skip_unless_ci
    from llama_cpp_source import llama_cpp_source
    tree = llama_cpp_source()
    if tree is None:
        skip_unless_ci("llama.cpp's sources are not available")
    # GGUFReader is slow: a sample of the three tokenizer models (aquila gpt2, baichuan llama,
    # bert-bge bert); command-r, a second gpt2, took 14 of the test's 30-40 s.
    for path in sorted((tree / "models").glob("ggml-vocab-*.gguf"))[:3]:
        assert_same_as_gguf_reader(path)


def test_what_it_cannot_read_is_a_clear_error(tmp_path):
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "not.gguf")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 9"):
        GGUFFile(tmp_path / "v9.gguf")
    whole = (GOLDENS / "families" / "llama" / "model.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(tmp_path / "cut.gguf")
