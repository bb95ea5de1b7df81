"""notebooks/quickstart.ipynb runs from top to bottom, in a kernel on this interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_the_notebook_is_saved_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_the_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel spec named python3 that runs this interpreter (the virtualenv's), found first because
    # JUPYTER_PATH comes before every other kernel folder.
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (autotune tests)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's future default; no deprecation
    monkeypatch.setenv("AUTOTUNE_NOTEBOOK_BUDGET", "3")
    # AUTOTUNE_CACHE_DIR is already a temporary folder (conftest.py); the kernel inherits it.

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

    text = "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "from_cache=False" in text  # the first call measured
    assert "from_cache=True in" in text  # the second was a cache hit
    assert "samples/s" in text and "over PyTorch's defaults" in text
    assert "steps of" in text  # the training loop ran
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert images, "the plot is displayed"
    assert (tmp_path / "autotune-quickstart.png").stat().st_size > 0
