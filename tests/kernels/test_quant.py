"""Quantized weight formats (vllmlite/kernels/quant.py): round trips, GGUF blocks read as stored, shapes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from vllmlite.kernels.quant import (
    BLOCK,
    TILE,
    BlockRows,
    QuantizedMatrix,
    dequantize,
    dequantize_block_rows,
    from_gguf,
    pack_nibbles,
    quantize,
    quantize_rows,
    scale_rows,
    tile,
    unpack_nibbles,
    untile,
)


def weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0, :BLOCK] = 0.0                       # an all-zero block: scale 0 must not divide by zero
    w[-1, -BLOCK:] = 3.0                     # a constant block
    return w


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_is_within_half_a_step_of_each_block_and_idempotent(fmt):
    w = weights(7, 96)
    q = quantize(w, fmt)
    assert q.shape == w.shape and q.format == fmt
    blocks = w.reshape(7, 3, BLOCK)
    err = np.abs(dequantize(q) - w).reshape(7, 3, BLOCK).max(-1)
    if fmt == "int4":                                          # affine: the block's range in 15 steps
        assert np.all(err <= 0.5 * (blocks.max(-1) - blocks.min(-1)) / 15 + 1e-6)
    else:                                                      # never coarser than Q8_0's symmetric grid
        assert np.all(err <= 0.5 * np.abs(blocks).max(-1) / 127 + 1e-6)
    assert np.array_equal(dequantize(q)[0, :BLOCK], np.zeros(BLOCK))
    np.testing.assert_allclose(dequantize(q)[-1, -BLOCK:], 3.0, rtol=1e-6)
    again = quantize(dequantize(q), fmt)       # what is already on the grid stays there
    np.testing.assert_allclose(dequantize(again), dequantize(q), atol=1e-5)


def test_nibbles_pack_in_ggml_order():
    q = (np.arange(64, dtype=np.uint8) * 7 % 16).reshape(1, 2, 32)
    packed = pack_nibbles(q)
    assert packed.shape == (1, 2, 16)                          # [rows, block, byte in block]
    for block in range(2):
        for j in range(16):                                    # byte j: element j low, j + 16 high
            assert packed[0, block, j] == (q[0, block, j] | q[0, block, j + 16] << 4)
    assert np.array_equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, TILE, TILE + 1, 2 * TILE + 17])
def test_tiles_hold_each_row_lane_by_lane_and_untile_exactly(fmt, rows):
    m = quantize_rows(weights(rows, 64, seed=rows), fmt)
    t = tile(m)
    width = 32 if fmt == "int8" else 16
    num_tiles = -(-rows // TILE)
    assert t.qs.shape == (num_tiles, 2, width, TILE) and t.scales.shape == (num_tiles, 2, TILE)
    assert t.shape == (rows, 64) and t.num_rows == rows
    last = rows - 1                                            # row r: tile r // TILE, lane r % TILE
    assert np.array_equal(t.qs[last // TILE, 1, :, last % TILE], m.qs[last, 1])
    assert t.scales[last // TILE, 1, last % TILE] == m.scales[last, 1]
    assert not t.qs[-1, :, :, rows - (num_tiles - 1) * TILE:].any()   # padding rows are zero
    back = untile(t)
    for a, b in ((back.qs, m.qs), (back.scales, m.scales), (back.mins, m.mins)):
        assert (a is None and b is None) or np.array_equal(a, b)
    np.testing.assert_array_equal(dequantize(t), dequantize_block_rows(m))
    picked = np.array([last, 0, last, rows // 2])              # embedding lookup: any rows, repeated
    np.testing.assert_array_equal(dequantize(t, picked), dequantize(t)[picked])


@pytest.mark.parametrize("fmt", ["int8", "int4", "none"])
def test_scale_rows_scales_the_first_rows_and_leaves_the_input(fmt):
    """What folding a multiplier into Q's rows does (families/common.fold_attention_scale)."""
    w = weights(70, 64)
    m = w if fmt == "none" else quantize(w, fmt)
    before = m.copy() if fmt == "none" else dequantize(m)
    scaled = scale_rows(m, 0.3, num_rows=65)
    got = scaled if fmt == "none" else dequantize(scaled)
    np.testing.assert_allclose(got[:65], 0.3 * before[:65], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[65:], before[65:])
    np.testing.assert_array_equal(m if fmt == "none" else dequantize(m), before)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_are_read_as_stored(type_name):
    w = weights(5, 64, seed=1)
    raw = quants.quantize(w, GGMLQuantizationType[type_name])          # the gguf package's encoder
    expected = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(w.shape)
    m = from_gguf(raw, type_name, w.shape)
    assert m.format == ("int8" if type_name == "Q8_0" else "int4")
    np.testing.assert_array_equal(dequantize_block_rows(m), expected)
    np.testing.assert_array_equal(dequantize(tile(m)), expected)


