"""The README and the docs cannot rot: every command in README.md and docs/*.md is run by a test,
or says why it cannot run here.

Every fenced ```bash (sh, shell, console) and ```python block must be preceded by one marker line:

    <!-- test-command -->                 .ci/run extracts and runs the block (the README's test command)
    <!-- run: tests/FILE.py::TEST -->     TEST runs the block. Blocks marked for a test outside this file
                                          must be read by that test through `readme_blocks(...)` (it
                                          reads README.md and docs/*.md), so the command run is the
                                          command shown.
    <!-- not-run: needs REASON -->        it cannot run on a CPU-only CI machine (GPUs, a Docker
                                          engine, a cluster); the reason says what it needs

A block without a marker, a marker naming a test that does not exist (or does not read the
README), or a not-run marker without a reason fails `test_every_block_is_run_or_says_why_not`.

docs/cli.md, the command-line reference, is generated from `jaxdp.config` by docs/gen_cli.py;
regenerate it with `python docs/gen_cli.py`. docs/api.md names every public name of
jaxdp/__init__.py. Relative links and their anchors must resolve (`mkdocs build --strict`, which
.ci/run runs, checks the site the same way).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import unicodedata

import pytest

from helpers import (DOCS, LOOKS_LIKE_A_COMMAND, MARKER, README, REQUIRED_PAGES, ROOT, SHELLS, blocks,  # noqa: F401
                     commands, jax_cache_env, pages, readme_blocks, run_shell, sandbox)
from jaxdp.cluster.distributed import default_cpu_devices


# ---- the markers ------------------------------------------------------------------------------


def test_every_block_is_run_or_says_why_not():
    problems = []
    for block in blocks():
        if block.lang not in SHELLS + ("python",):
            if LOOKS_LIKE_A_COMMAND.search(block.code):
                problems.append(f"{block.id}: a command in a ```{block.lang} block: make it ```bash and mark it")
            continue  # diagrams, output samples
        if block.marker is None:
            problems.append(f"{block.id}: ```{block.lang} block without a marker (see tests/test_readme.py)")
        elif block.marker == "test-command" and block.lang != "bash":
            problems.append(f"{block.id}: the test command must be a ```bash block")
        elif block.marker == "not-run" and not re.match(r"needs \S", block.target):
            problems.append(f"{block.id}: a not-run marker must say what the block needs: <!-- not-run: needs ... -->")
        elif block.marker == "run":
            problems += [f"{block.id}: {p}" for p in check_run_target(block.target)]
    assert not problems, "\n".join(problems)


def check_run_target(node: str) -> list[str]:
    path, _, name = node.partition("::")
    file = ROOT / path
    if not (path.startswith("tests/") and file.is_file() and name):
        return [f"run marker {node!r} must name a test as tests/FILE.py::TEST"]
    functions = {f.name: f for f in ast.walk(ast.parse(file.read_text())) if isinstance(f, ast.FunctionDef)}
    if name not in functions:
        return [f"{path} has no test {name!r}"]
    if "readme_blocks" not in ast.unparse(functions[name]):
        return [f"{node} does not read its commands with readme_blocks(...), so it may not run what the docs show"]
    return []


def test_marker_check_catches_unmarked_and_stale_blocks(tmp_path):
    text = ("```bash\necho unmarked\n```\n\n<!-- run: tests/test_readme.py::test_gone -->\n```bash\necho\n```\n\n"
            "<!-- not-run: because -->\n```bash\necho\n```\n")
    found = blocks(text)
    assert [b.marker for b in found] == [None, "run", "not-run"]
    assert check_run_target("tests/test_readme.py::test_gone") == ["tests/test_readme.py has no test 'test_gone'"]
    assert check_run_target("tests/test_readme.py::blocks")  # exists, but does not read the README
    assert not check_run_target("tests/test_readme.py::test_shell_blocks")
    assert not re.match(r"needs \S", found[2].target)
    assert LOOKS_LIKE_A_COMMAND.search(blocks("```\npython -m jaxdp.train\n```\n")[0].code)
    assert not LOOKS_LIKE_A_COMMAND.search(blocks("```\ndev0 → dev1   a:0\n```\n")[0].code)


def test_ci_runs_the_test_command_and_builds_the_docs():
    marked = [b for b in blocks() if b.marker == "test-command"]
    assert len(marked) == 1 and marked[0].page == "README.md" and "pytest" in marked[0].code
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in ci
    assert re.search(r"^[^#\n]*mkdocs build --strict", ci, re.M), ".ci/run must build the docs site"


def test_the_top_of_the_readme_is_not_about_ci():
    """A newcomer reads what jaxdp is and how to start; the suite's timing lives in docs/development.md."""
    top = "\n".join(README.read_text().splitlines()[:30])
    assert not re.search(r"\bCI\b|\.ci/run|workers|took \d", top), top


