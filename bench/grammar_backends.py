"""Grammar (constrained decoding) backends compared on one tokenizer (the default model's): llguidance
(what vllmlite uses), outlines-core, xgrammar and lm-format-enforcer, whichever import.

    python -m bench.grammar_backends                                  # every backend, 3 repetitions
    python -m bench.grammar_backends --quick --backends llguidance   # smoke test, 1 repetition

Per backend: the cold time to build its view of the vocabulary (the tokenizer bridge) and to compile
each case (four JSON schemas of different shapes and one regex). Then per case a walk along a fixed
valid document (the tokenizer's encoding of it): the full allowed-token bitmask ([1, vocab / 32]
int32) before every token and after the last one; each token must be allowed and consumed, and EOS
allowed at the end. A document that breaks one constraint of the case must be refused somewhere on
its walk. Some backends compile lazily (llguidance builds its lexer as the walk goes), so compile +
first mask is reported too, and a second (warm) walk on a fresh matcher from the same compiled
grammar. Times are medians over the repetitions of each repetition's figure (a p99 is over one
walk's masks). `needs_torch`: the distribution requires torch; whether importing it loaded torch is
recorded too, and the disk its files and its direct requirements' files take. A backend that does
not import is "not installed". Raw results: results/bench_grammar_backends.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.grammar_adapters import BACKENDS, GrammarBackend
from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.models.loader import load_model
from vllmlite.tokenizer import HFTokenizer


@dataclass(frozen=True)
class Case:
    """A constraint, a document it accepts and one it must refuse."""

    name: str
    kind: str  # "json" (spec is a schema) or "regex"
    spec: dict | str
    valid: str
    invalid: str


def _object(properties: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": list(properties), "properties": properties}


ADDRESS = _object({"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}})
CASES = [
    Case("flat_bounded_int", "json",
         _object({"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                  "active": {"type": "boolean"}}),
         '{"name":"Ada Lovelace","age":36,"active":true}', '{"name":"Ada Lovelace","age":236,"active":true}'),
    Case("nested_objects", "json",
         _object({"user": _object({"id": {"type": "integer"}, "email": {"type": "string"}, "home": ADDRESS}),
                  "billing": ADDRESS}),
         '{"user":{"id":7,"email":"ada@example.com","home":{"street":"12 St James Sq","city":"London",'
         '"zip":"SW1Y 4JH"}},"billing":{"street":"1 Main St","city":"Springfield","zip":"01101"}}',
         '{"user":{"id":7,"email":"ada@example.com","home":{"street":"12 St James Sq","city":"London"}},'
         '"billing":{"street":"1 Main St","city":"Springfield","zip":"01101"}}'),
    Case("array_of_enums", "json",
         _object({"colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan", "magenta"]},
                             "minItems": 1, "maxItems": 6}}),
         '{"colors":["red","blue","magenta","green"]}', '{"colors":["red","purple"]}'),
    Case("string_pattern", "json",
         _object({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer"}}),
         '{"sku":"ABC-1234","qty":12}', '{"sku":"AB-12345","qty":12}'),
    Case("regex_iso_date", "regex", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
         "2024-02-29", "2024-13-01"),
]


def _is_allowed(bitmask: np.ndarray, token_id: int) -> bool:
    """Bit `token_id % 32` of word `token_id // 32`: token 33 is bit 1 of word 1."""
    return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)


class Walk(NamedTuple):
    mask_s: list[float]  # the time of every mask computed
    accepted_all: bool  # every token was allowed by the mask before it and consumed
    eos_at_end: bool  # ... and the mask after the last one allows EOS


def walk(backend: GrammarBackend, compiled, token_ids: list[int], eos_token_id: int, vocab_size: int) -> Walk:
    """Mask, check and consume each token in turn, then one more mask for EOS; stops at the first
    token the grammar forbids. A fresh matcher from `compiled`, so walks do not disturb each other."""
    matcher = backend.matcher(compiled)
    bitmask = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)  # [1, words]; vocab 49152 -> 1536 words
    mask_s, num_accepted = [], 0
    for token_id in [*token_ids, eos_token_id]:
        bitmask[:] = 0
        start = time.perf_counter()
        backend.fill(matcher, bitmask)
        mask_s.append(time.perf_counter() - start)
        if token_id == eos_token_id or not _is_allowed(bitmask, token_id) or not backend.consume(matcher, token_id):
            break
        num_accepted += 1
    accepted_all = num_accepted == len(token_ids)
    return Walk(mask_s, accepted_all, accepted_all and _is_allowed(bitmask, eos_token_id))


def _repetition(backend: GrammarBackend, tokenizer: HFTokenizer, vocab_size: int, cases: list[Case]) -> dict:
    """One cold pass: build the vocabulary, then per case compile it and walk both documents."""
    start = time.perf_counter()
    vocabulary = backend.vocabulary(tokenizer, vocab_size)
    result = {"vocabulary_s": time.perf_counter() - start, "cases": {}}
    for case in cases:
        start = time.perf_counter()
        try:
            compiled = backend.compile(vocabulary, case.kind, case.spec)
        except Exception as error:  # a backend's refusal is a result, whatever it raises
            result["cases"][case.name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        compile_s = time.perf_counter() - start
        valid_ids = tokenizer.encode(case.valid, add_special_tokens=False)
        cold = walk(backend, compiled, valid_ids, tokenizer.eos_token_id, vocab_size)
        warm = walk(backend, compiled, valid_ids, tokenizer.eos_token_id, vocab_size)  # what the first left cached
        invalid = walk(backend, compiled, tokenizer.encode(case.invalid, add_special_tokens=False),
                       tokenizer.eos_token_id, vocab_size)
        result["cases"][case.name] = {
            "compile_s": compile_s, "mask_s": cold.mask_s, "warm_mask_s": warm.mask_s,
            "accepted_all": cold.accepted_all and warm.accepted_all, "eos_at_end": cold.eos_at_end and warm.eos_at_end,
            "rejects_invalid": not invalid.eos_at_end}
    return result


def _summary(reps: list[dict], name: str) -> dict:
    """One case over the repetitions: medians of each repetition's figures, checks that held in all."""
    runs = [rep["cases"][name] for rep in reps]
    if "error" in runs[0]:
        return {"error": runs[0]["error"]}
    masks_us = [np.array(run["mask_s"]) * 1e6 for run in runs]  # [num_masks] each
    warm_us = [np.array(run["warm_mask_s"]) * 1e6 for run in runs]  # [num_masks] each
    return {
        "compile_ms": statistics.median(run["compile_s"] * 1e3 for run in runs),
        "num_masks": len(masks_us[0]),
        "first_mask_us": statistics.median(float(m[0]) for m in masks_us),
        "compile_and_first_mask_ms": statistics.median(run["compile_s"] * 1e3 + run["mask_s"][0] * 1e3 for run in runs),
        "mask_mean_us": statistics.median(float(m.mean()) for m in masks_us),
        "mask_p99_us": statistics.median(float(np.percentile(m, 99)) for m in masks_us),
        "warm_mask_mean_us": statistics.median(float(m.mean()) for m in warm_us),
        "warm_mask_p99_us": statistics.median(float(np.percentile(m, 99)) for m in warm_us),
        "accepted_all": all(run["accepted_all"] for run in runs),
        "eos_at_end": all(run["eos_at_end"] for run in runs),
        "rejects_invalid": all(run["rejects_invalid"] for run in runs),
    }


