"""Every install command the project shows installs this project, by its name on the package index:
`jaxdp-trainer` (pyproject.toml's [project] name). `jaxdp` there is another project, which
`pip install 'jaxdp[elastic]'` installs with no more than a warning that it has no such extra.

The commands are found by a pattern: `pip install ARGS`, in code blocks, inline code and strings,
up to `&&`, `;`, `|`, a backtick or a comment. Of its arguments, those that name this project are
checked: `.` and `.[X]` (a checkout, `-e` or not), `jaxdp-trainer[X]` (the index) and a wheel,
`dist/jaxdp_trainer-*.whl`; arguments naming other packages (torch, transformers, ...) are left
alone. Every extra named must be one of pyproject.toml's optional-dependencies, and the old name,
`jaxdp[X]`, fails anywhere.

The slow test resolves each command as pip does, with no network: it builds the wheel once and, in
one fresh venv, runs `pip install --dry-run --no-deps --report -` for each (a checkout's `.` stands
for the wheel built from it; the index name is looked up in a folder holding only that wheel,
`--no-index --find-links`), so `jaxdp-trainer` must resolve to this project's wheel, and each extra
be one its metadata provides (with --no-deps pip does not warn about an extra it lacks).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import ROOT, pages

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OLD_NAME = "jaxdp"  # the import package's name; on the package index, another project's


def canonical(name: str) -> str:
    """A distribution or extra name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


WHEEL = f"{canonical(PROJECT['name']).replace('-', '_')}-{PROJECT['version']}-py3-none-any.whl"
EXTRAS = {canonical(extra) for extra in PROJECT["optional-dependencies"]}

# `pip install ARGS`: ARGS up to a backtick, a table's |, &&, ;, a comment or the line's end (a
# backslash-newline goes on), also as `python -m pip install` and `.venv/bin/pip install`.
INSTALL = re.compile(r"\bpip3?\s+install\b(?P<args>(?:[^`|&;#\n\\]|\\\n|\\(?!\n))*)")
REQUIREMENT = re.compile(r"(?P<base>[^\[\]]+?)(?:\[(?P<extras>[^\]]*)\])?(?P<spec>(?:[<>=!~]=?|@).*)?")
OLD_EXTRA = re.compile(rf"(?<![\w./-]){OLD_NAME}\[[\w,\s-]*\]")  # jaxdp[elastic], not jaxdp-trainer[...] or jax[...]
# pip install's options that take a value (the value is not a requirement)
VALUED = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
          "-t", "--target", "--prefix", "--root", "--python", "--platform", "--python-version", "--implementation",
          "--abi", "--no-binary", "--only-binary", "--upgrade-strategy", "--progress-bar", "--report", "-C",
          "--config-settings", "--src", "--log", "--cache-dir", "--global-option", "--proxy", "--cert",
          "--client-cert", "--trusted-host", "--timeout", "--retries", "--exists-action"}


@dataclasses.dataclass(frozen=True)
class Install:
    where: str               # "docs/training.md:52"
    command: str             # "pip install 'jaxdp-trainer[wandb]'"
    kind: str                # "checkout" (. or .[X]), "index" (jaxdp-trainer[X]), "wheel", "old name" (jaxdp[X])
    target: str              # the argument as written
    extras: tuple[str, ...]  # canonical names, sorted

    def __str__(self) -> str:
        return f"{self.where}: `{self.command}`"


def classify(argument: str) -> tuple[str, tuple[str, ...]] | None:
    """(kind, extras) of one requirement argument of `pip install`; None for another package's."""
    m = REQUIREMENT.fullmatch(argument.strip())
    if m is None:
        return None
    base = m["base"].strip()
    names = [e.strip() for e in (m["extras"] or "").split(",")]  # a placeholder ({extra}, X) is left out
    extras = tuple(sorted({canonical(e) for e in names if re.fullmatch(r"[a-z0-9][a-z0-9._-]*", e)}))
    if base.rstrip("/") in (".", "file:."):
        return "checkout", extras
    if base.endswith(".whl"):
        name = base.rsplit("/", 1)[-1]
        return ("wheel", extras) if name.lower().startswith(OLD_NAME) else None
    if canonical(base) == OLD_NAME:
        return "old name", extras
    if canonical(base) == canonical(PROJECT["name"]):
        return "index", extras
    return None


