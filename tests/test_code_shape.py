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


MAX_TRACKED_OUTSIDE_ASSETS = 40 * 2**20  # bytes: the checkout travels with every GPU call


def tracked_bytes_outside_assets(root: Path) -> tuple[int, list[tuple[int, str]]]:
    """(total bytes, the five largest (bytes, path)) of the files git tracks under ``root``
    outside ``specjax/assets/`` (the shipped model assets, stored once, where they load)."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    sizes = [((root / name).stat().st_size, name) for name in names
             if name and not name.startswith("specjax/assets/") and (root / name).is_file()]
    return sum(size for size, _ in sizes), sorted(sizes)[-5:]


def test_tracked_files_outside_the_assets_stay_under_40_mib():
    total, largest = tracked_bytes_outside_assets(ROOT)
    assert total <= MAX_TRACKED_OUTSIDE_ASSETS, (
        f"{total / 2**20:.1f} MiB tracked outside specjax/assets (limit 40): store large "
        f"artifacts once, where the code loads them; largest: {largest}")


def test_the_size_check_counts_a_large_file(tmp_path):
    import subprocess

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "big.bin").write_bytes(b"\0" * 3000)
    (tmp_path / "specjax" / "assets").mkdir(parents=True)
    (tmp_path / "specjax" / "assets" / "shipped.bin").write_bytes(b"\0" * 5000)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    assert tracked_bytes_outside_assets(tmp_path) == (3000, [(3000, "big.bin")])
