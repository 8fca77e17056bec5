"""The torch backend: every hot operation of `Kernels` on torch tensors, on the CPU or a CUDA device,
in float32, float64, bfloat16 or float16. Also allocates: weights, activations and the KV cache
live where this backend computes.

The operations follow the numpy references (vllmlite/kernels/reference.py) line for line; the
tests hold them to those references. Norms, RoPE and softmax run in float32 whatever the storage
dtype (as transformers does for bf16), matrix products on cuBLAS/BLAS in the storage dtype.

Imported only when `kernels="torch"` (or `device="cuda"`): the CPU install never imports torch.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import torch

from vllmlite.kernels import kv_dtype
from vllmlite.kernels.attention_metadata import (
    MAX_BATCHED_QUERY_LEN,
    AttentionGroup,
    AttentionMetadata,
    check_attention_options,
)
from vllmlite.kernels.quant import QuantizedMatrix, dequantize
from vllmlite.kernels.reference import check_moe, rope_then_write_kv


def fused_ops():
    """The fused elementwise Triton kernels (triton_ops.py), imported on first use: triton is needed
    only there."""
    return importlib.import_module("vllmlite.kernels.torch.triton_ops")


def paged_attention_kernel():
    """The paged-attention Triton kernel (triton_attention.py), imported on first use. (Functions,
    not names of the submodules: importing a submodule binds its name on this package.)"""
    return importlib.import_module("vllmlite.kernels.torch.triton_attention")


def gemv_kernel():
    """The one-row product's Triton kernel (triton_gemv.gemv), imported on first use."""
    return importlib.import_module("vllmlite.kernels.torch.triton_gemv").gemv


def argmax_kernel():
    """The split argmax's Triton kernels (triton_argmax.argmax), imported on first use."""
    return importlib.import_module("vllmlite.kernels.torch.triton_argmax").argmax


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
HALF = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn   # kv_cache_dtype fp8 (kv_dtype.py): K/V stored in it, widened as they are read
KV_DTYPES = {"fp8": FP8}    # the kv_dtype.BACKEND_KINDS this backend stores, by name


