"""The elementwise operations of a layer as single Triton kernels: RMSNorm (with the residual add
fused in), RoPE on the query and key heads together, SiLU- and GELU-and-multiply, the KV-cache write,
and RoPE with the KV-cache write of its keys and the values.
Each reads its operands once and writes once, where the torch forms launch three to six kernels
and round to the storage dtype between them; the arithmetic is the references' (vllmlite/kernels/
reference.py) in float32, rounded to the storage dtype once at the end of each step the reference
rounds at (the residual sum, the normalized row before the weight).

One program per token row (per (token, head) for RoPE), with any strides (the torch backend's
workspace is token-major; the kernel tests also pass the CPU backends' feature-major views).
Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmlite.kernels import kv_dtype
from vllmlite.kernels.torch import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_xc, stride_r, stride_rc, stride_o,
                     stride_oc, width, eps, ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols * stride_xc, mask=mask, other=0.0)
    if ADD:   # residual += x, rounded to the storage dtype as the reference's in-place add
        r_ptrs = residual_ptr + row * stride_r + cols * stride_rc
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols * stride_oc, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor) -> None:
    """out = RMSNorm(x) * weight; with `residual`, first residual += x and normalize the sum."""
    rows, width = x.shape
    add = residual is not None
    residual = residual if add else x
    if rows:
        _rms_norm_kernel[(rows,)](x, residual, weight, out, *x.stride(), *residual.stride(), *out.stride(), width, eps,
                                  ADD=add, BLOCK=triton.next_power_of_2(width), **pdl.options(x))


@triton.jit
def _rope_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_tok, stride_head, stride_d, stride_cos,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    j = tl.arange(0, HALF_PAD)
    mask = j < HALF
    _rotate_in_place(x_ptr + token * stride_tok + head * stride_head, positions_ptr + token, cos_ptr, sin_ptr,
                     stride_d, stride_cos, j, mask, HALF)


@triton.jit
def _rotate_in_place(base, position_ptr, cos_ptr, sin_ptr, stride_d, stride_cos, j, mask, HALF: tl.constexpr):
    """Rotate-half RoPE of the head(s) at base (j: offsets in the first half, broadcast over any
    head axis of base) at the position position_ptr holds, in float32, stored back in the heads'
    dtype; returns the two rotated halves as stored."""
    position = tl.load(position_ptr)
    c = tl.load(cos_ptr + position * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + position * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)
    x1 = tl.load(base + j * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + (HALF + j) * stride_d, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * c - x2 * s).to(base.dtype.element_ty)
    y2 = (x2 * c + x1 * s).to(base.dtype.element_ty)
    tl.store(base + j * stride_d, y1, mask=mask)
    tl.store(base + (HALF + j) * stride_d, y2, mask=mask)
    return y1, y2


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place: x [tokens, heads, head_dim], any strides; cos/sin [positions,
    head_dim / 2] contiguous rows."""
    tokens, heads, head_dim = x.shape
    if tokens:
        _rope_kernel[(tokens, heads)](x, positions, cos, sin, *x.stride(), cos.stride(0),
                                      HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
                                      **pdl.options(x))


