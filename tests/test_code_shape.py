"""The library's shape (issue 42): no function in specjax/, kernels/ or checkpoints_tools/
runs over 120 lines, and ``decode.py`` (the drivers and the compile cache) stays under 400
lines. A failure names each offender."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("specjax", "kernels", "checkpoints_tools")
MAX_FUNCTION_LINES = 120
MAX_DECODE_LINES = 400


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_the_check_catches_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(130))
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [("f", 131)]
    assert long_functions("def g():\n    return 1\n", MAX_FUNCTION_LINES) == []


@pytest.mark.parametrize("package", LIBRARY)
def test_no_library_function_is_over_120_lines(package):
    offenders = [f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
                 for path in sorted((ROOT / package).rglob("*.py"))
                 for name, lines in long_functions(path.read_text(), MAX_FUNCTION_LINES)]
    assert not offenders, "split these functions:\n" + "\n".join(offenders)


def test_decode_keeps_only_the_drivers():
    lines = len((ROOT / "specjax" / "decode.py").read_text().splitlines())
    assert lines < MAX_DECODE_LINES, f"specjax/decode.py has {lines} lines"