def test_pages_owned_by_others_exist():
    for page, title in REQUIRED_PAGES.items():
        assert (ROOT / page).read_text().splitlines()[0] == title, page


# ---- running the blocks -----------------------------------------------------------------------


@pytest.mark.slow
def test_setup_commands(tmp_path):
    """The train command at the top: its set-up part equals the test command's (which .ci/run
    runs, with the test extra added), and its training part is run here."""
    (train,) = readme_blocks("tests/test_readme.py::test_setup_commands")
    (test,) = [b for b in blocks() if b.marker == "test-command"]
    train_parts = [p.strip() for p in commands(train)[0].split("&&")]
    test_parts = [p.strip() for p in commands(test)[0].split("&&")]
    assert train_parts[:2] == [test_parts[0], test_parts[1].replace("'.[test]'", ".")], (train_parts, test_parts)
    assert train_parts[2].startswith(".venv/bin/python -m jaxdp.train")
    env = sandbox(tmp_path)
    proc = run_shell(train_parts[2].replace(".venv/bin/python", sys.executable, 1), tmp_path, env)
    want = rf"eval_accuracy=0\.9\d+ .*strategy=ring devices={default_cpu_devices()}"  # one per core, 2 to 8
    assert re.search(want, proc.stdout), proc.stdout


# What a command must print besides exiting 0, by how it starts (checked for every match).
EXPECT = {
    "python -m jaxdp.train --help": r"checkpointing:[\s\S]*\(default: psum\)|\(default: psum\)[\s\S]*checkpointing:",
    "python -m jaxdp.train --strategy": r"eval_accuracy=\d",
    "python -m jaxdp.train --model cnn": r"eval_accuracy=\d",
    "python examples/custom_model.py": r"test accuracy 0\.[89]\d* after",
    "python -m jaxdp.launch": r"eval_accuracy=\d.* devices=8",
    "jaxdp-train": r"eval_accuracy=\d",
    "python -m jaxdp.train --model examples.my_models": r"eval_accuracy=0\.[89]",
    "python -c \"import jaxdp; module, params = jaxdp.load_model": r"Classifier loaded",
}


def _marks(block) -> list:
    """A block that starts several processes carries the multiprocess mark."""
    return [pytest.mark.multiprocess] if "jaxdp.launch" in block.code else []


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b))
                                   for b in readme_blocks("tests/test_readme.py::test_shell_blocks")])
def test_shell_blocks(block, tmp_path):
    env = sandbox(tmp_path)
    for command in commands(block):  # one at a time, in the same directory, so outputs can be checked
        proc = run_shell(command, tmp_path, env)
        for start, pattern in EXPECT.items():
            if command.startswith(start):
                assert re.search(pattern, proc.stdout), f"{command}\n{proc.stdout[-3000:]}"


def test_every_output_check_applies_to_a_readme_command():
    shown = [c for b in readme_blocks("tests/test_readme.py::test_shell_blocks") for c in commands(b)]
    unused = [start for start in EXPECT if not any(c.startswith(start) for c in shown)]
    assert not unused, f"EXPECT entries that match no command of the docs (update them): {unused}"


# What each Python block must achieve when it has run (appended to the block, same process).
PYTHON_CHECKS = {
    "linen": 'assert len(jax.devices()) == 8 and int(state.step) == 100\n'
             'logits = model.apply({"params": jax.device_get(state.params)}, batch["x"])\n'
             'assert float(metrics["loss"]) < 0.3 and np.mean(np.argmax(logits, -1) == batch["y"]) > 0.95\n',
    # nnx: trained through make_train_step, and nnx.update put the weights back into the module
    "nnx": 'assert len(jax.devices()) == 8 and int(state.step) == 100\n'
           'assert float(metrics["loss"]) < 0.5 and np.mean(np.argmax(model(batch["x"]), -1) == batch["y"]) > 0.9\n'
           'assert type(params).__name__ == "State" and not jax.tree.leaves(rest)\n',
    # nnx with BatchNorm and dropout: the statistics were trained, synchronised, and put back
    "nnx-batchnorm": 'assert len(jax.devices()) == 8 and int(state.step) == 100\n'
                     'assert float(metrics["loss"]) < 0.5 and np.mean(np.argmax(model(batch["x"]), -1) == batch["y"]) > 0.9\n'
                     'stats = jax.tree.leaves(state.model_state)\n'
                     'assert stats and all(len({a.tobytes() for a in (s.data for s in x.addressable_shards)}) == 1 for x in stats)\n'
                     'assert float(np.abs(np.asarray(model.norm.mean.value)).sum()) > 0\n',
}
@pytest.mark.slow
@pytest.mark.parametrize("block", readme_blocks("tests/test_readme.py::test_python_blocks"), ids=lambda b: b.id)
def test_python_blocks(block, tmp_path):
    kind = ("nnx-batchnorm" if "BatchNorm" in block.code else "nnx") if "from flax import nnx" in block.code else "linen"
    program = ('import jax\njax.config.update("jax_num_cpu_devices", 8)  # as a CPU-only user would\n'
               + block.code + PYTHON_CHECKS[kind] + 'print("checks passed")\n')
    env = {**sandbox(tmp_path), **jax_cache_env()}  # the program runs as shown; a rerun loads its compiled steps
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "checks passed" in proc.stdout, proc.stdout + proc.stderr