class TorchKernels:
    """One backend instance per engine: its device and compute dtype are fixed at construction."""

    name = "torch"
    feature_major = False  # token-major activations: cuBLAS's usual layout, coalesced rows for Triton

    def __init__(self, device: str = "cpu", dtype: str = "float32", triton: bool | None = None) -> None:
        """triton: the Triton kernels (paged attention for every query, the fused elementwise
        operations; the default on CUDA), else torch operations only (the default on the CPU, where
        Triton runs only in its interpreter). float64 always takes the torch operations: Triton's
        dot has no float64 path."""
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.triton = self.device.type == "cuda" if triton is None else triton
        # Streaming multiprocessors: how many attention programs fill the device (0: never split).
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 0
        self._rope_then_write_kv = rope_then_write_kv(self.rope, self.write_kv)   # rope_and_write_kv without Triton

    # ---- where arrays live ---------------------------------------------------------------------
    def to_device(self, array: np.ndarray | QuantizedMatrix | torch.Tensor, dtype=None) -> torch.Tensor:
        """An array on this backend: floats in `dtype`, by default the compute dtype (quantized blocks
        dequantized once, here), integers as int64 (indices). A tensor already there is returned as
        it is."""
        if isinstance(array, QuantizedMatrix):
            array = dequantize(array)
        tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
        dtype = (dtype or self.dtype) if tensor.is_floating_point() else torch.int64
        return tensor.to(device=self.device, dtype=dtype)

    def _dtype(self, dtype) -> torch.dtype:
        """A torch dtype, a KV_DTYPES name (fp8), or None for the compute dtype."""
        return KV_DTYPES.get(dtype, dtype) if dtype is not None else self.dtype

    def zeros(self, shape: tuple[int, ...], dtype=None) -> torch.Tensor:
        return torch.zeros(shape, dtype=self._dtype(dtype), device=self.device)

    def empty(self, shape: tuple[int, ...], dtype=None) -> torch.Tensor:
        return torch.empty(shape, dtype=self._dtype(dtype), device=self.device)

    def host_zeros(self, shape: tuple[int, ...], dtype=None) -> torch.Tensor:
        """A host buffer for swapped-out blocks (pinned on CUDA, so copies overlap)."""
        return torch.zeros(shape, dtype=self._dtype(dtype), pin_memory=self.device.type == "cuda")

    @staticmethod
    def to_numpy(x: torch.Tensor) -> np.ndarray:
        """A host copy (half precisions widened to float32: numpy has no bfloat16)."""
        x = x.detach()
        if x.dtype in HALF:
            x = x.float()
        return x.cpu().numpy()

    def argmax(self, logits: torch.Tensor) -> np.ndarray:
        """Each row's first maximum, computed where the logits are: [rows] int64 on the host."""
        return self.device_argmax(logits).cpu().numpy()

    def device_argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's first maximum as [rows] int64 where the logits are (into `out` if given): the
        split Triton reduction (triton_argmax.py), else torch's."""
        if out is None:
            out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if self._triton(logits) and logits.stride(1) == 1:
            return argmax_kernel()(logits, out)
        return torch.argmax(logits, dim=1, out=out)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, src_slots: np.ndarray,
                   dst_slots: np.ndarray) -> None:
        """dst[dst_slots] = src[src_slots], across devices (swap) or within one (copy-on-write); fp8
        caches as their bytes (uint8, which every device's indexing kernels take)."""
        src, dst = _raw(src), _raw(dst)
        rows = src[torch.from_numpy(src_slots).to(src.device)]
        dst[torch.from_numpy(dst_slots).to(dst.device)] = rows.to(dst.device, non_blocking=True)

    def _index(self, meta: AttentionMetadata, name: str) -> torch.Tensor:
        """meta.<name> as a device tensor, made by the first layer of a step and reused by the rest."""
        key = f"torch.{name}"
        if key not in meta.kernel_cache:
            meta.kernel_cache[key] = self.to_device(np.asarray(getattr(meta, name)))
        return meta.kernel_cache[key]  # type: ignore[return-value]

    def _triton(self, x: torch.Tensor) -> bool:
        """Whether an operation on `x` runs as a Triton kernel (never in float64: Triton's products
        and these kernels' arithmetic stop at float32)."""
        return self.triton and x.dtype != torch.float64

    # ---- the operations (see Kernels) ----------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ weight.T (nn.Linear); for feature-major operands as weight @ x.T into out.T. One
        half-precision row on a GPU (a lone decode) takes the Triton GEMV (triton_gemv.py says why)."""
        if out.is_contiguous():
            if x.shape[0] == 1 and x.is_cuda and x.dtype in HALF and self.triton and x.is_contiguous():
                gemv_kernel()(x, weight, out)
                return
            torch.mm(x, weight.T, out=out)
        else:
            torch.mm(weight, x.T, out=out.T)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        if self._triton(x):
            fused_ops().rms_norm(x, None, weight, eps, out)
            return
        xf = x.float() if x.dtype in HALF else x                # half precisions normalize in float32
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        out.copy_(normed.to(x.dtype) * weight)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
        if self._triton(x):
            fused_ops().rms_norm(x, residual, weight, eps, out)
            return
        residual += x
        self.rms_norm(residual, weight, eps, out)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place: x [tokens, heads, head_dim]; cos/sin [positions, head_dim / 2]."""
        if self._triton(x):
            fused_ops().rope(x, positions, cos, sin)
            return
        half = x.shape[-1] // 2
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]   # [tokens, 1, head_dim / 2]
        x1, x2 = x[..., :half].clone(), x[..., half:].clone()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:] = x2 * c + x1 * s

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        if self._triton(gate_up):
            fused_ops().silu_and_mul(gate_up, out)
            return
        gate, up = gate_up.chunk(2, dim=-1)
        out.copy_(torch.nn.functional.silu(gate) * up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        if self._triton(gate_up):
            fused_ops().gelu_tanh_and_mul(gate_up, out)
            return
        gate, up = gate_up.chunk(2, dim=-1)
        out.copy_(torch.nn.functional.gelu(gate, approximate="tanh") * up)

    def moe(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, out: torch.Tensor, activation: str = "silu") -> None:
        """reference.moe with index operations and one pair of products per expert with tokens: the
        pairs sorted by expert, each expert's rows multiplied, the weighted outputs added back per
        token. Reads the experts' token counts on the host (a sync: not for CUDA graphs)."""
        check_moe(x, expert_ids, expert_weights, w_gate_up, w_down, activation)
        num_experts = w_gate_up.shape[0]
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)                                     # [pairs] pair p = t * top_k + k
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < num_experts:
            raise ValueError(f"moe: expert ids must lie in 0 .. {num_experts - 1}")
        order = torch.argsort(flat, stable=True)                          # pairs grouped by expert
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        tokens = order // top_k
        xs = x[tokens]                                                    # [pairs, hidden]
        ys = torch.empty_like(xs)                                         # [pairs, hidden]
        act = self.silu_and_mul if activation == "silu" else self.gelu_tanh_and_mul
        start = 0
        for e, count in enumerate(counts):
            if count:
                gate_up = xs[start:start + count] @ w_gate_up[e].T       # [count, 2 * inter]
                hidden = torch.empty((count, w_down.shape[2]), dtype=x.dtype, device=x.device)
                act(gate_up, hidden)
                torch.mm(hidden, w_down[e].T, out=ys[start:start + count])
                start += count
        compute = torch.float32 if x.dtype in HALF else x.dtype           # half precisions sum in float32
        weights = expert_weights.reshape(-1)[order].to(compute)
        total = torch.zeros(out.shape, dtype=compute, device=out.device)
        total.index_add_(0, tokens, ys.to(compute) * weights[:, None])
        out.copy_(total)

    def softcap(self, x: torch.Tensor, cap: float) -> None:
        """In place: x = cap * tanh(x / cap)."""
        torch.tanh(x / cap, out=x)
        x *= cap

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k_cache[slot_mapping] = k, v_cache[slot_mapping] = v; into an fp8 cache clipped to +-FP8_MAX
        and rounded to nearest even (kv_dtype.py)."""
        if self._triton(k):
            fused_ops().write_kv(k_cache, v_cache, k, v, slot_mapping)
            return
        for cache, x in ((k_cache, k), (v_cache, v)):
            if cache.dtype == FP8:
                _raw(cache)[slot_mapping] = _raw(to_fp8(x))
            else:
                cache[slot_mapping] = x

    def rope_and_write_kv(self, qk: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
        """rope, then write_kv of the keys (kernels.Kernels); one Triton kernel."""
        if self._triton(qk):
            fused_ops().rope_and_write_kv(qk, value, positions, cos, sin, k_cache, v_cache, slot_mapping)
            return
        self._rope_then_write_kv(qk, value, positions, cos, sin, k_cache, v_cache, slot_mapping)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, out: torch.Tensor, *, scale: float | None = None,
                        sliding_window: int | None = None, softcap: float | None = None) -> None:
        """Every query through the Triton kernel, reading K/V in place (its tiles, made by the first
        layer of a step, see attention_tiles, serve every window); without Triton through the
        reference's padded groups (kernels/attention_metadata.py), batched on the device. Options
        as reference.paged_attention's."""
        check_attention_options(scale, sliding_window, softcap)
        options = dict(scale=scale, softcap=softcap)
        if self._triton(q):
            tiles = meta.kernel_cache.get("torch.tiles")
            if tiles is None:
                tiles = meta.kernel_cache["torch.tiles"] = self.attention_tiles(meta, q.shape[1], k_cache.shape[1])
            block_tables = self._index(meta, "block_tables")
            kernel = paged_attention_kernel().paged_attention_tiles
            for step_tiles, rows, num_splits, block_n, num_warps in tiles:   # type: ignore[union-attr]
                kernel(q, k_cache, v_cache, step_tiles, rows, block_tables, meta.block_size, out, num_splits,
                       block_n, num_warps, sliding_window=sliding_window, **options)
            return
        key = f"torch.groups {sliding_window}"
        if key not in meta.kernel_cache:
            meta.kernel_cache[key] = [self._device_group(g) for g in meta.window_groups(sliding_window)]
        for group in meta.kernel_cache[key]:  # type: ignore[union-attr]
            self._attend_group(q, k_cache, v_cache, group, meta.block_size, out, **options)

    def attention_tiles(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int) -> list[tuple]:
        """The step's Triton launches: (tiles on the device, rows per tile, number of splits, keys
        per tile, warps a program) for the short queries (decodes, guesses; split over the context when they are too
        few to fill the device) and for the long prefill chunks."""
        ta = paged_attention_kernel()
        lens = np.diff(meta.query_start)
        launches = []
        for long in (False, True):
            seqs = np.flatnonzero((lens > MAX_BATCHED_QUERY_LEN) == long)
            if not len(seqs):
                continue
            rows = ta.tile_rows(num_heads, num_kv_heads, long)
            tiles = ta.make_tiles(meta.query_start, meta.positions, seqs, rows)
            context = int(meta.seq_lens[seqs].max())
            plan = (1, ta.BLOCK_N, 4) if long else \
                ta.short_query_plan(len(tiles) * num_kv_heads, context, self.num_sms)
            launches.append((self.to_device(tiles), rows, *plan))
        return launches

    def _device_group(self, g: AttentionGroup) -> tuple[torch.Tensor, ...]:
        valid = torch.from_numpy(g.query_valid).to(self.device)
        rows = self.to_device(g.query_rows)
        bias = torch.from_numpy(g.bias).to(self.device)              # float32, [B, 1, max_q, ctx]
        return rows, valid, self.to_device(g.block_ids), bias, rows[valid]

    @staticmethod
    def _attend_group(q, k_cache, v_cache, group, block_size: int, out, scale: float | None,
                      softcap: float | None) -> None:
        rows, valid, block_ids, bias, out_rows = group
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group_size = num_heads // num_kv_heads
        num_seqs, max_q = rows.shape
        ctx_len = block_ids.shape[1] * block_size
        k_blocks = k_cache.view(-1, block_size, num_kv_heads, head_dim)
        v_blocks = v_cache.view(-1, block_size, num_kv_heads, head_dim)
        # [B, max_q, kv, group, d] -> [B, kv, group * max_q, d]: each KV head serves its query heads.
        qg = q[rows].reshape(num_seqs, max_q, num_kv_heads, group_size, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group_size * max_q, head_dim)
        keys = _widen(k_blocks, block_ids, q.dtype).reshape(num_seqs, ctx_len, num_kv_heads, head_dim)
        values = _widen(v_blocks, block_ids, q.dtype).reshape(num_seqs, ctx_len, num_kv_heads, head_dim)
        scores = qg @ keys.permute(0, 2, 3, 1)                      # [B, kv, group * max_q, ctx]
        compute = torch.float32 if scores.dtype in HALF else scores.dtype
        scores = scores.to(compute).reshape(num_seqs, num_kv_heads, group_size, max_q, ctx_len)
        scores = scores * (1.0 / math.sqrt(head_dim) if scale is None else scale)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores + bias[:, :, None].to(compute)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        probs = probs.reshape(num_seqs, num_kv_heads, group_size * max_q, ctx_len)
        ctx = probs @ values.permute(0, 2, 1, 3)                    # [B, kv, group * max_q, d]
        ctx = ctx.reshape(num_seqs, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
        ctx = ctx.reshape(num_seqs, max_q, num_heads, head_dim)     # [B, max_q, heads, d]
        out[out_rows] = ctx[valid]


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as kv_cache_dtype fp8 stores it: clipped to +-FP8_MAX (a cast alone may make NaN of what lies
    past it), then rounded to nearest even."""
    return x.float().clamp(-kv_dtype.FP8_MAX, kv_dtype.FP8_MAX).to(FP8)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (uint8, the same storage), any other as it is."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def _widen(blocks: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks[block_ids] in `dtype` (an fp8 cache's gathered bytes widened, exactly)."""
    if blocks.dtype != FP8:
        return blocks[block_ids]
    return _raw(blocks)[block_ids].view(FP8).to(dtype)
