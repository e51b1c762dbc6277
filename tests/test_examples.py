"""examples/: the quickstart notebook executes fresh and shows the strategies' curves coinciding;
the committed copy carries its outputs (so the figure shows on GitHub). `custom_model.py` is run
by tests/test_readme.py, from the README's command.

To refresh the committed outputs after editing the notebook:

    python tests/test_examples.py
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import jax_cache_env

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def execute(path: Path, cwd: Path) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel; the notebook sets its own device count, so the kernel
    must not inherit the test suite's XLA_FLAGS."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps from an older run: noise in diffs
    saved = os.environ.pop("XLA_FLAGS", None)
    cache = jax_cache_env()  # the kernel's (the notebook runs as shown; a rerun loads its compiled programs)
    os.environ.update(cache)
    try:
        NotebookClient(nb, timeout=180, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for key in cache:
            os.environ.pop(key, None)
        if saved is not None:
            os.environ["XLA_FLAGS"] = saved
    return nb


def outputs(nb: nbformat.NotebookNode) -> tuple[str, list[bytes]]:
    text, images = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                raise AssertionError(f"cell raised {out['ename']}: {out['evalue']}")
            text.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            if "image/png" in out.get("data", {}):
                images.append(out["data"]["image/png"])
    return "\n".join(text), images


def check(nb: nbformat.NotebookNode) -> None:
    text, images = outputs(nb)
    assert "8 devices: cpu" in text, text
    assert len(images) == 1, "the notebook should draw exactly one figure (curves + differences)"
    # The notebook asserts agreement itself (assert_allclose, rtol 1e-5); check the printed numbers.
    diffs = dict(re.findall(r"^\s*(psum|ring|host|1 device): max \|Δ loss\| = (\S+)", text, re.M))
    assert sorted(diffs) == ["1 device", "host", "psum", "ring"], text
    assert all(float(v) < 1e-5 for v in diffs.values()), diffs
    first, last = map(float, re.search(r"loss: (\S+) -> (\S+) after", text).groups())
    assert last < first / 5, (first, last)


@pytest.mark.slow
def test_quickstart_notebook_executes_and_curves_coincide(tmp_path):
    copy = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = execute(copy, tmp_path)
    check(nb)


def test_committed_notebook_has_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "commit the notebook executed: python tests/test_examples.py"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "execute it top to bottom, once"
    check(nb)


if __name__ == "__main__":  # execute the notebook and save it with its outputs
    nb = execute(NOTEBOOK, NOTEBOOK.parent)
    check(nb)
    nbformat.write(nb, NOTEBOOK)
    print(f"{NOTEBOOK.relative_to(ROOT)}: executed and saved", file=sys.stderr)


def test_slurm_scripts_activate_the_venv_and_give_srun_its_cpus():
    """Slurm 22.05-23.02 do not pass #SBATCH --cpus-per-task on to srun, and a job that does not
    activate the project's venv fails at `import jax` (checked without a cluster: the text)."""
    for script in (ROOT / "examples" / "slurm").glob("*.sbatch"):
        text = script.read_text()
        assert 'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"' in text, script
        assert 'source "$venv/bin/activate"' in text and text.index("activate\"") < text.index("\nsrun "), script
