"""The product's layering, checked on its source (ast, nothing imported):

- the product (the packages a `pip install` ships: pyproject's [tool.setuptools.packages.find]) never imports the
  lab (lab/, benchmarks/) or the tests: they import the product, and a product that needs them fails once
  installed without them;
- the environment is read in one place, runtime/settings.py (RuntimeOptions, the launcher's hand-over, the run's
  secret): a knob read anywhere else is one that `dataflow run --set`, the options file and the run summary never see.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("dataflow", "graph_ir", "lowering", "runtime", "kernels", "models")
NOT_PRODUCT = ("lab", "benchmarks", "tests")
SETTINGS = Path("runtime/settings.py")
ENV_NAMES = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")


def product_files() -> list[Path]:
    return sorted(p.relative_to(ROOT) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))


def _tree(path: Path) -> ast.AST:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=str(path))


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import, at any depth (a lazy import inside a function counts)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def environment_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every touch of the process environment: os.environ / os.getenv / ..., or those names
    imported from os."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            out.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            out += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in ENV_NAMES]
    return out


def test_the_product_files_are_found():
    files = product_files()
    assert SETTINGS in files and Path("dataflow/cli.py") in files and len(files) > 50


def test_the_product_never_imports_the_lab_or_the_tests():
    bad = [f"{path}:{line}: imports {mod}" for path in product_files() for line, mod in imported_modules(_tree(path))
           if mod.split(".")[0] in NOT_PRODUCT]
    assert not bad, "the product imports the lab (invert it: the lab hands its objects in):\n" + "\n".join(bad)


def test_the_environment_is_read_only_in_the_settings_module():
    bad = [f"{path}:{line}: {what}" for path in product_files() if path != SETTINGS
           for line, what in sorted(environment_uses(_tree(path)))]
    assert not bad, ("environment read outside runtime/settings.py (make it a RuntimeOptions field, or read it "
                     "through settings.launch_environment()):\n" + "\n".join(bad))


@pytest.mark.parametrize("source, imports, env", [
    ("import lab.bench\nfrom lab import x\n", ["lab.bench", "lab"], []),
    ("def f():\n    from benchmarks.x import y\n    return os.environ.get('A')\n", ["benchmarks.x"], ["os.environ"]),
    ("from os import getenv\nimportlib.import_module('lab.report')\n", ["os", "lab.report"], ["from os import getenv"]),
    ("from .lab import x\nos.path.join('a')\n", [], []),  # a relative import names a sibling, not the lab
])
def test_the_checks_see_what_they_look_for(source, imports, env):
    tree = ast.parse(source)
    assert [m for _, m in imported_modules(tree)] == imports
    assert [w for _, w in environment_uses(tree)] == env
