"""How many KV blocks fit on a GPU: vLLM's meaning of gpu_memory_utilization, the fraction of the
device's memory the engine may fill with everything it holds (weights, the peak activations of the
largest step, what the CUDA runtime and libraries keep, the sampler's float64 logits), the KV cache
taking what is left. Measured after the weights are on the device and one step of the largest
size has run. Imported only on a GPU (torch).
"""

from __future__ import annotations

import logging

import torch

from vllmlite.models.decoder import DecoderModel

logger = logging.getLogger(__name__)
GIB = 1 << 30
SAMPLER_COPIES = 4   # float64 [rows, vocab] tensors the sampler holds at once (logits, probabilities, sorts)


def gpu_kv_budget(model: DecoderModel, fraction: float, max_tokens: int, max_seqs: int) -> int:
    """Bytes of KV cache that keep the engine within `fraction` of the device's memory."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model.profile_run(max_tokens, max_seqs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()              # weights + the largest step's activations
    free, total = torch.cuda.mem_get_info()
    others = total - free - torch.cuda.memory_reserved()  # the CUDA context, cuBLAS, other processes
    sampler = SAMPLER_COPIES * max_seqs * model.config.vocab_size * 8
    budget = int(fraction * total) - peak - others - sampler
    logger.info("GPU memory: %.1f GiB total, %.2f of it allowed; weights and peak activations %.2f GiB, "
                "CUDA context and others %.2f GiB, sampler %.2f GiB: KV cache %.2f GiB",
                total / GIB, fraction, peak / GIB, others / GIB, sampler / GIB, budget / GIB)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {fraction} leaves no memory for the KV cache: the weights and "
                         f"peak activations take {peak / GIB:.2f} GiB and other memory {others / GIB:.2f} GiB of "
                         f"{total / GIB:.1f} GiB; raise it, or lower max_num_batched_tokens")
    return budget