def _required_dists(dist: str) -> list[str]:
    """The names of the distribution's unconditional requirements (extras left out)."""
    requirements = importlib.metadata.requires(dist) or []
    return [re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0] for r in requirements if "extra ==" not in r]


def _installed_mb(dist: str) -> float | None:
    """What the distribution's installed files take on disk, or None if it is not installed."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    sizes = (f.locate().stat().st_size for f in files if f.locate().is_file())
    return sum(sizes) / 1e6


def _footprint(dist: str) -> dict:
    """Disk taken by the backend and by each of its direct requirements (not theirs)."""
    requirements = {name: _installed_mb(name) for name in _required_dists(dist)}
    own = _installed_mb(dist)
    return {"installed_mb": own, "requirements_mb": requirements,
            "with_requirements_mb": own + sum(mb for mb in requirements.values() if mb)}


def measure(name: str, tokenizer: HFTokenizer, vocab_size: int, cases: list[Case], num_repetitions: int) -> dict:
    """One backend's report: "not installed" if it does not import, else its timings and checks."""
    torch_before = "torch" in sys.modules
    try:
        backend = BACKENDS[name]()
    except ImportError as error:
        return {"status": "not installed", "detail": str(error)}
    torch_after_import = "torch" in sys.modules
    reps = [_repetition(backend, tokenizer, vocab_size, cases) for _ in range(num_repetitions)]
    return {
        "status": "ok", "version": importlib.metadata.version(backend.dist),
        "needs_torch": "torch" in _required_dists(backend.dist), "torch_loaded_before": torch_before,
        "torch_loaded_by_import": torch_after_import and not torch_before,
        "torch_loaded_after_run": "torch" in sys.modules, **_footprint(backend.dist),
        "vocabulary_ms": statistics.median(rep["vocabulary_s"] * 1e3 for rep in reps),
        "cases": {case.name: _summary(reps, case.name) for case in cases},
    }