def test_unsupported_shapes_and_types_are_rejected_clearly():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.ones((2, 40), np.float32), "int8")
    with pytest.raises(ValueError, match="int8, int4|one of"):
        quantize(np.ones((2, 32), np.float32), "int3")
    with pytest.raises(ValueError, match="not int8/int4 blocks"):
        from_gguf(np.zeros(8, np.uint8), "Q5_K", (1, 256))


def test_take_and_concat_keep_each_row():
    a, b = quantize_rows(weights(4, 64, 2), "int4"), quantize_rows(weights(3, 64, 3), "int4")
    stacked = BlockRows.concat([a, b])
    assert stacked.qs.shape == (7, 2, 16)
    np.testing.assert_array_equal(dequantize_block_rows(stacked),
                                  np.concatenate([dequantize_block_rows(a), dequantize_block_rows(b)]))
    order = np.array([6, 0, 3])
    np.testing.assert_array_equal(dequantize_block_rows(stacked.take(order)), dequantize_block_rows(stacked)[order])
    with pytest.raises(ValueError, match="different formats"):
        BlockRows.concat([a, quantize_rows(weights(2, 64), "int8")])
    assert isinstance(tile(stacked), QuantizedMatrix)


@pytest.mark.real_model
def test_the_default_gguf_tensors_read_as_stored_match_the_gguf_package():
    import gguf

    from vllmlite.models.model_source import resolve_model
    reader = gguf.GGUFReader(resolve_model("default"))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.ffn_down.weight", "blk.29.attn_q.weight", "token_embd.weight"):  # Q4_1, Q4_1, Q8_0
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        m = tile(from_gguf(t.data, t.tensor_type.name, shape))
        np.testing.assert_array_equal(dequantize(m), quants.dequantize(t.data, t.tensor_type).reshape(shape))
        assert m.nbytes <= 9 / 32 * np.prod(shape) * 4      # 5-9 bits a weight (float32 scales), not 32


def test_int8_rounding_gives_back_weights_decoded_from_4_and_8_bit_blocks():
    """An F32 copy of a Q4_1/Q8_0 GGUF holds 16 levels per block, or Q8_0's grid: rounding it to
    int8 loses nothing (to float rounding). Q8_0's grid alone moved the 4-bit blocks by up to half a
    step, the affine grid alone the Q8_0 ones."""
    rng = np.random.default_rng(5)
    d = rng.uniform(0.001, 0.05, (6, 4, 1)).astype(np.float32)
    low = rng.uniform(-0.5, 0.0, (6, 4, 1)).astype(np.float32)
    k = rng.integers(0, 16, (6, 4, BLOCK))
    k[..., 0], k[..., 1] = 0, 15                               # each block spans its 16 levels
    four_bit = (d * k + low).reshape(6, 4 * BLOCK).astype(np.float32)
    eight_bit = quants.dequantize(quants.quantize(weights(6, 4 * BLOCK, seed=6), GGMLQuantizationType.Q8_0),
                                  GGMLQuantizationType.Q8_0).reshape(6, 4 * BLOCK)
    for w in (four_bit, eight_bit, np.concatenate([four_bit, eight_bit], axis=1)):
        np.testing.assert_allclose(dequantize(quantize(w, "int8")), w, rtol=0, atol=1e-6)
    symmetric = quants.dequantize(quants.quantize(four_bit, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert np.abs(symmetric.reshape(four_bit.shape) - four_bit).max() > 1e-4


def test_symmetric_and_affine_int8_stack_into_one_matrix():
    """A fused matrix from a Q8_0 tensor (no mins) and a rounded float one: the symmetric rows get
    mins of zero."""
    w = weights(3, 64, seed=4)
    stored = from_gguf(quants.quantize(w, GGMLQuantizationType.Q8_0), "Q8_0", w.shape)
    rounded = quantize_rows(weights(2, 64, seed=5), "int8")
    assert stored.mins is None and rounded.mins is not None
    stacked = BlockRows.concat([stored, rounded])
    np.testing.assert_array_equal(dequantize_block_rows(stacked),
                                  np.concatenate([dequantize_block_rows(stored), dequantize_block_rows(rounded)]))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rounding_in_row_chunks_gives_what_one_pass_gives(monkeypatch, fmt):
    """Large matrices are rounded ROUNDING_ROWS rows at a time (bounded temporaries): same blocks."""
    w = weights(11, 64, seed=7)
    whole = quantize_rows(w, fmt)
    monkeypatch.setattr("vllmlite.kernels.quant.ROUNDING_ROWS", 4)
    chunked = quantize_rows(w, fmt)
    for a, b in ((chunked.qs, whole.qs), (chunked.scales, whole.scales), (chunked.mins, whole.mins)):
        np.testing.assert_array_equal(a, b)
