"""Helpers shared by the tests: subprocess launches of the CLI, free ports, JSONL records.

Tests import these (`from helpers import run_cli`), never each other's modules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from jaxdp.launcher.workers import free_port  # noqa: F401 - tests take it from here

ROOT = Path(__file__).resolve().parent.parent


def mlp_problem():
    """The small classification problem of the in-process training tests: jaxdp's MLP (12 inputs,
    one hidden layer of 32, 10 classes) and its cross-entropy loss, as (params, loss_fn)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdp.models.builtin import MLP

    model = MLP(hidden=(32,))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, batch["x"]), batch["y"]).mean()

    return params, loss_fn


def mlp_batches(n_steps: int, batch: int = 64, seed: int = 0):
    """`n_steps` host batches for `mlp_problem`, labelled by a fixed random linear teacher (learnable)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((12, 10)).astype(np.float32)
    for _ in range(n_steps):
        x = rng.standard_normal((batch, 12)).astype(np.float32)
        yield {"x": x, "y": np.argmax(x @ w, axis=1).astype(np.int32)}


def jax_cache_env() -> dict[str, str]:
    """The session's persistent compilation cache as JAX's own environment variables, with the
    thresholds jaxdp.cluster.runtime.enable_compile_cache sets: for a program that runs through no
    jaxdp entry point (a docs block, a notebook kernel), so that a rerun loads its compiled steps."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ["JAXDP_COMPILE_CACHE"], "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a CLI subprocess: no inherited device-count flag, so the CLI decides."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(extra)
    return env


