"""The compiled kernels (numba, cached on disk), the default backend: the same operations as
`reference.py`, same arguments, same results within float rounding. This module is the backend
`get_kernels("numba")` returns; the kernels live by concern in elementwise.py (norms, RoPE, SiLU,
KV write), linear.py (float and quantized products), moe.py (routed experts) and attention.py,
compiled as jit.py says.

Every function is compiled for float32 and float64 arrays on first call (`DecoderModel.warm_up` makes
that happen at start-up) and the machine code is cached next to its module (or in NUMBA_CACHE_DIR),
so a second start does not recompile. Loops release the GIL (`nogil`), so the HTTP thread keeps
running while they do.
"""

from vllmlite.kernels.numba.attention import paged_attention
from vllmlite.kernels.numba.elementwise import add_rms_norm, gelu_tanh_and_mul, rms_norm, rope, silu_and_mul, write_kv
from vllmlite.kernels.numba.linear import linear
from vllmlite.kernels.numba.moe import moe
from vllmlite.kernels.reference import (  # numpy memory
    argmax,
    copy_slots,
    empty,
    feature_major,
    host_zeros,
    rope_then_write_kv,
    softcap,  # once per step on the logits: numpy's tanh is as fast
    to_device,
    to_numpy,
    zeros,
)

name = "numba"
rope_and_write_kv = rope_then_write_kv(rope, write_kv)
__all__ = ["add_rms_norm", "argmax", "copy_slots", "empty", "feature_major", "gelu_tanh_and_mul", "host_zeros", "linear",
           "moe", "name", "paged_attention", "rms_norm", "rope", "rope_and_write_kv", "silu_and_mul", "softcap",
           "to_device", "to_numpy", "write_kv", "zeros"]
