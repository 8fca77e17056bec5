"""The API's rooms, read from the source (lazy and TYPE_CHECKING imports included): api/ reaches the
engine only through engine/ (never core/, worker/, kernels/), its sub-rooms never import the server
process, and openai/, ops/ and llamacpp/ never import the Ray room, which sits above them."""

from __future__ import annotations

import ast

import pytest
from paths import REPO_ROOT

API = REPO_ROOT / "vllmlite" / "api"


def imported_modules(path) -> set[str]:
    """Every vllmlite module `path` imports, wherever the import statement sits."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllmlite"):
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names if alias.name.startswith("vllmlite"))
    return modules


def api_modules() -> list:
    return sorted(API.rglob("*.py"))


@pytest.mark.parametrize("path", api_modules(), ids=lambda p: str(p.relative_to(API)))
def test_the_api_imports_no_engine_internals(path):
    below = ("vllmlite.core", "vllmlite.worker", "vllmlite.kernels")
    assert not [m for m in imported_modules(path) if m.startswith(below)]
    assert not [m for m in imported_modules(path) if m.startswith("vllmlite.models")
                and not m.startswith("vllmlite.models.model_source")]


@pytest.mark.parametrize("room", ["openai", "ops", "ray", "llamacpp"])
def test_sub_rooms_never_import_the_server_process(room):
    for path in sorted((API / room).rglob("*.py")):
        assert "vllmlite.api.server" not in imported_modules(path), path


@pytest.mark.parametrize("room", ["openai", "ops", "llamacpp"])
def test_openai_and_ops_never_import_the_ray_room(room):
    for path in sorted((API / room).rglob("*.py")):
        assert not [m for m in imported_modules(path) if m.startswith("vllmlite.api.ray")], path


def test_the_ray_room_is_imported_only_by_the_server_process():
    """Ray is an optional extra: outside api/ray/, only server.main loads it (for --num-replicas)."""
    importers = {str(path.relative_to(API)) for path in api_modules() if not path.is_relative_to(API / "ray")
                 and any(m.startswith("vllmlite.api.ray") for m in imported_modules(path))}
    assert importers == {"server.py"}
