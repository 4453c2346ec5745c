"""Imports point one way (DESIGN.md): http -> serving -> engine -> kv -> sessions.

Each rule is checked twice: on the source (every import statement, wherever it sits) and in a fresh
interpreter that imports every module of the folder and then looks at what got loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[1] / "server"
WEB = ("fastapi", "pydantic", "pydantic_settings", "starlette", "sse_starlette", "uvicorn")
ABOVE_ENGINE = (
    "server.http",
    "server.openai",
    "server.anthropic",
    "server.serving",
    "server.app",
    "server.settings",
    "server.metrics",
    "server.wire",
)
RULES = {  # folder -> module prefixes it must not import
    "sessions": (*WEB, *ABOVE_ENGINE, "torch", "transformers", "safetensors", "server.engine", "server.kv"),
    "kv": (*WEB, *ABOVE_ENGINE, "server.engine", "server.models", "server.hosting"),
    "engine": (*WEB, *ABOVE_ENGINE, "server.hosting"),
    "models": (*WEB, *ABOVE_ENGINE, "server.engine", "server.hosting"),
    "openai": ("server.engine", "server.kv", "server.models", "server.serving", "server.http", "torch"),
    "anthropic": ("server.engine", "server.kv", "server.models", "server.serving", "server.http", "torch"),
    "serving": ("server.http", "server.app"),
}


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder", sorted(RULES))
def test_sources_import_only_downwards(folder):
    files = sorted((SERVER / folder).rglob("*.py"))
    assert len(files) >= 3, f"server/{folder} is missing"
    for path in files:
        bad = sorted(name for name in imported_names(path) if is_under(name, RULES[folder]))
        assert not bad, f"server/{folder}/{path.name} imports {bad}"


@pytest.mark.parametrize("folder", sorted(RULES))
def test_modules_load_without_what_they_must_not_import(folder):
    code = (
        "import sys, pkgutil, importlib\n"
        f"package = importlib.import_module('server.{folder}')\n"
        f"for m in pkgutil.walk_packages(package.__path__, 'server.{folder}.'): importlib.import_module(m.name)\n"
        f"bad = sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in {RULES[folder]!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing server/{folder} loads {out.stdout.strip()}"


def test_nothing_below_the_http_edge_imports_it():
    for path in sorted(SERVER.rglob("*.py")):
        if path.parent.name == "http" or path.parent.parent.name == "http" or path.name in ("app.py", "__main__.py"):
            continue
        bad = sorted(n for n in imported_names(path) if is_under(n, ("server.http",)))
        assert not bad, f"{path.relative_to(SERVER)} imports {bad}"
