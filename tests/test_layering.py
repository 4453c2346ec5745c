"""Design rule: server/engine never imports the HTTP side (fastapi, pydantic, starlette, server.api, server.schemas)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "server" / "engine"
FORBIDDEN = ("fastapi", "pydantic", "pydantic_settings", "starlette", "sse_starlette", "uvicorn")
FORBIDDEN_LOCAL = ("server.api", "server.schemas", "server.serving", "server.app", "server.settings")


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_sources_import_no_http_code():
    files = sorted(ENGINE.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for name in imported_names(path):
            assert not name.startswith(FORBIDDEN + FORBIDDEN_LOCAL), f"{path.name} imports {name}"


def test_engine_modules_load_without_http_packages():
    code = (
        "import sys, pkgutil, importlib, server.engine as e\n"
        "for m in pkgutil.iter_modules(e.__path__): importlib.import_module('server.engine.' + m.name)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith({FORBIDDEN_LOCAL!r})]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
