"""The stored notebooks execute cleanly (each under 60 s) when the `notebooks` extra is installed (slow tier)."""

import pathlib
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks_optional").glob("*.ipynb"))


def test_the_three_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_online_softmax.ipynb", "02_tiles_and_causal_skipping.ipynb", "03_v1_vs_v2.ipynb"]


# slow tier: a Jupyter kernel per notebook, about 22 s for the three on 2 cores (CI runs the tier too)
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_without_error(path, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="needs the optional 'notebooks' extra (nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="needs the optional 'notebooks' extra (nbclient)")
    pytest.importorskip("ipykernel", reason="needs the optional 'notebooks' extra (ipykernel)")
    pytest.importorskip("matplotlib", reason="needs the optional 'notebooks' extra (matplotlib)")
    nb = nbformat.read(path, as_version=4)
    stored_images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert stored_images >= 1, "the stored notebook should carry its pictures"
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises on a failing cell
    assert time.perf_counter() - start < 60
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images == stored_images
