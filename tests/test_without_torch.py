"""The suite without torch and transformers (the `test-core` extra, where PyTorch's wheels cannot be
fetched): every test that needs them skips, saying which extra brings them, and none errors.

A child pytest runs with torch, transformers and torchft made unfindable (a `sitecustomize` that
hides them from the import system, as where they are not installed: `importlib.util.find_spec`
returns None, `import torch` raises ModuleNotFoundError). It runs the tests that need torch, which
skip before doing anything, and collects the modules that skip whole; each must be reported
skipped with its reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from helpers import ROOT

HIDE = '''import sys
from importlib.machinery import PathFinder

HIDDEN = {"torch", "transformers", "torchft"}


class WithoutTorch(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in HIDDEN else super().find_spec(name, path, target)


sys.meta_path[:] = [WithoutTorch if f is PathFinder else f for f in sys.meta_path]
'''

# Each test that needs torch or transformers, and the words its skip must say.
TORCH = "'.[test]'"
NEEDS = {
    **{f"tests/test_hf.py::{name}": TORCH for name in (
        "test_read_gpt2_gives_torchs_logits",
        "test_read_gpt2_without_the_transformer_prefix_untied_and_exact_gelu",
        "test_write_gpt2_loads_in_transformers_with_the_same_logits",
        "test_an_untied_jaxdp_gpt_round_trips_through_transformers",
        "test_docs_a_gpt_trained_from_scratch_exports_and_transformers_agrees",
        "test_export_writes_a_directory_transformers_loads",
        "test_docs_init_from_and_export_commands")},
    "tests/test_oracles.py::test_bf16_is_bit_identical_to_ddp_bf16_compress_hook": TORCH,
    "tests/test_oracles.py::test_powersgd_equals_ddp_powersgd_hook_in_float64": TORCH,
    "tests/test_bench.py::test_gpt_vs_torch_reports_both_sides_per_batch_size": TORCH,
    # torchft needs torch: these modules skip whole, naming the elastic extra
    **{f"tests/{name}.py": "[elastic]" for name in (
        "test_elastic_ft", "test_elastic_ft_overlap", "test_elastic_ft_paced", "test_elastic_ft_rounds",
        "test_elastic_shard_params")},
}


def test_without_torch_every_test_that_needs_it_skips_naming_the_extra(tmp_path):
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hide"), *filter(None, [env.get("PYTHONPATH")])])
    hidden = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; import datasets; "
                             "sys.exit(u.find_spec('torch') is not None or datasets.config.TORCH_AVAILABLE)"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert hidden.returncode == 0, hidden.stderr  # the child below sees no torch, as a machine without it

    report = tmp_path / "report.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}", *NEEDS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes: dict[str, list[tuple[str, str, str]]] = {}  # path -> (test, outcome, what it said)
    for case in ET.parse(report).getroot().iter("testcase"):
        module, name = case.get("classname"), case.get("name")  # a module skipped whole: ("", "tests.test_x")
        path = (module or name).replace(".", "/") + ".py"
        result = next((child for child in case if child.tag in ("skipped", "error", "failure")), None)
        said = "" if result is None else f"{result.get('message', '')} {result.text or ''}"
        outcomes.setdefault(path, []).append((name if module else "", "passed" if result is None else result.tag, said))
    for item, words in NEEDS.items():
        path, _, name = item.partition("::")
        found = [o for o in outcomes.get(path, []) if o[0] == name or o[0].startswith(f"{name}[")]
        assert found, (item, outcomes)
        for case, outcome, said in found:
            assert outcome == "skipped" and words in said, (item, case, outcome, said)
