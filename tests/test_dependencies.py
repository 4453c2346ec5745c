"""Every package the server imports is declared in pyproject.toml: a plain `pip install .` must run it
(a dependency that only arrives with the dev tools works in the tests and fails in the image)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_a_declared_dependency():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {normalized(re.split(r"[ <>=!~;\[]", spec, maxsplit=1)[0]) for spec in declared}
    imported = set()
    for path in (ROOT / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    # tomllib is stdlib from 3.11 (3.10's sys.stdlib_module_names lacks it); tomli: 3.10 only, declared with its marker
    third_party = imported - set(sys.stdlib_module_names) - {"server", "__future__", "tomllib", "tomli"}
    distributions = packages_distributions()
    missing = sorted(m for m in third_party if not names & {normalized(d) for d in distributions.get(m, [m])})
    missing = [m for m in missing if m not in optional_and_lazy()]
    assert not missing, f"imported by server/ but not declared in pyproject.toml: {missing}"


def optional_and_lazy(root: Path = ROOT) -> set[str]:
    """Packages of an optional extra (dev aside: the tests' tools) imported only by server modules that no server
    module imports at its top level (so a plain install runs without them: triton, the GPU's kernels)."""
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    optional = {
        normalized(re.split(r"[ <>=!~;\[]", s, maxsplit=1)[0]) for k, v in extras.items() if k != "dev" for s in v
    }
    top_level: dict[str, set[str]] = {}  # module -> what it imports at its top level
    for path in (root / "server").rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        names = top_level.setdefault(name, set())
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    lazy = set()
    for package in optional:
        importers = {m for m, names in top_level.items() if any(n.split(".")[0] == package for n in names)}
        if importers and not any(importers & names for names in top_level.values()):
            lazy.add(package)
    return lazy


def test_an_optional_package_is_imported_lazily():
    """triton (the `triton` extra) is imported by server/kv/triton_attention.py alone, which no module imports at
    its top level: the Triton backend imports it when it is built."""
    assert optional_and_lazy() == {"triton"}


def test_lint_checks_the_lowest_python_claimed():
    """mypy and ruff check the Python that requires-python admits first: what a later one added fails `make lint`."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lowest = re.fullmatch(r">=\s*3\.(\d+)", pyproject["project"]["requires-python"])
    assert lowest, pyproject["project"]["requires-python"]
    assert pyproject["tool"]["mypy"]["python_version"] == f"3.{lowest[1]}"
    assert pyproject["tool"]["ruff"]["target-version"] == f"py3{lowest[1]}"


def test_an_optional_package_imported_at_the_top_of_the_import_chain_is_not_lazy(tmp_path):
    (tmp_path / "server").mkdir()
    extras = '[project.optional-dependencies]\ngpu = ["triton"]\ndev = ["pytest"]\n'
    (tmp_path / "pyproject.toml").write_text(extras)
    (tmp_path / "server" / "gpu.py").write_text("import triton\n")
    (tmp_path / "server" / "tools.py").write_text("import pytest\n")  # a dev package: never optional
    (tmp_path / "server" / "app.py").write_text("from server import gpu\n")
    assert optional_and_lazy(tmp_path) == set()
    (tmp_path / "server" / "app.py").write_text("def load():\n    from server import gpu\n")
    assert optional_and_lazy(tmp_path) == {"triton"}
