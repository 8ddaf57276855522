"""Every test the README and the guide name as backing a guarantee exists and is run by
one of CI's tiers, so a renamed, deleted or deselected test cannot leave a claim pointing
at nothing. A reference is ``tests/test_x.py``, ``tests/test_x.py::test_name`` or, right
after one of those, ``::test_name`` (same file); the README names test functions only.

A tier is a make target that ``.ci/run`` runs: its test files and its marker expression
(:data:`TIERS`, checked against the Makefile and ``.ci/run``). A named function is run by a
tier when its file is among the tier's and one of its parametrized cases carries marks that
the expression selects."""

from __future__ import annotations

import ast
import importlib
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/guide.md")
TPU_FILES = ("tests/test_tpu_compile.py", "tests/test_kernel_windows_tpu.py")
# CI's tiers (.ci/run): make target -> (its test files, None for all; its -m expression).
TIERS = {
    "test": (None, "not slow"),
    "test-tpu-slow": (TPU_FILES, "tpu_compiler and slow"),
    "test-tpu-fast": (TPU_FILES, "tpu_compiler and not slow"),
    "test-gpu": (("tests/test_gpu_compile.py",), "not slow"),
    "test-slow": (None, "slow and not tpu_compiler"),
}
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


def test_the_readme_names_test_functions_not_files():
    files = [path for path, name in references((ROOT / "README.md").read_text()) if name is None]
    assert files == [], f"the README cites whole files for its claims: {files}"


def test_the_tiers_are_the_ones_ci_runs():
    makefile = (ROOT / "Makefile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    suites = re.search(r"^for suite in ([\w -]+);", ci, re.MULTILINE)
    assert suites, "no `for suite in ...` loop in .ci/run"
    run = {"test-" + name for name in suites.group(1).split()}
    run |= set(re.findall(r"^make (test[\w-]*)", ci, re.MULTILINE))
    assert run == set(TIERS), (run, set(TIERS))
    for target, (files, expression) in TIERS.items():
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
        assert recipe, f"no `{target}` target in the Makefile"
        body = recipe.group(1)
        if "$(TPU_PYTEST)" in body:
            body += re.search(r"^TPU_PYTEST :=(.*\n(?:\t.*\n)*)", makefile, re.MULTILINE).group(1)
        assert f'-m "{expression}"' in body, (target, body)
        for file in files or ():
            assert file in body, (target, file)


def _mark_names(marks) -> set[str]:
    if not isinstance(marks, (list, tuple)):
        marks = [marks]
    return {getattr(mark, "name", None) or mark.mark.name for mark in marks}


def case_marks(function, module=None) -> list[set[str]]:
    """The mark names of each parametrized case of a test function (with its module's)."""
    own = getattr(function, "pytestmark", [])
    base = _mark_names(own) | _mark_names(getattr(module, "pytestmark", []))
    choices = []
    for mark in own:
        if mark.name == "parametrize":
            choices.append([_mark_names(getattr(value, "marks", ())) for value in mark.args[1]])
    return [base.union(*combination) for combination in itertools.product(*choices)]


class _Marks(dict):
    def __missing__(self, name):
        return False


def tiers_running(path: str, marks_per_case: list[set[str]]) -> list[str]:
    """The tiers that run any of a test's cases."""
    return [target for target, (files, expression) in TIERS.items()
            if (files is None or path in files)
            and any(eval(expression, {"__builtins__": {}},  # noqa: S307 -- and/or/not of names
                         _Marks({name: True for name in marks}))
                    for marks in marks_per_case)]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_named_test_is_run_by_a_ci_tier(document):
    for path, name in references((ROOT / document).read_text()):
        if name is None:
            continue
        module = importlib.import_module(Path(path).stem)
        function = getattr(module, name)
        assert tiers_running(path, case_marks(function, module)), \
            f"{document} names {path}::{name}, which no CI tier runs"


def test_the_tier_check_catches_a_test_no_tier_runs():
    @pytest.mark.slow
    @pytest.mark.tpu_compiler
    def compiled_for_tpu():  # the slow tier leaves it to the TPU tiers, which run two files
        pass

    @pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.slow)])
    def half_slow(x):
        pass

    assert tiers_running("tests/test_cli.py", case_marks(compiled_for_tpu)) == []
    assert tiers_running(TPU_FILES[0], case_marks(compiled_for_tpu)) == ["test-tpu-slow"]
    assert tiers_running("tests/test_cli.py", case_marks(half_slow)) == ["test", "test-slow"]


# The docs a user reads first stay short; the dated log of results lives in docs/results.md.
LINE_LIMITS = {"README.md": 250, "benchmarks/README.md": 600}


@pytest.mark.parametrize("document", sorted(LINE_LIMITS))
def test_the_first_docs_stay_short(document):
    lines = (ROOT / document).read_text().count("\n")
    assert lines <= LINE_LIMITS[document], f"{document}: {lines} lines"
