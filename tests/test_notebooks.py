"""Every notebook in notebooks/ runs top to bottom in a fresh Jupyter kernel, offline; any
error in any cell fails the test. Notebooks are stored without outputs."""
import glob
import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_the_notebooks_are_there():
    names = [os.path.basename(p) for p in NOTEBOOKS]
    assert len(names) >= 4 and any("quickstart" in n for n in names), names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernel running this interpreter the way this test runs (with -S when site-packages is
    off, as scripts/dev_test.sh does), so the notebook imports the same ferrum as the suite."""
    home = tmp_path_factory.mktemp("jupyter")
    spec_dir = home / "kernels" / "ferrum-test"
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "ipykernel_launcher",
            "-f", "{connection_file}"]
    (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "ferrum test",
                                                      "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(home)
    yield "ferrum-test"
    if old is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = old


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, kernel_name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")        # a notebook must not need the network
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=600,
                            resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
