"""The package's layers: dependencies point one way, from the command line down to the model (the import-linter
contract in pyproject.toml), and no module hides an import of a cats module inside a function."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "cats"


def test_the_layer_contract_holds():
    command = shutil.which("lint-imports")
    if command is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    done = subprocess.run([command], cwd=SOURCE.parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_no_function_imports_a_cats_module():
    hidden = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    names = ([inner.module or ""] if isinstance(inner, ast.ImportFrom)
                             else [a.name for a in inner.names] if isinstance(inner, ast.Import) else [])
                    if any(n == "cats" or n.startswith("cats.") for n in names):
                        hidden.append(f"{path.relative_to(SOURCE)}:{inner.lineno}")
    assert not hidden, f"function-local imports of cats modules: {hidden}"


def test_no_python_file_is_over_500_lines():
    long = {str(p.relative_to(SOURCE)): n for p in SOURCE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