def installs(text: str, page: str) -> list[Install]:
    """Every argument of a `pip install` in `text` that installs this project (or tries to, by the
    old name)."""
    found = []
    for m in INSTALL.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        args = m["args"].replace("\\\n", " ")
        command = " ".join(f"pip install{args}".split())
        try:
            words = shlex.split(args)
        except ValueError:  # an unclosed quote: prose, or a string cut in two in Python source
            words = [word.strip("'\"()") for word in args.split()]
        skip = False
        for word in words:
            if skip:
                skip = False
            elif word.startswith("-"):
                skip = word in VALUED  # its value follows; -e/--editable's requirement is checked as any other
            elif (kind := classify(word)) is not None:
                found.append(Install(f"{page}:{line}", command, kind[0], word, kind[1]))
    return found


def sources() -> list[Path]:
    """README.md and docs/*.md, the examples, the Dockerfiles, and jaxdp/'s messages and help texts."""
    examples = [p for p in sorted((ROOT / "examples").rglob("*")) if p.is_file() and p.suffix != ".ipynb"]
    return [*pages(), *examples, *sorted((ROOT / "docker").glob("Dockerfile*")), *sorted((ROOT / "jaxdp").rglob("*.py"))]


def problems_of(text: str, page: str) -> list[str]:
    """What is wrong with the install commands of `text`, one line each, naming the place."""
    problems = []
    for install in installs(text, page):
        if install.kind == "old name":
            problems.append(f"{install} installs {install.target!r}: {OLD_NAME!r} on the package index is another "
                            f"project; this one is {PROJECT['name']!r} (from a checkout: pip install -e '.[X]')")
        unknown = [extra for extra in install.extras if extra not in EXTRAS]
        if unknown:
            problems.append(f"{install}: pyproject.toml has no extra {', '.join(unknown)} (it has {', '.join(sorted(EXTRAS))})")
        if install.kind == "wheel" and not fnmatch.fnmatch(WHEEL, REQUIREMENT.fullmatch(install.target)["base"].rsplit("/", 1)[-1]):
            problems.append(f"{install}: {install.target!r} does not name this project's wheel, {WHEEL}")
    for m in OLD_EXTRA.finditer(text):
        where = f"{page}:{text.count(chr(10), 0, m.start()) + 1}"
        if not any(p.startswith(f"{where}:") for p in problems):
            problems.append(f"{where}: {m.group()!r} is an extra of the old name; this project's is "
                            f"{PROJECT['name']}{m.group()[len(OLD_NAME):]}")
    return problems


def test_the_check_finds_each_kind_of_install_and_what_is_wrong():
    text = ("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m jaxdp.train\n"
            "`pip install -e '.[docs]' && mkdocs build` and `pip install torch --index-url https://x/whl/cpu`\n"
            "| `--tokenizer PATH` | needs pip install 'jaxdp-trainer[tokenizers]' |\n"
            "pip install --no-cache-dir \\\n    'dist/jaxdp_trainer-*.whl[data, wandb]'   # the wheel\n"
            "then `pip install transformers` to check, or `python -m pip install jaxdp-trainer==0.1.0`\n")
    assert [(i.where, i.kind, i.target, i.extras) for i in installs(text, "P")] == [
        ("P:1", "checkout", ".", ()), ("P:2", "checkout", ".[docs]", ("docs",)),
        ("P:3", "index", "jaxdp-trainer[tokenizers]", ("tokenizers",)),
        ("P:4", "wheel", "dist/jaxdp_trainer-*.whl[data, wandb]", ("data", "wandb")),
        ("P:6", "index", "jaxdp-trainer==0.1.0", ())]
    assert not problems_of(text, "P")
    wrong = ("pip install 'jaxdp[elastic]'\n`pip install -e '.[nope]'`\n`pip install dist/jaxdp-*.whl`\n"
             "the extra `jaxdp[wandb]`\n")
    found = problems_of(wrong, "P")
    assert [p.split(":")[1] for p in found] == ["1", "2", "3", "4"], found
    assert "another project" in found[0] and "no extra nope" in found[1] and WHEEL in found[2]
    assert "jaxdp-trainer[wandb]" in found[3]