@triton.jit
def _act_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_in_c, stride_out, stride_out_c, width,
                        BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols * stride_in_c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + (width + cols) * stride_in_c, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:   # 0.5 * (1 + tanh(u)) = sigmoid(2u): gelu_tanh(x) = x / (1 + exp(-2u)), no libdevice tanh
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)   # sqrt(2 / pi) * (...)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols * stride_out_c, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(gate_up: torch.Tensor, out: torch.Tensor, gelu_tanh: bool) -> None:
    rows, width = out.shape
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _act_and_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, *gate_up.stride(), *out.stride(), width,
                                                               BLOCK=block, GELU_TANH=gelu_tanh,
                                                               **pdl.options(out))


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    _act_and_mul(gate_up, out, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """Gemma's gelu_pytorch_tanh(gate) * up (reference.gelu_tanh_and_mul)."""
    _act_and_mul(gate_up, out, gelu_tanh=True)


@triton.jit
def _round_mantissa_to_3_bits(x):
    """float32 x rounded to 3 mantissa bits, to nearest even (on the bits: the sign rides along)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(x, FP8_MAX: tl.constexpr):
    """float32 x clipped to +-FP8_MAX and rounded to the nearest float8 e4m3 value (ties to even), in
    float32: as TorchKernels.to_fp8 stores it. Rounded here rather than by the cast, which then only
    changes the format: Triton's interpreter (3.x) rounds without carrying into the exponent
    (1.95 became 1.0), so the CPU tests would not check what the GPU computes. Below 2^-6 e4m3 is
    subnormal, multiples of 2^-9: those are rounded in 2^-6's binade, which has that spacing."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    magnitude = tl.abs(x)
    subnormal = _round_mantissa_to_3_bits(magnitude + 0.015625) - 0.015625
    subnormal = tl.where(x < 0, -subnormal, subnormal)
    return tl.where(magnitude < 0.015625, subnormal, _round_mantissa_to_3_bits(x))


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slots_ptr, stride_k_tok, stride_k_head, stride_k_d,
                     stride_v_tok, stride_v_head, stride_v_d, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < KV_HEADS * HEAD_DIM
    head, d = i // HEAD_DIM, i % HEAD_DIM
    slot = tl.load(slots_ptr + token)
    k = tl.load(k_ptr + token * stride_k_tok + head * stride_k_head + d * stride_k_d, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + head * stride_v_head + d * stride_v_d, mask=mask)
    if FP8:   # an fp8 cache: the values it will hold, so that the cast below is exact
        k = _e4m3_value(k.to(tl.float32), FP8_MAX)
        v = _e4m3_value(v.to(tl.float32), FP8_MAX)
    tl.store(k_cache_ptr + slot * KV_HEADS * HEAD_DIM + i, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * KV_HEADS * HEAD_DIM + i, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping] = k and the same for v: k, v [tokens, kv_heads, head_dim], any strides;
    caches [slots, kv_heads, head_dim] contiguous, in k's dtype or float8 e4m3 (kv_cache_dtype fp8:
    clipped to +-FP8_MAX, rounded to nearest even)."""
    tokens, kv_heads, head_dim = k.shape
    if tokens:
        _write_kv_kernel[(tokens,)](k_cache, v_cache, k, v, slot_mapping, *k.stride(), *v.stride(), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                                    BLOCK=triton.next_power_of_2(kv_heads * head_dim),
                                    FP8=k_cache.dtype == torch.float8_e4m3fn, FP8_MAX=kv_dtype.FP8_MAX,
                                    **pdl.options(k))


@triton.jit
def _rope_write_kv_kernel(qk_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                          stride_tok, stride_head, stride_d, stride_v_tok, stride_v_head, stride_v_d, stride_cos,
                          HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
                          HALF: tl.constexpr, HALF_PAD: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                          PDL: tl.constexpr):
    """One token: _rope_kernel's rotation of all its query and key heads (written back in place),
    the rotated keys and the values into the cache at its slot as _write_kv_kernel stores them."""
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (j < HALF)
    y1, y2 = _rotate_in_place(qk_ptr + token * stride_tok + h * stride_head, positions_ptr + token, cos_ptr, sin_ptr,
                              stride_d, stride_cos, j, mask, HALF)
    slot = tl.load(slots_ptr + token)
    key = h - (HEADS - KV_HEADS)                                       # the key heads: the last KV_HEADS
    key_mask = mask & (key >= 0)
    row = k_cache_ptr + slot * KV_HEADS * 2 * HALF + key * 2 * HALF
    if FP8:
        y1 = _e4m3_value(y1.to(tl.float32), FP8_MAX)
        y2 = _e4m3_value(y2.to(tl.float32), FP8_MAX)
    tl.store(row + j, y1.to(k_cache_ptr.dtype.element_ty), mask=key_mask)
    tl.store(row + HALF + j, y2.to(k_cache_ptr.dtype.element_ty), mask=key_mask)
    vh = tl.arange(0, KV_PAD)[:, None]
    d = tl.arange(0, 2 * HALF_PAD)[None, :]
    v_mask = (vh < KV_HEADS) & (d < 2 * HALF)
    v = tl.load(v_ptr + token * stride_v_tok + vh * stride_v_head + d * stride_v_d, mask=v_mask)
    if FP8:
        v = _e4m3_value(v.to(tl.float32), FP8_MAX)
    tl.store(v_cache_ptr + slot * KV_HEADS * 2 * HALF + vh * 2 * HALF + d, v.to(v_cache_ptr.dtype.element_ty),
             mask=v_mask)


def rope_and_write_kv(qk: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """`rope` over qk [tokens, heads + kv_heads, head_dim] (any strides), then `write_kv` of its last
    kv_heads heads and value [tokens, kv_heads, head_dim], in one kernel: a decode step launches one
    where it launched two."""
    tokens, heads, head_dim = qk.shape
    kv_heads = value.shape[1]
    if tokens:
        _rope_write_kv_kernel[(tokens,)](
            qk, value, positions, cos, sin, k_cache, v_cache, slot_mapping, *qk.stride(), *value.stride(),
            cos.stride(0), HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), KV_HEADS=kv_heads,
            KV_PAD=triton.next_power_of_2(kv_heads), HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
            FP8=k_cache.dtype == torch.float8_e4m3fn, FP8_MAX=kv_dtype.FP8_MAX, **pdl.options(qk))
