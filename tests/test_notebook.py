"""The quick-start notebook runs top to bottom on a CPU (small settings), so it never rots:
here, and in a Jupyter that has specjax as ``pip install`` gives it and no matplotlib."""

import os
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from conftest import TEST_CACHE_ENV
from test_packaging import library_venv, venv_environment  # noqa: F401 (a fixture)

NOTEBOOK = Path(__file__).resolve().parents[1] / "benchmarks" / "notebooks" / "quickstart.ipynb"


def _text_outputs(notebook) -> str:
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                texts.append(output["text"])
            elif "data" in output and "text/plain" in output["data"]:
                texts.append(output["data"]["text/plain"])
    return "\n".join(texts)


def _check_outputs(notebook, workdir: Path) -> set[str]:
    """Asserts what every run shows; returns the kinds of rich output the cells made."""
    text = _text_outputs(notebook)
    assert "on cpu in float32" in text
    # Greedy staged output is ar's, in the single generation and in the timing loop.
    assert "same tokens as ar: True" in text
    assert "all outputs identical to ar: True" in text
    assert "'draft':" in text and "'target':" in text  # tokens by origin were shown
    assert os.listdir(workdir) == []  # the notebook writes no files
    return {kind for cell in notebook.cells for output in cell.get("outputs", [])
            for kind in output.get("data", {})}


def _shared_programs() -> dict[str, str]:
    """The two runs of the notebook compile the same programs of the real model: they keep
    them in one folder of the test run's compilation cache (tests/conftest.py), the
    program's own cache (``SPECJAX_COMPILATION_CACHE``), so that whichever runs second loads
    them (38 s for the first run alone here, 28 s for the second, 2026-11-29). Its own
    folder: the program's cache drops its least recently used entries past 2 GiB, and the
    run's folder holds every test's programs."""
    run_cache = os.environ.get(TEST_CACHE_ENV, "off")
    if run_cache.lower() == "off":
        return {}
    return {"SPECJAX_COMPILATION_CACHE": os.path.join(run_cache, "quickstart-notebook")}


@pytest.mark.slow
def test_quickstart_notebook_executes_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for name, value in _shared_programs().items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # A cell that raises fails the test with the cell's traceback (CellExecutionError).
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()

    kinds = _check_outputs(notebook, tmp_path)
    assert {"text/html", "image/png"} <= kinds  # the coloured tokens and the speedup plot


# Runs the notebook with the environment's own Jupyter kernel (the kernel's `python` is the
# interpreter running this), writing the executed notebook even when a cell fails.
RUNNER = """
import sys
import nbformat
from nbclient import NotebookClient

notebook = nbformat.read(sys.argv[1], as_version=4)
try:
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": sys.argv[3]}}).execute()
finally:
    nbformat.write(notebook, sys.argv[2])
"""


@pytest.mark.slow
def test_quickstart_notebook_runs_without_matplotlib(library_venv, tmp_path):
    """Opened in a Jupyter whose environment has only specjax (as ``pip install`` gives it,
    with the default model), no matplotlib and no torch: every cell runs, and the plot
    cell says why it draws nothing."""
    workdir, executed = tmp_path / "work", tmp_path / "executed.ipynb"
    workdir.mkdir()
    result = subprocess.run(
        [str(library_venv), "-c", RUNNER, str(NOTEBOOK), str(executed), str(workdir)],
        env=venv_environment() | {"SPECJAX_NOTEBOOK_SMALL": "1"} | _shared_programs(),
        capture_output=True,
        text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    notebook = nbformat.read(executed, as_version=4)
    kinds = _check_outputs(notebook, workdir)
    assert "matplotlib is not installed: no plot" in _text_outputs(notebook)
    assert "text/html" in kinds and "image/png" not in kinds


def test_the_install_cell_installs_from_the_clone_it_is_in(monkeypatch):
    """No placeholder URL to edit: opened from a clone (Jupyter runs it in
    benchmarks/notebooks/), the install cell installs that clone."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    source = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert "OWNER" not in source
    install = next(cell.source for cell in notebook.cells if "def clone_root" in cell.source)
    namespace: dict = {"os": os}
    exec(install.split("if importlib.util.find_spec")[0], namespace)  # the definitions
    monkeypatch.chdir(NOTEBOOK.parent)
    assert namespace["clone_root"]() == str(NOTEBOOK.parents[2])
