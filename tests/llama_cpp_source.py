"""llama.cpp's own test data, from the llama.cpp sources vendored in llama-cpp-python's sdist on PyPI:
`models/ggml-vocab-*.gguf` with their `.inp`/`.out` tokenizations, `models/templates/*.jinja` chat
templates of real models, and `convert_hf_to_gguf.py` with its `gguf-py`.

Found at $VLLMLITE_LLAMA_CPP_SRC (a llama.cpp source tree), else in the cache folder below, which the
first call fills with `pip download` (one 77 MB download; .ci/run does it before the tests). Tests
that need it skip locally without it and fail in CI (`skip_unless_ci`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from functools import lru_cache
from pathlib import Path

VERSION = "0.3.36"  # the llama-cpp-python release whose llama.cpp the serving benchmark's peer is built from
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllmlite" / f"llama-cpp-python-{VERSION}"
SDIST = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
WANTED = ("models/", "convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # what the tests read, under vendor/llama.cpp/


@lru_cache(maxsize=1)
def llama_cpp_source(download: bool = True) -> Path | None:
    """The llama.cpp source tree (the folder holding models/ and convert_hf_to_gguf.py), or None when
    it is not here and cannot be fetched."""
    configured = os.environ.get("VLLMLITE_LLAMA_CPP_SRC")
    if configured:
        return Path(configured)
    tree = CACHE / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    if not download:
        return None
    try:
        _fetch(tree)
    except (OSError, subprocess.CalledProcessError, tarfile.TarError) as error:
        print(f"llama.cpp sources not available: {error}", file=sys.stderr)
        return None
    return tree


def _fetch(tree: Path) -> None:
    """pip download the sdist, then extract only WANTED under `tree` (written to a temporary folder
    first and renamed, so an interrupted extraction never looks complete)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    if not SDIST.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(CACHE), f"llama-cpp-python=={VERSION}"], check=True, timeout=600)
    partial = CACHE / "llama.cpp.partial"
    extract(partial, WANTED)
    partial.rename(tree)


def extract(destination: Path, wanted: tuple[str, ...]) -> None:
    """The paths of the sdist's llama.cpp tree that start with one of `wanted`, under `destination`."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(SDIST) as archive:
        members = []
        for member in archive.getmembers():
            name = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and name.startswith(wanted) and (member.isfile() or member.isdir()):
                member.name = name
                members.append(member)
        archive.extractall(destination, members=members, filter="data")


if __name__ == "__main__":  # python tests/llama_cpp_source.py: fetch now, print where
    print(llama_cpp_source())