def test_both_flax_apis_are_shown():
    """The README's tour shows flax.linen; the Notebook API page shows linen, nnx, and nnx with
    BatchNorm and dropout."""
    kinds = {}
    for b in blocks():  # what the pages show, repeats included (readme_blocks runs a repeat once)
        if (b.marker, b.target) != ("run", "tests/test_readme.py::test_python_blocks"):
            continue
        kind = ("nnx-batchnorm" if "BatchNorm" in b.code else "nnx") if "from flax import nnx" in b.code else "linen"
        kinds.setdefault(b.page, []).append(kind)
    assert kinds == {"README.md": ["linen"], "docs/notebook.md": ["linen", "nnx", "nnx-batchnorm"]}


# ---- generated pages -------------------------------------------------------------------------


def gen_cli():
    """docs/gen_cli.py, the generator of docs/cli.md (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    assert (DOCS / "cli.md").read_text() == gen_cli().cli_reference(), \
        "docs/cli.md is stale: run `python docs/gen_cli.py` and commit docs/cli.md"


def test_cli_reference_matches_help_output():
    from jaxdp.config import build_parser

    help_text = build_parser().format_help()
    page = (DOCS / "cli.md").read_text()
    help_flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", help_text)) - {"--help"}
    table_flags = set(re.findall(r"^\| `(--[a-z][a-z-]+)", page, re.M)) | set(re.findall(r", `(--no-[a-z-]+)`", page))
    negations = {"--no-" + flag[2:] for flag in help_flags}  # a boolean flag's --no- form, listed beside it
    assert help_flags <= table_flags and table_flags - help_flags <= negations
    sections = re.findall(r"^(\w+):$", help_text, re.M)
    assert [s for s in sections if s not in ("options",)] == re.findall(r"^## (\w+)$", page, re.M)[1:]  # after "general"
    assert "(default: psum)" in help_text and "(default: 128)" in help_text


def test_api_reference_lists_every_public_name():
    """docs/api.md has one `::: module.name` per public name, from the module jaxdp/__init__.py
    loads it from; a name moved to another module must move on the page too."""
    tree = ast.parse((ROOT / "jaxdp" / "__init__.py").read_text())
    exports = next(ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS")
    shown = re.findall(r"^::: (\S+)$", (DOCS / "api.md").read_text(), re.M)
    assert len(shown) == len(set(shown))
    assert sorted(shown) == sorted(f"{module}.{name}" for name, module in exports.items())


# ---- links -------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc extension (mkdocs) makes it."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(path) -> set[str]:
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def test_links_and_anchors_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and an anchor into
    a page names one of its headings."""
    problems = []
    for page in pages():
        text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.M | re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_every_source_path_the_docs_name_exists():
    """A path like tests/test_x.py, jaxdp/sync/ring.py or examples/x.py in the text of README.md and
    docs/*.md names a file of the repository (a renamed or deleted one is docs drift)."""
    named = {(page, path) for page in pages()
             for path in re.findall(r"(?<![\w/.-])((?:tests|jaxdp|examples|docker)/[\w/.-]*\w\.(?:py|md|toml|yaml|sh))",
                                    page.read_text())}
    missing = sorted(f"{page.relative_to(ROOT)}: {path}" for page, path in named
                     if not (ROOT / path).exists() and path != "tests/FILE.py")  # (a placeholder)
    assert not missing, "\n".join(missing)


def test_exit_code_table_is_jaxdp_errors():
    from jaxdp.errors import EXIT_CODES

    text = README.read_text()
    table = text[text.index("<!-- exit-codes -->"):text.index("<!-- /exit-codes -->")]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", table, re.M)
    assert {int(code): meaning for code, meaning in rows} == EXIT_CODES
