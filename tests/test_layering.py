"""The product's layering, checked on its source (ast, nothing imported):

- the product (the packages a `pip install` ships: pyproject's [tool.setuptools.packages.find]) never imports the
  lab (lab/, benchmarks/) or the tests: they import the product, and a product that needs them fails once
  installed without them;
- the environment is read in one place, runtime/settings.py (RuntimeOptions, the launcher's hand-over, the run's
  secret): a knob read anywhere else is one that `dataflow run --set`, the options file and the run summary never see;
- the size budgets: the runtime core (runtime/core, executors, transport) at most 5,000 code lines, no product file
  over 500 lines, and the product under a ceiling that only goes down. Issue 30's target for the product is 12,000
  code lines; it was 13,431 when this test came (issue 32's families, latent MLA and FP8 had added ~1,000), 12,846
  at the end of session 22, 11,982 in session 23 and 12,285 in session 24. Lower PRODUCT_CODE_LINES when a change makes room; a feature
  that needs more is paid for by cuts, or raising the ceiling is a decision recorded (with its reason) on the
  feature's issue. Code lines as cloc counts them: blank lines, comments and docstrings are free, so a comment
  that says why never costs budget.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("dataflow", "graph_ir", "lowering", "runtime", "kernels", "models")
NOT_PRODUCT = ("lab", "benchmarks", "tests")
SETTINGS = Path("runtime/settings.py")
ENV_NAMES = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")
# The ceiling (module docstring): issue 30's target of 12,000, met in session 23 (11,982), raised in session 24 to 12,300
# by decisions recorded on issues 33 (the graph-driven lowering with replicas and attention ranks, replica choice at
# dispatch, admission by attention ranks: ~+265 after 37 lines of cuts) and 34 (the virtual-clock driver's event
# heaps: +51); product at 12,285 then; lowered to 12,294 in session 26 (the simulation passes paid for themselves);
# 12,300 in session 27 by a decision recorded on issue 34 (the virtual driver's deferred receive at a busy rank,
# cost.busy_receive, which the CPU validation measured as the streaming messages' missing delay: +6); 12,577 in session
# 28 by a decision recorded on issue 34 (a virtual-clock simulation split over processes, runtime/drivers/partitions.py
# and its window in Cluster._run_virtual: the one route to 1,024 ranks x 100 tokens in 10 minutes on 2 cores, +277).
PRODUCT_CODE_LINES = 12_577
RUNTIME_CORE = ("runtime/core", "runtime/executors", "runtime/transport")
RUNTIME_CORE_CODE_LINES = 5_000
FILE_LINES = 500


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


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring (a string statement)."""
    code, doc, previous = set(), set(), None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        lines = range(tok.start[0], tok.end[0] + 1)
        if tok.type == tokenize.STRING and previous in (None, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
            doc.update(lines)
        elif tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code.update(lines)
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            previous = tok.type
    return len(code - doc)


def test_the_product_keeps_its_size_budgets():
    sources = {path: (ROOT / path).read_text(encoding="utf-8") for path in product_files()}
    sizes = {path: code_lines(text) for path, text in sources.items()}
    core = sum(n for path, n in sizes.items() if str(path.parent).startswith(RUNTIME_CORE))
    long = [f"{path}: {n} lines" for path, text in sources.items() if (n := len(text.splitlines())) > FILE_LINES]
    largest = ", ".join(f"{p} {n}" for p, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:8])
    assert sum(sizes.values()) <= PRODUCT_CODE_LINES, f"product: {sum(sizes.values())} code lines; largest: {largest}"
    assert core <= RUNTIME_CORE_CODE_LINES, f"runtime core ({', '.join(RUNTIME_CORE)}): {core} code lines"
    assert not long, "split these by concept:\n" + "\n".join(long)


def test_code_lines_skip_blanks_comments_and_docstrings():
    source = 'def f(x):\n    """Doc\n    string."""\n\n    # why\n    y = (x +\n         1)  # note\n    return "s"\n'
    assert code_lines(source) == 4  # def, the two lines of y, return


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
