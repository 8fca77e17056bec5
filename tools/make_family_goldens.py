"""Goldens of each model family: a tiny random checkpoint of the family's real structure, its
float32 logits and greedy continuation from HF transformers, and the same checkpoint converted to
GGUF by llama.cpp's convert_hf_to_gguf.py. tests/models/test_families.py reads them.

Runs only in the reference venv (torch + transformers); regenerate from the repo root with:

    HF_HUB_OFFLINE=1 /work/refenv/bin/python tools/make_family_goldens.py [family ...]

Writes tests/goldens/families/<family>/: config.json, model.safetensors, tokenizer files,
model.gguf (f32), expected.json (prompt ids, greedy ids, smallest top-2 margin) and
expected_logits.npy [prompt, vocab]. The converter comes from the llama-cpp-python sdist that
tests/llama_cpp_source.py caches (its vendored llama.cpp: convert_hf_to_gguf.py, conversion/, gguf-py/).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT / "tools"), str(REPO_ROOT / "tests")]
from llama_cpp_source import extract, llama_cpp_source  # noqa: E402
from make_goldens import TINY_CHAT_TEMPLATE, TINY_SHAPE, build_tiny_tokenizer, write_json  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog; the cat sat on the mat."
NUM_GREEDY = 12
MIN_MARGIN = 1e-3  # a greedy step closer than this to a tie could flip on float rounding
MIN_ROUTE_MARGIN = 2e-5  # nor a token's k-th and (k+1)-th expert probabilities (float32 agrees to ~1e-7)

# name -> config.json fields on top of TINY_SHAPE: each family's real structural fields, small.
FAMILIES = {
    # Llama-3.2-1B's: GQA, tied embeddings, llama3 RoPE scaling (original context 16 < 128), so the
    # converter's Q/K permutation and its rope_freqs tensor are both exercised.
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    # Qwen3-0.6B's structure: head_dim (16) != hidden / heads (8), tied embeddings, no biases.
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
              "tie_word_embeddings": True, "use_sliding_window": False, "max_window_layers": 2},
    # SmolLM3-3B's: every 4th layer without RoPE (4 layers: the last one), tied embeddings.
    "smollm3": {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "num_hidden_layers": 4,
                "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "no_rope_layer_interval": 4,
                "tie_word_embeddings": True, "use_sliding_window": False, "attention_bias": False,
                "pad_token_id": 2},
    # Granite 3.x's: muP multipliers (attention 1/head_dim, embedding 12, residual 0.22, logits / 8),
    # tied embeddings, head_dim = hidden / heads.
    "granite": {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "rms_norm_eps": 1e-5,
                "rope_theta": 10000000.0, "attention_multiplier": 0.125, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22, "logits_scaling": 8.0, "tie_word_embeddings": True,
                "attention_bias": False, "mlp_bias": False, "pad_token_id": 2},
    # OLMo-2-1B's: post-norms, q/k norms over the whole projection, as many KV heads as heads.
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "num_key_value_heads": 4,
              "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "attention_bias": False, "pad_token_id": 2},
    # Phi-4-mini's: fused qkv_proj and gate_up_proj, RoPE on 3/4 of each head, longrope with an
    # original context (32) below the model's (128), tied embeddings, GQA.
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,
             "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5],
                              "long_factor": [1.5, 4.0, 12.0]},
             "sliding_window": None, "tie_word_embeddings": True, "pad_token_id": 2},
    # Mistral-7B-v0.1's: a sliding window on every layer (8 tokens here, a fifth of the prompt),
    # untied LM head, rope_theta 10000.
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 8,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 8,
                "tie_word_embeddings": False},
    # Gemma-2-2B's: head_dim (16) != hidden / heads (8) with query_pre_attn_scalar = head_dim (llama.cpp
    # assumes it except for the 27B), GeGLU, sandwich norms, soft-caps 50 / 30, sliding window on
    # alternate layers (6 tokens here), tied embeddings.
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 4,
               "head_dim": 16, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh",
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 6, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "pad_token_id": 1},
    # Gemma-3-4B's (text): per-head q/k norms, no attention soft-cap, 5 sliding layers to 1 global,
    # local RoPE base 10000, global base 1e6 with linear scaling 8; hub-style keys, as its config.json.
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
               "head_dim": 16, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh",
               "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 6,
               "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
               "tie_word_embeddings": True, "pad_token_id": 1},
    # Qwen2's with use_sliding_window on (off in the released models): layers from max_window_layers
    # on slide (the second of 2 here, 8 tokens), q/k/v biases, untied.
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
              "tie_word_embeddings": False},
    # Qwen3-30B-A3B's: Qwen3 attention, every layer sparse (decoder_sparse_step 1, no mlp_only_layers),
    # top-k renormalized (norm_topk_prob), experts narrower than the dense width; 16 experts top-4
    # (the real model: 128, top-8).
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
                  "tie_word_embeddings": False, "use_sliding_window": False, "num_experts": 16,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 16, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    # Mixtral-8x7B's: Llama attention, 8 experts top-2 in every layer, no sliding window.
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 32,
                "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
    # OLMoE-1B-7B's: full-width q/k norms, top-8 not renormalized (64 experts there, 16 here), no clip_qkv.
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "intermediate_size": 16,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
              "clip_qkv": None, "num_experts": 16, "num_experts_per_tok": 8, "norm_topk_prob": False,
              "pad_token_id": 1},
}
# Seed offsets for families whose first seed gave a greedy step within MIN_MARGIN of a tie.
RESEED: dict[str, int] = {}
# The converter reads Phi-3's vocabulary from a SentencePiece file unless the class is GPT-2's, as
# Phi-4-mini's is (the same byte-level BPE tokenizer.json either way).
TOKENIZER_CLASS = {"phi3": "GPT2Tokenizer"}
# Families whose RoPE depends on the context the engine runs with (longrope): logits and greedy
# tokens again for a context of `max_model_len`, on the prompt's first `prompt_len` tokens
# (transformers picks the factors by the sequence's length, so the whole run stays within it).
SHORT_CONTEXT = {"phi3": {"max_model_len": 32, "prompt_len": 24}}
# MoE families run transformers' own per-expert loop (its default, grouped_mm, sums in another order).
EAGER_EXPERTS = {"experts_implementation": "eager"}

# convert_hf_to_gguf identifies a BPE pre-tokenizer by hashing its output on a test string; the tiny
# trained tokenizer matches none, so it is named "gpt-2" (GPT-2's byte-level split, which it uses).
# Its specials are fewer than the vocabulary's 300 rows, so Gemma 3's converter trims no embedding row.
CONVERT = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# Gemma 2's converter reads only SentencePiece's tokenizer.model; the tiny BPE one goes Gemma 3's way.
from conversion import gemma
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_tree(scratch: Path) -> Path:
    """convert_hf_to_gguf.py with its conversion/ package and gguf-py, from the cached sdist."""
    llama_cpp_source()  # fetches the sdist when it is not cached
    extract(scratch, ("convert_hf_to_gguf.py", "conversion/", "gguf-py/"))
    return scratch


class RouteMargin:
    """The smallest gap, over every token routed while it is attached, between the k-th and
    (k+1)-th most probable experts (the softmax in float32, as transformers routes)."""

    def __init__(self, model) -> None:
        self.margin = float("inf")
        self.hooks = [module.register_forward_hook(self.record) for module in model.modules()
                      if type(module).__name__.endswith("TopKRouter")]

    def record(self, module, args, output) -> None:
        probs = torch.softmax(output[0].float(), dim=-1).sort(dim=-1, descending=True).values
        self.margin = min(self.margin, float((probs[:, module.top_k - 1] - probs[:, module.top_k]).min()))


def randomize(model, seed: int) -> None:
    """Every parameter random (tied ones once): norms near 1 and biases nonzero so mistakes show.
    Gemma's norms scale by 1 + weight, so theirs are stored near 0 (still near 1 in effect)."""
    generator = torch.Generator().manual_seed(seed)
    norm_base = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if "norm" in name:
            value = norm_base + 0.2 * noise
        elif name.endswith(".bias"):
            value = 0.3 * noise
        elif "embed_tokens" in name:
            value = 0.5 * noise
        else:
            value = noise / param.shape[-1] ** 0.5
        param.data.copy_(value)