def run_cli(*args: str, module: str = "jaxdp.train", timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...` in the repository root; output captured as text.

    It runs as a child of this worker's zygote (jaxdp/launcher/zygote.py: a process that has
    imported JAX, Flax, optax and orbax once and forks) when the environment lets it, which saves
    each run the 1.5 to 2 s of CPU its imports take; otherwise as a new process."""
    cwd, env = str(kwargs.pop("cwd", ROOT)), kwargs.pop("env") if "env" in kwargs else cli_env()
    forked = None if kwargs or env is None else _forked(module, args, cwd, env, timeout)  # (None: inherit, as Popen)
    if forked is not None:
        return forked
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, **kwargs)


# Variables a process reads as it starts or imports (the interpreter, glibc, JAX's config): a run
# whose values differ from the zygote's cannot be forked from it.
_AT_START = ("PYTHON", "LD_", "MALLOC_", "JAXDP_MALLOC_ENV", "JAX_", "TF_", "OMP_", "OPENBLAS_", "MKL_")
_ZYGOTE: list = []  # [Zygote, its environment] once started in this process; [None, None] if it could not be
_ZYGOTE_LOCK = threading.Lock()


def _at_start(env: dict[str, str]) -> dict[str, str]:
    """`env` as the entry point runs under it: after its malloc re-exec, where it would re-exec."""
    from jaxdp.cluster import malloc_env

    return malloc_env.tuned(env) if malloc_env.wanted(env) else dict(env)


def _zygote():
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or (_ZYGOTE[0] is not None and _ZYGOTE[0].gone()):
            from jaxdp.launcher.zygote import Zygote

            env = _at_start(cli_env())
            try:
                zygote = Zygote([sys.executable, "-m", "jaxdp.train"], env, None)
                deadline = time.monotonic() + 120
                while not zygote.usable() and not zygote.gone() and time.monotonic() < deadline:
                    time.sleep(0.05)
                _ZYGOTE[:] = [zygote, env] if zygote.usable() else [None, None]
            except OSError:
                _ZYGOTE[:] = [None, None]
        return _ZYGOTE


def spawn_cli(*args: str, module: str = "jaxdp.train", cwd: Path | str = ROOT, env: dict[str, str] | None = None,
              stdout: Path | str | None = None, stderr: Path | str | None = None):
    """`python -m MODULE ARGS...` started, not waited for: a child of this worker's zygote where the
    environment lets it (see run_cli), else a new process. Its output goes to the files named
    (None: discarded; the same file twice: both streams into it, as 2>&1). What it returns has
    poll, wait(timeout), kill, send_signal and pid, as Popen."""
    env = cli_env() if env is None else env
    files = (os.devnull, str(stdout or os.devnull), str(stderr or os.devnull))
    child = _fork(module, args, str(cwd), env, files)
    if child is not None:
        return child
    with open(files[1], "w") as out, open(files[2], "w") as err:
        return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if files[2] == files[1] != os.devnull else err)


def _fork(module: str, args, cwd: str, env: dict[str, str], files):
    """A child of the zygote running `python -m module args` with stdin, stdout, stderr from `files`;
    None where it cannot be forked (no zygote, or an environment the zygote was not started with)."""
    if os.environ.get("JAXDP_TEST_ZYGOTE") == "0":
        return None
    env = _at_start(env)
    zygote, zygote_env = _zygote()
    if zygote is None or any(env.get(k) != zygote_env.get(k) for k in {*env, *zygote_env} if k.startswith(_AT_START)):
        return None
    try:
        return zygote.fork([str(a) for a in args], env, None, module=module, cwd=cwd, stdio=files, replace_env=True)
    except OSError:
        return None


def _forked(module: str, args, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jaxdp-run-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        child = _fork(module, args, cwd, env, (os.devnull, out, err))
        if child is None:
            return None
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout,
                                            Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code,
                                           Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))


def two_processes_and_one(tmp_path: Path, flags: list[str]) -> None:
    """`jaxdp.train *flags` as 2 processes x 2 devices on 127.0.0.1 (metrics of process i in
    tmp_path/two.i.jsonl) and, meanwhile, as 1 process x 4 devices (tmp_path/one.jsonl); both must
    succeed."""
    port = free_port()
    procs = [spawn_cli(*flags, "--devices", "2", "--metrics-file", str(tmp_path / f"two.{i}.jsonl"),
                       "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                       stderr=tmp_path / f"two.{i}.err")
             for i in range(2)]
    try:
        one = run_cli(*flags, "--devices", "4", "--metrics-file", str(tmp_path / "one.jsonl"))
        assert one.returncode == 0, one.stderr
        codes = [p.wait(timeout=180) for p in procs]
    finally:  # a failure leaves no process behind to slow the rest of the suite
        for p in procs:
            p.kill()
    assert codes == [0, 0], (tmp_path / "two.0.err").read_text()[-2000:]


def _no_bare_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's json module would accept NaN; JSON.parse does not


def records(path: Path) -> list[dict]:
    """Every JSON Lines record of a metrics file; each line must be strict JSON (no bare NaN)."""
    return [json.loads(line, parse_constant=_no_bare_constants) for line in Path(path).read_text().splitlines()]


def step_records(path: Path) -> list[dict]:
    """The logged-step records of a metrics file (not start / eval / done events)."""
    return [r for r in records(path) if "event" not in r]


def saved(directory: Path) -> list[str]:
    """The entries of a checkpoint directory (step directories, unfinished saves), without the
    `config.toml` that the CLI writes beside them."""
    return sorted(name for name in os.listdir(directory) if name != "config.toml")


def write_corpus(path: Path, sentences: int = 1500, seed: int = 0) -> Path:
    """A text file a small model can learn: sentences of a few dozen words in a fixed grammar."""
    from jaxdp.bench.compression import write_corpus as write

    return write(Path(path), sentences, seed)


# ---- documentation blocks (tests/test_readme.py explains the markers) --------------------------

README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHELLS = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"<!--\s*(test-command|run:\s*(?P<node>\S+)|not-run:\s*(?P<reason>.*?))\s*-->")
LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |python|pip |docker |podman |buildah |srun |sbatch |salloc |bash |\.venv/|jaxdp-)", re.M)
# Pages other work writes into: each must exist with this title (its first line).
REQUIRED_PAGES = {"docs/multihost.md": "# Multi-host and SLURM", "docs/checkpoints.md": "# Checkpoints and resume",
                  "docs/performance.md": "# Performance", "docs/troubleshooting.md": "# Troubleshooting"}


def pages() -> list[Path]:
    """Every page whose code blocks follow the marker rule: README.md, then docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int            # 1-based line of the opening fence
    marker: str | None   # "test-command", "run", "not-run" or None
    target: str = ""     # the test node id of a run marker, the reason of a not-run marker
    page: str = "README.md"  # relative to the repository root

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str | None = None, page: str = "README.md") -> list[Block]:
    """Every fenced code block of README.md and docs/*.md (or of `text`) with the marker on the
    line before it (if any)."""
    if text is None:
        return [b for path in pages() for b in blocks(path.read_text(), str(path.relative_to(ROOT)))]
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)\s*$", lines[i])  # also indented, as inside an admonition
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```"))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = MARKER.fullmatch(previous.strip())
        marker = target = None
        if m:
            marker = m.group(1).split(":")[0]
            target = m.group("node") or m.group("reason") or ""
        code = textwrap.dedent("\n".join(lines[i + 1:end]) + "\n")
        out.append(Block(fence.group(1), code, i + 1, marker, target or "", page))
        i = end + 1
    return out


def readme_blocks(node: str) -> list[Block]:
    """The blocks a test runs: those marked `<!-- run: NODE -->` in README.md or docs/*.md, in
    page order. A block repeated word for word on another page (the README's tour shows some of
    the docs' examples) runs once, as its first occurrence. Tests elsewhere call this too."""
    found: dict[str, Block] = {}
    for b in blocks():
        if b.marker == "run" and b.target == node:
            found.setdefault(b.code, b)
    return list(found.values())


def commands(block: Block) -> list[str]:
    """Shell commands of a block: comments dropped, backslash continuations joined."""
    text = re.sub(r"\\\n\s*", " ", block.code)
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def sandbox(tmp_path: Path) -> dict[str, str]:
    """A scratch working directory that sees the repository (symlinks), and an environment whose
    `python`, `hadolint`, ... are this interpreter's, with no inherited device-count flag."""
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (tmp_path / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_shell(command: str, cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"README command failed: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def elastic_rank(pid: int) -> int | None:
    """The rank `jaxdp.launch --elastic` gave process `pid` (JAXDP_ELASTIC_RANK, the hub's and torchft's
    alike), or None: not a member, or gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    rank = env.get(b"JAXDP_ELASTIC_RANK")
    return None if rank is None else int(rank)


class LaunchedRun:
    """`python -m jaxdp.launch ARGS` started by a test: its stderr in `log` (`text()`); `reached()` is
    the last step in its metrics file; `wait_for` polls a condition while the launcher lives."""

    wait_timeout = 120.0

    def __init__(self, args: list[str], log: Path, metrics: Path, cwd: Path):
        self.log = log
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "jaxdp.launch", *args], cwd=cwd, env=cli_env(),
                                         stderr=err, stdout=subprocess.DEVNULL)
        self.reached = StepWatch(metrics)  # run.reached(): the last step in its metrics file

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, condition, what: str, timeout: float | None = None) -> None:
        timeout = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.text()}"
            time.sleep(0.05)

    def close(self) -> None:
        """Kill the launcher if it runs; its workers then get SIGTERM (PR_SET_PDEATHSIG), and one a
        test stopped (SIGSTOP) is continued so that it takes it instead of outliving the test."""
        if self.proc.poll() is None:
            from jaxdp.bench.goodput import training_processes

            workers = training_processes(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass


class StepWatch:
    """`watch = StepWatch(path)`; `watch()`: the highest "step" in the metrics file so far. Each call
    parses only the lines written since the last one (a test polls it many times a second)."""

    def __init__(self, path: Path):
        self.path, self.file, self.offset, self.step = Path(path), None, 0, 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                file = os.fstat(f.fileno()).st_ino
                if file != self.file:  # first seen, or replaced (a resume rewrites it): read it whole
                    self.file, self.offset, self.step = file, 0, 0
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return self.step
        end = new.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        for line in new[:end].decode().splitlines():
            if line.strip().startswith("{"):
                self.step = max(self.step, json.loads(line).get("step", 0))
        return self.step


def stop_at_4_then_resume_to_8(tmp_path: Path, flags: list[str]) -> None:
    """`jaxdp.train FLAGS` for 8 steps, and again stopped at 4 and resumed to 8 from its checkpoint:
    the resumed run's logged steps (loss, bytes sent) must equal the uninterrupted run's exactly."""
    from jaxdp.config import parse_args
    from jaxdp.train import train

    def run(*more):
        return train(parse_args(["--log-every", "1", "--no-progress", *flags, *map(str, more)]))

    def losses(path):
        return [(r["step"], r["loss"], r["comm_bytes"]) for r in records(path) if "event" not in r]

    run("--steps", 8, "--metrics-file", tmp_path / "whole.jsonl")
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", 4, "--metrics-file", tmp_path / "cut.jsonl"]
    run(*ckpt, "--steps", 4)
    resumed = run(*ckpt, "--steps", 8)
    assert resumed.history[0]["step"] == 5
    assert losses(tmp_path / "cut.jsonl") == losses(tmp_path / "whole.jsonl")
    assert len(losses(tmp_path / "whole.jsonl")) == 8
