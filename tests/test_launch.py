"""`python -m jaxdp.launch`: environment, core binding, exit codes, restarts; a real run that loses a
process to kill -9 restarts from its checkpoint and ends with the losses of an uninterrupted run.
Also: --help, bad input is never restarted, a SIGTERM during a restart stops it, the children die
with a launcher killed by kill -9, and the run listens on 127.0.0.1 only."""

import ipaddress
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, cli_env, records, run_cli
from jaxdp.launcher.workers import bindings

PY = sys.executable


def launch(*args, timeout=240, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jaxdp.launch", *map(str, args)], cwd=kwargs.pop("cwd", ROOT), env=cli_env(),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def test_bindings_are_disjoint_and_cover_the_cores():
    assert bindings(2, [0, 1]) == [{0}, {1}]
    assert bindings(2, [0, 1, 2, 3, 4]) == [{0, 1, 2}, {3, 4}]
    assert bindings(3, [4, 5]) == [{4}, {5}, {4}]  # more processes than cores: one core each, shared


def test_children_get_the_jax_environment_and_their_own_cores(tmp_path):
    script = ("import json, os; json.dump({'env': [os.environ[k] for k in ('JAX_COORDINATOR_ADDRESS', "
              "'JAXDP_RUN_ID', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')], 'cores': sorted(os.sched_getaffinity(0))}, "
              f"open(os.path.join({str(tmp_path)!r}, os.environ['JAX_PROCESS_ID']), 'w'))")
    proc = launch("--nproc-per-node", 2, "--", PY, "-c", script)
    assert proc.returncode == 0, proc.stderr
    seen = [json.loads((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert [s["env"][2:] for s in seen] == [["2", "0"], ["2", "1"]] and seen[0]["env"][:2] == seen[1]["env"][:2]
    assert seen[0]["env"][1].startswith("launch-")  # one run id per start, the same for every process
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(seen[0]["cores"]) & set(seen[1]["cores"])
        assert "bound to cores" in proc.stderr.splitlines()[0]
    unbound = launch("--nproc-per-node", 2, "--no-bind", "--", PY, "-c", script)
    assert "not bound to cores (--no-bind)" in unbound.stderr
    assert all(json.loads((tmp_path / str(r)).read_text())["cores"] == sorted(os.sched_getaffinity(0)) for r in range(2))


def test_exit_codes_and_restarts(tmp_path):
    # Any other failure: the children's code, no restart.
    proc = launch("--nproc-per-node", 2, "--max-restarts", 3, "--", PY, "-c", "import sys; sys.exit(3)")
    assert proc.returncode == 3 and "restarting" not in proc.stderr, proc.stderr
    # A lost peer (exit 69) on the first attempt only: one restart, then success.
    marker = tmp_path / "failed-once"
    script = (f"import os, sys; m = {str(marker)!r}\n"
              "if os.environ['JAX_PROCESS_ID'] == '1' and not os.path.exists(m): open(m, 'w').close(); sys.exit(69)")
    proc = launch("--nproc-per-node", 2, "--max-restarts", 1, "--", PY, "-c", script)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert any("process 1 exited with code 69" in line for line in lines)
    assert any("restarting all 2 processes (1 of 1)" in line for line in lines)
    # Restarts used up: the lost code.
    proc = launch("--nproc-per-node", 2, "--max-restarts", 1, "--", PY, "-c", "import sys; sys.exit(69)")
    assert proc.returncode == 69 and "no restarts left" in proc.stderr.strip().splitlines()[-1]
    # Bad usage: exit 2, one line.
    proc = launch("--nproc-per-node", 2, PY, "-c", "pass")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_help_prints_the_help_and_exits_0():
    for flag in ("--help", "-h"):
        proc = launch(flag)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m jaxdp.launch"), proc.stderr


def test_a_command_that_cannot_start_is_one_line_and_exit_2():
    proc = launch("--nproc-per-node", 2, "--", "/nonexistent/cmd")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == "jaxdp.launch: error: cannot start '/nonexistent/cmd': No such file or directory"


@pytest.mark.parametrize("first", ["bad input", "lost peer"])
def test_a_child_with_bad_input_is_not_restarted(tmp_path, first):
    """Process 1 exits 2 (bad input) and process 0 exits 69 as a peer that lost it would, in either
    order (a peer can finish exiting before the process whose bad input set it off): the launcher
    must end with 2, restarting nothing, and say so in its last line."""
    marker = tmp_path / "marker"
    # (the process that exits first, its code; the other's code once it sees the marker, after a pause)
    leads, code, then, pause = ("1", 2, 69, 0) if first == "bad input" else ("0", 69, 2, 0.5)
    script = (f"import os, sys, time; m = {str(marker)!r}\n"
              f"if os.environ['JAX_PROCESS_ID'] == '{leads}': open(m, 'w').close(); sys.exit({code})\n"
              "deadline = time.monotonic() + 60\n"
              "while not os.path.exists(m) and time.monotonic() < deadline: time.sleep(0.02)\n"
              f"time.sleep({pause}); sys.exit({then})")
    proc = launch("--nproc-per-node", 2, "--max-restarts", 2, "--", PY, "-c", script)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and not any("restarting" in line for line in lines), proc.stderr
    assert "process 1 exited with code 2 (bad input" in lines[-1] and "no restart" in lines[-1], lines


class StderrLines:
    """A running launcher's stderr, line by line, with a deadline (a hung launcher fails the test)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.selector = selectors.DefaultSelector()
        self.selector.register(proc.stderr, selectors.EVENT_READ)

    def until(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.selector.select(timeout=max(0.0, deadline - time.monotonic())):
                line = self.proc.stderr.readline()
                assert line, f"the launcher ended before saying {needle!r}: {self.lines}"
                self.lines.append(line)
                if needle in line:
                    return line
        raise AssertionError(f"the launcher did not say {needle!r} within {timeout} s: {self.lines}")


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_sigterm_while_restarting_stops_the_launcher(tmp_path):
    """The first attempt loses process 1 (exit 69); process 0 ignores SIGTERM, so the launcher waits
    for it. A SIGTERM to the launcher then, mid-restart, must end it (75) without a second attempt."""
    script = (f"import os, signal, sys, time; d = {str(tmp_path)!r}; rank = os.environ['JAX_PROCESS_ID']\n"
              "starts = os.path.join(d, 'starts.' + rank)\n"
              "first = not os.path.exists(starts)\n"
              "open(starts, 'a').write('x')\n"
              "if not first: open(os.path.join(d, 'restarted.' + rank), 'w').close(); sys.exit(0)\n"
              "if rank == '1': sys.exit(69)\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)")
    launcher = subprocess.Popen([PY, "-m", "jaxdp.launch", "--nproc-per-node", "2", "--max-restarts", "3", "--",
                                 PY, "-c", script], cwd=ROOT, env=cli_env(), stderr=subprocess.PIPE, text=True)
    try:
        StderrLines(launcher).until("process 1 exited with code 69; stopping the others")
        launcher.send_signal(signal.SIGTERM)
        _, rest = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 75, rest
    assert "received SIGTERM: no restart; exit code 75" in rest.strip().splitlines()[-1], rest
    assert not list(tmp_path.glob("restarted.*")), "a new attempt started after the SIGTERM"


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its new parent, is not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_children_die_with_a_launcher_killed_by_kill_9(tmp_path):
    """kill -9 of the launcher: each child gets SIGTERM (jaxdp.train: save and exit 75) and ends,
    instead of training on as an orphan that holds the checkpoint directory."""
    script = (f"import os, signal, sys, time; d = {str(tmp_path)!r}; rank = os.environ['JAX_PROCESS_ID']\n"
              "def stop(signum, frame): open(os.path.join(d, 'term.' + rank), 'w').close(); sys.exit(75)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "open(os.path.join(d, 'pid.' + rank), 'w').write(str(os.getpid()))\n"
              "time.sleep(120)")
    launcher = subprocess.Popen([PY, "-m", "jaxdp.launch", "--nproc-per-node", "2", "--", PY, "-c", script],
                                cwd=ROOT, env=cli_env(), stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "the children did not start"
            pids = [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text()]
            time.sleep(0.02)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids), "a child outlived the launcher's kill -9"
        assert sorted(p.name for p in tmp_path.glob("term.*")) == ["term.0", "term.1"]  # by SIGTERM: a clean stop
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
def test_a_run_under_the_launcher_listens_on_127_0_0_1_only(tmp_path):
    """The coordinator (JAX listens on every interface by default), the run handshake, the peer watch
    and gloo: all on the announced 127.0.0.1, so a connection from this machine's own network
    address to the coordinator's port is refused."""
    out = tmp_path / "out"
    proc = launch("--nproc-per-node", 2, "--", PY, str(ROOT / "tests" / "scripts" / "listening.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    sockets = [s for one in seen for s in one["listening"]]
    assert sockets and all(ipaddress.ip_address(address).is_loopback for _, address, _ in sockets), sockets
    assert seen[0]["external"] in ("refused", None), seen[0]  # None: this machine has no other address


@pytest.mark.multiprocess
def test_a_user_script_with_jaxdp_initialize_runs_under_the_launcher(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(
        "import json, sys, numpy as np, jax, jaxdp\n"
        "jaxdp.initialize()\n"
        "from jax.experimental import multihost_utils\n"
        "total = multihost_utils.process_allgather(np.float32(jax.process_index() + 1)).sum()\n"
        "json.dump([jax.process_index(), jax.process_count(), float(total)], open(sys.argv[1] + str(jax.process_index()), 'w'))\n")
    proc = launch("--nproc-per-node", 2, "--", PY, str(script), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads((tmp_path / f"out{r}").read_text()) for r in range(2)] == [[0, 2, 3.0], [1, 2, 3.0]]


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def rank_of(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"JAX_PROCESS_ID=")), None)


def step_losses(path: Path) -> dict[int, float]:
    steps = [r for r in records(path) if "event" not in r]
    assert len({r["step"] for r in steps}) == len(steps), "a step was logged twice"
    return {r["step"]: r["loss"] for r in steps}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_9_of_one_child_restarts_from_the_checkpoint_and_loses_no_step(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = ["--steps", "120", "--batch-size", "64", "--log-every", "1", "--no-progress"]
    launcher = subprocess.Popen([PY, "-m", "jaxdp.launch", "--nproc-per-node", "2", "--max-restarts", "1", "--",
                                 PY, "-m", "jaxdp.train", *run, "--devices", "2", "--checkpoint-dir", str(ckpt),
                                 "--save-every", "5", "--metrics-file", str(metrics)],
                                cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):  # past a checkpoint
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        victim = next(pid for pid in children(launcher.pid) if rank_of(pid) == "1")
        os.kill(victim, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    events = [line for line in stderr.splitlines() if line.startswith("jaxdp.launch:")]
    assert any("process 1 was killed by SIGKILL" in line for line in events), events
    assert any("restarting all 2 processes (1 of 1)" in line for line in events), events

    reference = tmp_path / "reference.jsonl"
    assert run_cli(*run, "--devices", "4", "--metrics-file", str(reference)).returncode == 0
    got, expected = step_losses(metrics), step_losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, 121))  # every step once
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)
    assert records(metrics)[-1]["event"] == "done"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_launcher(tmp_path):
    """The README's two-process command through the launcher, as shown, from a scratch directory."""
    from helpers import readme_blocks, run_shell, sandbox

    (block,) = readme_blocks("tests/test_launch.py::test_readme_launcher")
    assert block.code.startswith("python -m jaxdp.launch --nproc-per-node 2 -- ")
    run_shell(block.code, cwd=tmp_path, env=sandbox(tmp_path), timeout=180)
    done = records(tmp_path / "run.jsonl")[-1]
    assert done["event"] == "done" and done["processes"] == 2 and done["devices"] == 8


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_launcher_restarts(tmp_path):
    """The Launcher section's commands: a checkpointed run, and a script of one's own (written here)."""
    from helpers import commands, readme_blocks, run_shell, sandbox

    (block,) = readme_blocks("tests/test_launch.py::test_readme_launcher_restarts")
    env = sandbox(tmp_path)
    (tmp_path / "my_script.py").write_text(
        "import jax, jaxdp\njaxdp.initialize()\nprint(f'process {jax.process_index()} of {jax.process_count()}')\n")
    train, script = commands(block)
    run_shell(train, cwd=tmp_path, env=env, timeout=180)
    assert "40" in os.listdir(tmp_path / "ckpt")
    proc = run_shell(script, cwd=tmp_path, env=env, timeout=180)
    assert "started 2 processes" in proc.stderr


PROBE = '''
import json, os, sys, threading, time

def late():  # a non-daemon thread: the interpreter waits for it before exiting, so must a forked child
    time.sleep(0.3)
    open("late.txt", "w").write("written")

threading.Thread(target=late).start()
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "other": os.environ.get("ZYGOTE_ONLY"), "path0": sys.path[0]}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def test_a_zygote_imports_what_it_is_asked_to_preload_and_its_children_have_it(tmp_path):
    """An elastic run on torchft asks its zygote for torch and torchft too (jaxdp.launcher.ft.PRELOAD),
    so a restart does not import them again: a child finds a preloaded module already imported, and
    one not asked for not."""
    from jaxdp.launcher.zygote import ENV_PRELOAD, Zygote

    (tmp_path / "probe.py").write_text("import json, os, sys\nprint(json.dumps({m: m in sys.modules for m in "
                                       "('colorsys', 'wave')} | {'env': os.environ.get('" + ENV_PRELOAD + "')}))\n")
    zygote = Zygote([sys.executable, "-m", "jaxdp.train"], cli_env(), None, preload=("colorsys",))
    try:
        deadline = time.monotonic() + 120
        while not zygote.usable():
            assert not zygote.gone() and time.monotonic() < deadline, "the zygote did not start"
            time.sleep(0.05)
        out = tmp_path / "out"
        child = zygote.fork([], {"PATH": os.environ.get("PATH", "")}, None, module="probe", cwd=str(tmp_path),
                            stdio=(os.devnull, str(out), os.devnull))
        assert child.wait(60) == 0
        assert json.loads(out.read_text()) == {"colorsys": True, "wave": False, "env": None}
    finally:
        zygote.close()


def test_a_zygote_child_runs_its_module_in_its_directory_with_its_files_environment_and_exit(tmp_path):
    """What tests/helpers.run_cli relies on to fork CLI runs: the child runs `module` as `python -m`
    would in `cwd` (first on sys.path), writes to the files named, sees exactly the environment
    given, exits with the module's code, and waits for its non-daemon threads first."""
    from jaxdp.launcher.zygote import Zygote

    (tmp_path / "probe.py").write_text(PROBE)
    zygote = Zygote([sys.executable, "-m", "jaxdp.train"], {**cli_env(), "ZYGOTE_ONLY": "1"}, None)
    try:
        deadline = time.monotonic() + 120
        while not zygote.usable():
            assert not zygote.gone() and time.monotonic() < deadline, "the zygote did not start"
            time.sleep(0.05)
        out, err = tmp_path / "out", tmp_path / "err"
        child = zygote.fork(["3", "x"], {"PROBE": "yes", "PATH": os.environ.get("PATH", "")}, None, module="probe",
                            cwd=str(tmp_path), stdio=(os.devnull, str(out), str(err)), replace_env=True)
        assert child.wait(60) == 3
        seen = json.loads(out.read_text())
        assert seen == {"argv": ["3", "x"], "cwd": str(tmp_path), "env": "yes", "other": None, "path0": str(tmp_path)}
        assert err.read_text() == "to stderr\n"
        assert (tmp_path / "late.txt").read_text() == "written"
    finally:
        zygote.close()
