"""What ``pip install specjax`` installs: every module of the source folders, under the
name the code imports it by (the wheel, not the editable install the tests run from)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _expected_modules() -> set[str]:
    """Installed path of every ``.py`` file in a package folder of the source tree."""
    expected = set()
    for package, folder in _config()["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT / folder)
            expected.add("/".join([*package.split("."), *relative.parts]))
    # A folder mapped under another (specjax.kernels inside specjax) is not also in specjax/.
    return expected


def test_every_package_folder_is_listed():
    """A folder holding an ``__init__.py`` that ``packages`` leaves out is missing from the
    wheel (``specjax.methods`` was, while every test passed from the source tree)."""
    config = _config()
    listed = set(config["packages"])
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            name = ".".join([*package.split("."), *relative.parts])
            assert name in listed, f"{name} ({init.parent.relative_to(ROOT)}) is not in " \
                                   "pyproject.toml's [tool.setuptools] packages"


def test_wheel_holds_every_module(tmp_path):
    """Builds the wheel from a copy of the source (setuptools' ``build/`` folder in the
    checkout would keep modules an earlier build listed) with this environment's build
    backend (no network), and checks that it holds every module of the source folders."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in set(_config()["package-dir"].values()):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("specjax-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = sorted(_expected_modules() - names)
    assert not missing, f"the wheel lacks {len(missing)} modules, e.g. {missing[:5]}"
