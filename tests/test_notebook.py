"""The quick-start notebook runs top to bottom on a CPU (small settings), so it never rots."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

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


@pytest.mark.slow
def test_quickstart_notebook_executes_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # A cell that raises fails the test with the cell's traceback (CellExecutionError).
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()

    text = _text_outputs(notebook)
    assert "on cpu in float32" in text
    # Greedy staged output is ar's, in the single generation and in the timing loop.
    assert "same tokens as ar: True" in text
    assert "all outputs identical to ar: True" in text
    assert "'draft':" in text and "'target':" in text  # tokens by origin were shown
    kinds = {kind for cell in notebook.cells for output in cell.get("outputs", [])
             for kind in output.get("data", {})}
    assert {"text/html", "image/png"} <= kinds  # the coloured tokens and the speedup plot
    assert os.listdir(tmp_path) == []  # the notebook writes no files


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
