"""Every test the README and the guide name as backing a guarantee exists, so a renamed or
deleted test cannot leave a claim pointing at nothing. A reference is ``tests/test_x.py``,
``tests/test_x.py::test_name`` or, right after one of those, ``::test_name`` (same file).
CI runs every test file (``.ci/run``: the quick tier, the TPU and GPU compiles, then the
slow tier), so a claim that names an existing test is checked by CI."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/guide.md")
REFERENCE = re.compile(r"(tests/[\w/]+\.py)?(?:::(\w+))?")
TOKEN = re.compile(r"`(tests/[\w/]+\.py(?:::\w+)?|::\w+)`")


def references(text: str) -> list[tuple[str, str | None]]:
    """(test file, test function or None) for each reference, in order."""
    found, current = [], None
    for token in TOKEN.findall(text):
        path, name = REFERENCE.fullmatch(token).groups()
        current = path or current
        if current is None:
            raise AssertionError(f"{token} names a test before any test file")
        found.append((current, name))
    return found


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")}


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_named_test_exists(document):
    refs = references((ROOT / document).read_text())
    assert refs, f"{document} names no test"
    for path, name in refs:
        assert (ROOT / path).is_file(), f"{document} names {path}, which does not exist"
        if name is not None:
            assert name in _test_names(ROOT / path), \
                f"{document} names {path}::{name}, which is not a test there"


def test_the_check_catches_a_missing_test():
    text = "see `tests/test_cli.py::test_no_such_test_anywhere` and `::test_nor_this`"
    refs = references(text)
    assert refs == [("tests/test_cli.py", "test_no_such_test_anywhere"),
                    ("tests/test_cli.py", "test_nor_this")]
    assert not any(name in _test_names(ROOT / path) for path, name in refs)
