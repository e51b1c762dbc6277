"""README.md cannot rot: every command in it is run by a test, or says why it cannot run here.

Every fenced ```bash (sh, shell, console) and ```python block must be preceded by one marker line:

    <!-- test-command -->                 .ci/run extracts and runs the block (the README's test command)
    <!-- run: tests/FILE.py::TEST -->     TEST runs the block. Blocks marked for a test outside this file
                                          must be read by that test through `readme_blocks(...)` here,
                                          so the command run is the command shown.
    <!-- not-run: needs REASON -->        it cannot run on a CPU-only CI machine (GPUs, a Docker
                                          engine, a cluster); the reason says what it needs

A block without a marker, a marker naming a test that does not exist (or does not read the
README), or a not-run marker without a reason fails `test_every_block_is_run_or_says_why_not`.

The CLI reference between `<!-- cli-reference -->` and `<!-- /cli-reference -->` is generated
from `jaxdp.config`; regenerate it with `python tests/test_readme.py`.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys

import pytest

from helpers import (LOOKS_LIKE_A_COMMAND, MARKER, README, REQUIRED_HEADINGS, ROOT, SHELLS, blocks, commands,  # noqa: F401
                     readme_blocks, run_shell, sandbox)


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
        return [f"{node} does not read its commands with readme_blocks(...), so it may not run what README.md shows"]
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


def test_ci_runs_the_test_command():
    marked = [b for b in blocks() if b.marker == "test-command"]
    assert len(marked) == 1 and "pytest" in marked[0].code
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def test_sections_owned_by_others_have_their_headings():
    text = README.read_text()
    for heading in REQUIRED_HEADINGS:
        assert re.search(rf"^{re.escape(heading)}\s*$", text, re.M), heading


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
    assert re.search(r"eval_accuracy=0\.9\d+ .*strategy=ring devices=8", proc.stdout), proc.stdout


# What a command must print besides exiting 0, by how it starts (checked for every match).
EXPECT = {
    "python -m jaxdp.train --help": r"checkpointing:[\s\S]*\(default: psum\)|\(default: psum\)[\s\S]*checkpointing:",
    "python -m jaxdp.train --strategy": r"eval_accuracy=\d",
    "python -m jaxdp.train --model cnn": r"eval_accuracy=\d",
    "python examples/custom_model.py": r"test accuracy 0\.[89]\d* after",
}


@pytest.mark.slow
@pytest.mark.parametrize("block", readme_blocks("tests/test_readme.py::test_shell_blocks"), ids=lambda b: b.id)
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
    assert not unused, f"EXPECT entries that match no README command (update them): {unused}"


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
    env = sandbox(tmp_path)
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "checks passed" in proc.stdout, proc.stdout + proc.stderr


def test_both_flax_apis_are_shown():
    kinds = sorted("nnx" if "from flax import nnx" in b.code else "linen"
                   for b in readme_blocks("tests/test_readme.py::test_python_blocks"))
    assert kinds == ["linen", "nnx", "nnx"]


# ---- the CLI reference ------------------------------------------------------------------------

CLI_START, CLI_END = "<!-- cli-reference -->", "<!-- /cli-reference -->"


def cli_reference() -> str:
    """The README's flag tables, one per flag group, generated from jaxdp.config.Config."""
    from jaxdp import config

    parser = config.build_parser()
    lines = ["| flag | meaning |", "| --- | --- |"]
    for action in parser._action_groups[1]._group_actions:  # argparse's "options": --help, --config
        if action.dest not in ("help",):
            lines.append(f"| `{action.option_strings[0]} {action.metavar}` | {action.help} |")
    lines.append("")
    for group in config.GROUPS:
        lines += [f"**{group}**", "", "| flag | default | meaning |", "| --- | --- | --- |"]
        for f in dataclasses.fields(config.Config):
            if f.metadata["group"] != group:
                continue
            flag = f"--{f.name.replace('_', '-')}"
            if f.type == "bool":
                usage = f"`{flag}`, `--no-{flag[2:]}`"
            elif config.choices(f):
                usage = f"`{flag} {{{','.join(config.choices(f))}}}`"
            else:
                usage = f"`{flag} {config.metavar(f)}`"
            default = "" if f.default is None else f"`{f.default}`"
            lines.append(f"| {usage} | {default} | {f.metadata['help'].replace('|', '&#124;')} |")
        lines.append("")
    return "\n".join(lines)


def readme_cli_section(text: str) -> str:
    start, end = text.index(CLI_START), text.index(CLI_END)
    return text[text.index("\n", start) + 1:end]


def test_cli_reference_is_current():
    assert readme_cli_section(README.read_text()) == cli_reference() + "\n", \
        "README.md's CLI reference is stale: run `python tests/test_readme.py` and commit README.md"


def test_cli_reference_matches_help_output():
    from jaxdp.config import build_parser

    help_text = build_parser().format_help()
    help_flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", help_text)) - {"--help"}
    table_flags = set(re.findall(r"`(--[a-z][a-z-]+)", readme_cli_section(README.read_text())))
    negations = {"--no-" + flag[2:] for flag in help_flags}  # a boolean flag's --no- form, listed beside it
    assert help_flags <= table_flags and table_flags - help_flags <= negations
    sections = re.findall(r"^(\w+):$", help_text, re.M)
    assert [s for s in sections if s not in ("options",)] == [
        g for g in re.findall(r"^\*\*(\w+)\*\*$", readme_cli_section(README.read_text()), re.M)]
    assert "(default: psum)" in help_text and "(default: 128)" in help_text


if __name__ == "__main__":  # regenerate the CLI reference in README.md
    text = README.read_text()
    start, end = text.index(CLI_START), text.index(CLI_END)
    README.write_text(text[:text.index("\n", start) + 1] + cli_reference() + "\n" + text[end:])
    print("README.md: CLI reference regenerated")


def test_exit_code_table_is_jaxdp_errors():
    from jaxdp.errors import EXIT_CODES

    text = README.read_text()
    table = text[text.index("<!-- exit-codes -->"):text.index("<!-- /exit-codes -->")]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", table, re.M)
    assert {int(code): meaning for code, meaning in rows} == EXIT_CODES