def test_every_install_command_names_this_project_and_its_extras():
    assert canonical(PROJECT["name"]) != OLD_NAME, f"pyproject.toml's name {OLD_NAME!r} is another project's on the index"
    problems = [p for path in sources() for p in problems_of(path.read_text(), str(path.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


# ---- resolved by pip -----------------------------------------------------------------------------


def pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1")
    return subprocess.run([str(python), "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def resolve(python: Path, install: Install, wheel: Path, tmp_path: Path) -> str | None:
    """Why pip does not resolve `install` to `wheel` with its extras; None when it does."""
    extras = f"[{','.join(install.extras)}]" if install.extras else ""
    if install.kind == "checkout":
        requirement, where = f"{wheel}{extras}", []  # the wheel built from the checkout
    elif install.kind == "wheel":
        pattern = REQUIREMENT.fullmatch(install.target)["base"].rsplit("/", 1)[-1]
        if not fnmatch.fnmatch(wheel.name, pattern):
            return f"{install.target!r} matches no wheel `pip wheel` makes of this project ({wheel.name})"
        requirement, where = f"{wheel}{extras}", []
    else:  # by name, from a folder that holds only this project's wheel
        m = REQUIREMENT.fullmatch(install.target)
        requirement, where = f"{m['base'].strip()}{extras}{m['spec'] or ''}", ["--find-links", str(wheel.parent)]
    proc = pip(python, "install", "--dry-run", "--no-deps", "--no-index", "-q", "--report", "-", *where, requirement,
               cwd=tmp_path)
    if proc.returncode != 0:
        return f"pip install {requirement!r} fails: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    if "does not provide the extra" in proc.stderr:
        return proc.stderr.strip()
    (item,) = json.loads(proc.stdout)["install"]
    metadata = item["metadata"]
    if canonical(metadata["name"]) != canonical(PROJECT["name"]) or item["download_info"]["url"] != wheel.as_uri():
        return f"resolves to {metadata['name']} {metadata['version']} at {item['download_info']['url']}, not {wheel}"
    missing = set(install.extras) - {canonical(e) for e in metadata.get("provides_extra", [])}
    if missing:
        return f"{metadata['name']} has no extra {', '.join(sorted(missing))}"
    return None


@pytest.mark.slow  # about 15 s on 2 cores: a wheel, a venv and one `pip install --dry-run` per distinct install
def test_every_documented_install_resolves_to_this_projects_wheel(tmp_path):
    source = tmp_path / "source"  # what the wheel is built from (setuptools writes build/ and *.egg-info there)
    shutil.copytree(ROOT / "jaxdp", source / "jaxdp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == WHEEL

    venv = tmp_path / "venv"  # a fresh one, with its own pip: nothing installed that pip could take instead
    base = Path(getattr(sys, "_base_executable", sys.executable))
    proc = subprocess.run([str(base), "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    python = venv / "bin" / "python"

    by_request: dict[tuple, list[Install]] = {}
    for path in sources():
        for install in installs(path.read_text(), str(path.relative_to(ROOT))):
            by_request.setdefault((install.kind, install.target if install.kind != "checkout" else ".", install.extras),
                                  []).append(install)
    assert any(kind == "index" for kind, _, _ in by_request), "no command installs the project by its name"
    problems = []
    for found in by_request.values():
        why = resolve(python, found[0], wheel, tmp_path)
        if why:
            problems += [f"{install}: {why}" for install in found]
    assert not problems, "\n".join(problems)
    # and the old name does not resolve here: the check above could not pass on it
    old = Install("-", f"pip install '{OLD_NAME}[elastic]'", "old name", f"{OLD_NAME}[elastic]", ("elastic",))
    assert "fails" in (resolve(python, old, wheel, tmp_path) or "")
