"""The wheel installs and trains from outside the repository.

`pip wheel` builds it from a copy of the repository (the working tree stays clean); a fresh venv
(no pip of its own) gets it through this interpreter's pip (`pip --python`), and its dependencies
through a .pth line naming this venv's site-packages, added only after the install, so pip never
sees the editable jaxdp there (that one is found through a finder that a plain .pth line does not
load). The console scripts then run from a scratch directory, and `jaxdp.__file__` must be the
wheel's copy."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT, records

pytestmark = pytest.mark.slow  # about 15 s: a build, a venv, an install and a 5-step run

SCRIPTS = {"jaxdp-train": "jaxdp.train", "jaxdp-launch": "jaxdp.launch", "jaxdp-prepare": "jaxdp.prepare",
           "jaxdp-sample": "jaxdp.sample", "jaxdp-export": "jaxdp.export"}


def run(args: list, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_the_wheel_installs_with_its_scripts_and_trains_from_elsewhere(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "site", "runs",
                                                                "__pycache__", "*.egg-info", ".pytest_cache"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", tmp_path / "dist", source], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("jaxdp_trainer-*.whl")  # the distribution jaxdp-trainer, as README.md names it
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = configparser.ConfigParser()
        (info,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points.read_string(archive.read(info).decode())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "\nName: jaxdp-trainer\n" in archive.read(metadata).decode()  # "jaxdp" on the index is another project
    # Every file the package needs at run time: each file under jaxdp/ (not only its .py modules).
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "jaxdp").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert not shipped - names, f"not in the wheel: {sorted(shipped - names)} (add them to package-data)"
    assert dict(entry_points["console_scripts"]) == {name: f"{module}:{'cli' if name in ('jaxdp-train', 'jaxdp-prepare') else 'main'}"
                                                     for name, module in SCRIPTS.items()}

    venv = tmp_path / "venv"
    base = Path(getattr(sys, "_base_executable", sys.executable))
    run([base, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], tmp_path)
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip()
    Path(site_packages, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin"  # the wheel's scripts, and none of this venv's
    imported = run([python, "-c", "import jaxdp; print(jaxdp.__file__)"], elsewhere, env).stdout.strip()
    assert imported == str(Path(site_packages, "jaxdp", "__init__.py")), imported
    for name, module in SCRIPTS.items():
        assert (venv / "bin" / name).exists(), name
        if (ROOT / Path(*module.split("."))).with_suffix(".py").exists():
            assert "usage" in run([name, "--help"], elsewhere, env).stdout
    run(["jaxdp-train", "--steps", "5", "--devices", "2", "--no-progress", "--metrics-file", "run.jsonl"], elsewhere, env)
    done = records(elsewhere / "run.jsonl")[-1]
    assert done["event"] == "done" and done["step"] == 5 and done["eval_loss"] > 0
