"""The suite's own rules: a test module imports shared helpers from the support modules
(tests/support.py, tests/processes.py, tests/strict.py), never from another test module or from
conftest.py, so running or moving one test file never depends on another."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Final

import pytest

TESTS: Final = Path(__file__).resolve().parent
SUITE: Final = sorted(p for p in TESTS.rglob("*.py") if "node_modules" not in p.parts)


def _imported_test_modules(path: Path) -> list[str]:
    """The test modules (`test_*`) and conftest that `path` imports, as written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            # `from . import test_x` names the module in the alias; `from .test_x import y` in `module`
            names = [module] if module else [alias.name for alias in node.names]
        for name in names:
            last = name.rsplit(".", 1)[-1]
            if last.startswith("test_") or last == "conftest":
                found.append(name)
    return found


@pytest.mark.parametrize("path", SUITE, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_module_imports_another(path: Path) -> None:
    assert not _imported_test_modules(path), f"import shared helpers from tests/support.py: {path.name}"


def test_the_check_sees_each_way_of_importing_a_test_module(tmp_path: Path) -> None:
    for line in (
        "from .test_ws import turn",
        "from tests.test_ws import turn",
        "from . import test_ws",
        "import tests.test_ws",
        "from .conftest import RedisProcess",
        "from tests.conftest import RedisProcess",
    ):
        module = tmp_path / "test_x.py"
        module.write_text(line + "\n")
        assert _imported_test_modules(module), line
    ok = tmp_path / "test_ok.py"
    ok.write_text("from . import strict, support\nfrom .support import turn\nfrom tests.processes import free_port\n")
    assert not _imported_test_modules(ok)