@torch.no_grad()
def greedy(model, ids: list[int], num_tokens: int = NUM_GREEDY) -> tuple[list[int], float]:
    """`num_tokens` argmax tokens, each from a full recompute (no cache, no EOS stop), and the
    smallest gap between the best two logits along the way."""
    ids, out, margin = list(ids), [], float("inf")
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        top = torch.topk(logits, 2).values
        margin = min(margin, float(top[0] - top[1]))
        out.append(int(torch.argmax(logits)))
        ids.append(out[-1])
    return out, margin


@torch.no_grad()
def make_family(name: str, fields: dict, seed: int, out_dir: Path, tree: Path) -> None:
    directory = out_dir / name
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    raw = {**TINY_SHAPE, **fields}
    implementation = EAGER_EXPERTS if {"num_experts", "num_local_experts"} & set(raw) else {}
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                             **implementation).eval()
    randomize(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").unlink(missing_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": TOKENIZER_CLASS.get(name, "PreTrainedTokenizerFast"), "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": None, "model_max_length": 128,
        "clean_up_tokenization_spaces": False, "chat_template": TINY_CHAT_TEMPLATE})
    # The checkpoint as saved, read back: what vllmlite reads is what transformers ran.
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                 **implementation).eval()
    input_ids = AutoTokenizer.from_pretrained(directory)(PROMPT).input_ids
    routes = RouteMargin(model)
    logits = model(input_ids=torch.tensor([input_ids]), use_cache=False).logits[0].float().numpy()  # [seq, vocab]
    greedy_ids, margin = greedy(model, input_ids)
    assert margin > MIN_MARGIN, f"{name}: greedy margin {margin} too close to a tie; pick another seed"
    assert routes.margin > MIN_ROUTE_MARGIN, f"{name}: route margin {routes.margin} too close to a tie"
    extra = {"route_min_margin": routes.margin} if routes.hooks else {}
    np.save(directory / "expected_logits.npy", logits.astype(np.float32))
    expected = {"prompt": PROMPT, "input_ids": input_ids, "greedy_ids": greedy_ids, "greedy_min_margin": margin, **extra}
    if name in SHORT_CONTEXT:
        short = dict(SHORT_CONTEXT[name])
        ids = input_ids[:short.pop("prompt_len")]
        short_logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        short_ids, short_margin = greedy(model, ids, short["max_model_len"] - len(ids))
        assert short_margin > MIN_MARGIN, f"{name}: short-context greedy margin {short_margin}"
        np.save(directory / "expected_logits_short.npy", short_logits.astype(np.float32))
        expected["short_context"] = {**short, "input_ids": ids, "greedy_ids": short_ids, "greedy_min_margin": short_margin}
    write_json(directory / "expected.json", expected)
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    converted = subprocess.run([sys.executable, "-c", CONVERT, str(tree), str(directory), "--outtype", "f32",
                                "--outfile", str(directory / "model.gguf")], env=env, capture_output=True, text=True)
    if converted.returncode != 0:
        sys.exit(f"{name}: convert_hf_to_gguf.py failed:\n{converted.stderr[-3000:]}")
    for path in directory.iterdir():
        path.chmod(0o644)  # safetensors creates its file owner-only
    print(f"{name}: {len(input_ids)} prompt tokens, greedy margin {margin:.4f}, route margin {routes.margin:.2e}, "
          f"{sum(p.stat().st_size for p in directory.iterdir()) // 1024} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=list(FAMILIES), help="default: all")
    parser.add_argument("--out", default=str(REPO_ROOT / "tests" / "goldens" / "families"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: reduction order, hence the bits, do not depend on the machine
    with tempfile.TemporaryDirectory() as scratch:
        tree = converter_tree(Path(scratch))
        for name in args.families:
            make_family(name, FAMILIES[name], zlib.crc32(name.encode()) + RESEED.get(name, 0), Path(args.out), tree)


if __name__ == "__main__":
    main()
