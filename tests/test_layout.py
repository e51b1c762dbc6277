"""The house's guards: the package's shape stays readable (docs/design.md, "Layout").

- at most 15 modules at jaxdp/'s top level: the entry points, the public face and a few leaves; everything else
  lives in a subpackage named after what a reader looks for;
- no module outside jaxdp/bench/ over 450 lines;
- importing a subpackage imports nothing else (lazy `__init__`s), so `--help` and the launcher start without JAX;
- `fit` reads in about a screen.
The import layers and "no JAX in the launcher, config or registry" are import-linter's contracts (pyproject.toml,
`lint-imports` in .ci/run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxdp"
MAX_TOP_LEVEL = 15
MAX_LINES = 450
MAX_FIT_LINES = 80


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_module_outside_bench_is_long():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if "bench" not in p.relative_to(PACKAGE).parts and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_subpackages_load_lazily_and_the_launcher_imports_no_jax():
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "bench")
    code = ("import sys\n"
            f"for name in {subpackages!r}: __import__('jaxdp.' + name)\n"
            "import jaxdp.launch, jaxdp.config, jaxdp.registry, jaxdp.launcher.workers, jaxdp.launcher.rendezvous\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'orbax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_fit_reads_in_a_screen():
    from jaxdp.loop import trainer

    tree = ast.parse(Path(trainer.__file__).read_text())
    fit = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "fit")
    assert fit.end_lineno - fit.lineno + 1 <= MAX_FIT_LINES
