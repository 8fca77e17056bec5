"""llama.cpp's BPE pre-tokenizers, keyed by a GGUF file's `tokenizer.ggml.pre`: the regexes that cut
text into words before the merges run, as `tokenizers` pre-tokenizers.

Transcribed from `llm_tokenizer_bpe` and `llama_vocab::impl::load` in src/llama-vocab.cpp of the
llama.cpp that llama-cpp-python 0.3.36 vendors; where llama.cpp rewrote a tokenizer.json regex for its
own engine and kept the original in a comment, the original is used (`tokenizers` runs it as written).
Knows nothing of vocabularies or GGUF files beyond the `pre` name.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

from tokenizers import Regex, pre_tokenizers


class PreTokenizerSpec(NamedTuple):
    """How llama.cpp pre-tokenizes one family: `splits` apply in turn, each cutting every piece into
    its matches and the text between them (`tokenizers`' "isolated" split)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is taken whole, merges or not
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    sentencepiece_style: bool = False  # raw UTF-8 with "▁" for spaces and <0xNN> bytes, not GPT-2 bytes


# Keyed by llama.cpp's LLAMA_VOCAB_PRE_TYPE_*, lower case.
_SPLITS = {
    "llama3": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "jais2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "dbrx": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek_llm": (
        r"[\r\n]",
        r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        r"\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        r"\s+$",
        r"[一-龥ࠀ-一가-\ud7ff]+",
        r"\p{N}+",
    ),
    "deepseek3_llm": (
        r"\p{N}{1,3}",
        r"[一-龥\u3040-ゟ゠-ヿ]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    ),
    "spark2_5": (
        r"\p{N}{1,3}",
        r"[一-龥\u3040-ゟ゠-ヿ]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+""",
        r"\p{N}",
    ),
    "youtu": (
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek_coder": (
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        r"[一-龥ࠀ-一가-\ud7ff]+",
        r"\p{N}",
    ),
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ),
    "starcoder": (
        r"\p{N}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "gpt2": (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "poro": (
        r" ?[^(\s|.,!?…。，、।۔،)]+",
    ),
    "chatglm4": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "viking": (
        r" ?[^(\s|.,!?…。，、।۔،)]+",
        r"\p{N}",
    ),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "gpt4o": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "granite_emb_multi": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "tiny_aya": (
        r"\d{1,3}(?=(?:\d{3})*\b)",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "bailingmoe": (
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed_coder": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "grok2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "laguna": (
        r"[^\n]+|[\n]+",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "exaone_moe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "gemma4": (
        r"[^\n]+|[\n]+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "default": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),}


def _specs() -> dict[str, PreTokenizerSpec]:
    """`tokenizer.ggml.pre` name -> spec, as llama.cpp's `load` maps names to pre types and flags."""
    names = {
        "default": ("default",),
        "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                   "jina-v5-nano"),
        "jais2": ("jais-2",),
        "dbrx": ("dbrx", "smaug-bpe"),
        "deepseek_llm": ("deepseek-llm",),
        "deepseek3_llm": ("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"),
        "spark2_5": ("spark2_5",),
        "youtu": ("youtu",),
        "deepseek_coder": ("deepseek-coder",),
        "falcon": ("falcon",),
        "starcoder": ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        "gpt2": ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
                 "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion",
                 "granite-docling", "exaone4"),
        "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
        "qwen35": ("qwen35",),
        "poro": ("poro-chat", "bloom", "gpt3-finnish"),
        "chatglm4": ("chatglm-bpe", "glm4", "glm5"),
        "viking": ("viking",),
        "tekken": ("tekken",),
        "chameleon": ("chameleon",),
        "gpt4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
        "granite_emb_multi": ("granite-embed-multi-97m",),
        "tiny_aya": ("tiny_aya", "cohere2moe"),
        "bailingmoe": ("bailingmoe", "bailingmoe2", "llada-moe"),
        "seed_coder": ("seed-coder",),
        "ufakzeka": ("ufakzeka",),
        "grok2": ("grok-2",),
        "laguna": ("laguna",),
        "exaone_moe": ("exaone-moe",),
        "gemma4": ("gemma4", "granite-embed-multi-311m", "sarvam-moe"),
        "minicpm5": ("minicpm5",),
    }
    ignore_merges = {"llama3", "youtu", "tekken", "granite_emb_multi", "minicpm5", "glm4", "glm5"}
    add_bos = {"llama3", "tekken", "chameleon"}
    specs = {}
    for pre_type, pre_names in names.items():
        for name in pre_names:
            specs[name] = PreTokenizerSpec(
                _SPLITS[pre_type], ignore_merges=pre_type in ignore_merges or name in ignore_merges,
                add_bos=pre_type in add_bos, sentencepiece_style=pre_type == "gemma4")
    return specs


GGUF_PRE_TOKENIZERS = MappingProxyType(_specs())
# Names llama.cpp knows but splits with hand-written code (or no BPE at all) that no regex reproduces.
UNSUPPORTED_PRE_TOKENIZERS = MappingProxyType({
    "kimi-k2": "llama.cpp splits it with custom code for Han characters",
    "afmoe": "llama.cpp groups its digits with custom code",
    "superbpe": "its zero-width digit-group split has no 'tokenizers' equivalent verified here",
    "whitespace": "it is a whitespace word model, not byte-level BPE",
})


def pre_tokenizer_spec(pre: str | None) -> PreTokenizerSpec:
    """The spec for a GGUF's `tokenizer.ggml.pre`; a file without one gets llama.cpp's "default".

    Raises ValueError for any other name, listing the supported ones, rather than splitting text
    some other way and producing ids the model never saw.
    """
    spec = GGUF_PRE_TOKENIZERS.get("default" if pre is None else pre)
    if spec is not None:
        return spec
    reason = UNSUPPORTED_PRE_TOKENIZERS.get(pre, "llama.cpp 0.3.36 does not know it either")
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({reason}); supported tokenizer.ggml.pre "
                     f"values: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}")


def split_pre_tokenizer(spec: PreTokenizerSpec) -> list[pre_tokenizers.PreTokenizer]:
    """The spec's regex splits, in order, as `tokenizers` pre-tokenizers."""
    return [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in spec.splits]