def format_table(backends: dict[str, dict]) -> str:
    """Per backend its vocabulary line, then one line per case: compile ms, compile + first mask ms,
    mean / p99 mask us, and the checks (valid document accepted, EOS at its end, invalid refused)."""
    lines = [f"{'backend':18} {'case':18} {'compile ms':>10} {'+1st mask':>9} {'mean us':>8} {'p99 us':>8} "
             f"{'warm mean':>9} {'p99':>6}  valid eos   refuses-invalid"]
    for name, report in backends.items():
        if report["status"] != "ok":
            lines.append(f"{name:18} {report['status']}")
            continue
        torch = "needs torch" if report["needs_torch"] else "no torch"
        lines.append(f"{name:18} {'(vocabulary)':18} {report['vocabulary_ms']:10.1f}  {report['version']}, {torch}, "
                     f"{report['with_requirements_mb']:.0f} MB with its direct requirements")
        for case, row in report["cases"].items():
            if "error" in row:
                lines.append(f"{'':18} {case:18} error: {row['error'][:80]}")
                continue
            lines.append(f"{'':18} {case:18} {row['compile_ms']:10.1f} {row['compile_and_first_mask_ms']:9.1f} "
                         f"{row['mask_mean_us']:8.0f} {row['mask_p99_us']:8.0f} {row['warm_mask_mean_us']:9.0f} "
                         f"{row['warm_mask_p99_us']:6.0f}  {row['accepted_all']!s:5} "
                         f"{row['eos_at_end']!s:5} {row['rejects_invalid']!s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    num_repetitions = 1 if args.quick else args.repetitions
    machine = machine_info()
    loaded = load_model(args.model, "float32", 0)
    tokenizer, vocab_size = loaded.tokenizer, loaded.config.vocab_size
    for case in CASES:  # the walk must feed exactly the document
        assert tokenizer.decode(tokenizer.encode(case.valid, add_special_tokens=False)) == case.valid, case.name
    backends = {}
    for name in args.backends.split(","):
        print(f"{name} ...", file=sys.stderr)
        backends[name] = measure(name, tokenizer, vocab_size, CASES, num_repetitions)
    result = {
        "machine": dict(machine, loadavg_end=list(os.getloadavg())), "command": module_command("bench.grammar_backends", argv), "model": args.model,
        "vocab_size": vocab_size, "num_repetitions": num_repetitions,
        "cases": [{"name": c.name, "kind": c.kind, "spec": c.spec, "valid": c.valid, "invalid": c.invalid,
                   "num_valid_tokens": len(tokenizer.encode(c.valid, add_special_tokens=False))} for c in CASES],
        "backends": backends,
    }
    print(format_table(backends))
    out = args.out or REPO_ROOT / "results" / ("bench_grammar_backends_quick.json" if args.quick
                                               else "bench_grammar_backends.json")
    write_json(out, result)
    print(f"wrote {out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
