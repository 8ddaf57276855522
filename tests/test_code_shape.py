"""The library's shape (issues 42 and 58): no function in specjax/, kernels/ or
checkpoints_tools/ runs over 120 lines, ``decode.py`` (the drivers and the compile cache)
stays under 400 lines and ``config.py`` within 400, and the code every family shares never
branches on a family's name. A failure names each offender."""

import ast
import subprocess
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


MAX_CONFIG_LINES = 400  # ModelConfig and its checks: each family's config is its module's
MAX_FILE_LINES = 700


@pytest.mark.parametrize("package", LIBRARY)
def test_no_library_file_is_over_700_lines(package):
    offenders = [f"{path.relative_to(ROOT)}: {lines} lines"
                 for path in sorted((ROOT / package).rglob("*.py"))
                 if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not offenders, "split these files:\n" + "\n".join(offenders)


# Documents of the team's that are not in the repository: nothing tracked may cite them.
OUTSIDE = ("STYLE" + ".md", "DESIGN" + ".md", "../" + "shared/")


def citations(text: str) -> list[str]:
    return [cited for cited in OUTSIDE if cited in text]


def test_the_check_catches_a_citation():
    assert citations("see " + OUTSIDE[0] + ", habit 3") == [OUTSIDE[0]]
    assert citations("see docs/guide.md") == []


def test_nothing_cites_a_file_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".sh", ".toml", ".txt", ".cfg", "") and path.is_file():
            text = path.read_text(errors="replace")
            offenders += [f"{name}: {cited}" for cited in citations(text)]
    assert not offenders, "cites a file outside the repository:\n" + "\n".join(offenders)


def test_config_keeps_only_what_every_family_shares():
    lines = len((ROOT / "specjax" / "config.py").read_text().splitlines())
    assert lines <= MAX_CONFIG_LINES, f"specjax/config.py has {lines} lines"


# Modules that every family shares: they dispatch through specjax.families and branch on
# features, never on a family's name.
FAMILY_FREE = ("specjax/config.py", "specjax/models", "checkpoints_tools/keymap.py",
               "checkpoints_tools/gguf_loader.py", "checkpoints_tools/gguf_reader.py",
               "checkpoints_tools/gguf_tokenizer.py", "checkpoints_tools/hf.py",
               "checkpoints_tools/orbax_io.py")


def _names_a_family(node: ast.AST) -> bool:
    """``x.family``, ``model_type``, ``arch`` or ``cfg.get("model_type")``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "family"
    if isinstance(node, ast.Name):
        return node.id in ("model_type", "arch")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "model_type")


def _is_a_name(node: ast.AST) -> bool:
    """A string literal, or a tuple, list or set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_a_name(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def family_branches(source: str) -> list[int]:
    """Lines of ``source`` that compare a family's name with a literal name."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare)
            and any(_names_a_family(side) for side in [node.left, *node.comparators])
            and any(_is_a_name(side) for side in [node.left, *node.comparators])]


def test_the_check_catches_a_branch_on_a_family_name():
    assert family_branches('if config.family == "gemma2":\n    pass\n') == [1]
    assert family_branches('x = model_type in ("qwen3", "olmo2")\n') == [1]
    assert family_branches('x = cfg.get("model_type") != "phi3"\n') == [1]
    assert family_branches("x = config.family is None or arch in TABLE\n") == []


def test_shared_code_never_branches_on_a_family_name():
    paths = [path for name in FAMILY_FREE for path in (
        sorted((ROOT / name).rglob("*.py")) if (ROOT / name).is_dir() else [ROOT / name])]
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in paths
                 for line in family_branches(path.read_text())]
    assert not offenders, ("a family's name in shared code (move it to its module of "
                           "specjax/families/):\n" + "\n".join(offenders))


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
