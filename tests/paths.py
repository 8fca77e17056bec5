"""Where the tests find the repository and their golden files, wherever a test file sits under tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
GOLDENS = TESTS / "goldens"
