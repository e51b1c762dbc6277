"""A warm start for the processes an elastic run restarts: fork a process that has imported everything.

    zygote = Zygote([python, "-m", "jaxdp.train", ...], env)   # in the launcher, next to the workers
    child = zygote.fork(env, cores)                             # a Popen-like: poll, send_signal, kill, wait

A restarted `python -m jaxdp.train` spends most of its start-up importing JAX, Flax, optax and
orbax, and in an elastic run that CPU time is taken from the processes still training. The zygote
(`python -m jaxdp.launcher.zygote MODULE`) imports all of it once, at the start of the run, without
starting JAX's backend (no devices, no XLA threads yet: a fork is safe), then waits. The launcher
may name more to import (`preload`: an elastic run on torchft adds torch and torchft, which would
cost every restart more CPU still). To restart rank r, the launcher asks it to fork: the child sets
its environment, cores and session, and runs MODULE as `python -m MODULE` would (`runpy`), with the
same arguments; it starts its backend, loads its compiled programs from the persistent cache and
joins, reaching its first step much sooner than a new process (these times: docs/performance.md,
"Behind the defaults").

The zygote reports each child's exit status to the launcher (it is the children's parent), over a
pipe that carries one JSON object per line. It dies with the launcher (PR_SET_PDEATHSIG), and its
children with it. If it is gone, or the command is not `PYTHON -m MODULE ...`, the launcher starts
restarted processes the ordinary way.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

ENV_FDS = "JAXDP_ZYGOTE_FDS"  # "REQUESTS,REPLIES": the pipe ends the zygote reads and writes
ENV_PRELOAD = "JAXDP_ZYGOTE_PRELOAD"  # "MODULE,MODULE,...": what else it imports (a run on torchft: torch, torchft)
PRELOAD = ("jax", "flax.linen", "optax", "orbax.checkpoint", "jaxdp.loop.trainer", "jaxdp.step.train_step",
           "jaxdp.checkpoint.checkpointer", "jaxdp.sync.controller", "jaxdp.cluster.distributed",
           "jaxdp.cluster.heartbeat", "jaxdp.data.datasets", "jaxdp.models.builtin", "jaxdp.models.tasks",
           "jaxdp.models.usermodel", "jaxdp.cluster.agreement", "jaxdp.step.optim", "jaxdp.cluster.runtime",
           "jaxdp.data.prefetch", "jaxdp.step.state", "jaxdp.metrics", "jaxdp.sync.exchange")


def module_of(command: Sequence[str]) -> str | None:
    """MODULE for a command `PYTHON -m MODULE ...` (a Python interpreter), else None."""
    if len(command) >= 3 and command[1] == "-m" and os.path.basename(command[0]).startswith("python"):
        return command[2]
    return None


class Forked:
    """A child of the zygote, as the launcher sees it (the parts of subprocess.Popen it uses)."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid, self._zygote, self.returncode = pid, zygote, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        if self.returncode is None and self._zygote.gone() and not os.path.exists(f"/proc/{self.pid}"):
            self.returncode = -signal.SIGTERM  # died with the zygote (PR_SET_PDEATHSIG); nobody reported it
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        try:
            self.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode


class Zygote:
    """The launcher's end of `python -m jaxdp.launcher.zygote MODULE`."""

    def __init__(self, command: Sequence[str], env: dict[str, str], prepare: Any, preload: Sequence[str] = ()):
        """`preload`: modules to import beside PRELOAD (those the workers import that the others do not)."""
        self.command = list(command)
        self.module = module_of(command)
        requests_r, self._requests = os.pipe()
        self._replies, replies_w = os.pipe()
        self.proc = subprocess.Popen([command[0], "-m", "jaxdp.launcher.zygote", self.module],
                                     env={**env, ENV_FDS: f"{requests_r},{replies_w}", ENV_PRELOAD: ",".join(preload)},
                                     pass_fds=(requests_r, replies_w), preexec_fn=prepare, start_new_session=True,
                                     stdin=subprocess.DEVNULL)
        os.close(requests_r)
        os.close(replies_w)
        os.set_blocking(self._replies, False)
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._forked: list[int] = []
        self._lock = threading.RLock()  # fork's request and reply, and every read of the replies
        self.ready = False

    def gone(self) -> bool:
        return self.proc.poll() is not None

    def _read(self) -> None:
        with self._lock:  # (a caller's threads may wait on several children at once)
            self._read_unlocked()

    def _read_unlocked(self) -> None:
        try:
            while True:
                chunk = os.read(self._replies, 65536)
                if not chunk:
                    break
                self._buffer += chunk
        except BlockingIOError:
            pass
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if message.get("ready"):
                self.ready = True
            elif "pid" in message:
                self._forked.append(message["pid"])
            elif "exited" in message:
                self._exits[message["exited"]] = message["code"]

    def usable(self) -> bool:
        self._read()
        return self.ready and not self.gone()

    def exit_code(self, pid: int) -> int | None:
        self._read()
        return self._exits.get(pid)

    def fork(self, argv: Sequence[str], env: dict[str, str], cores: set[int] | None, timeout: float = 10.0, *,
             module: str | None = None, cwd: str | None = None, stdio: Sequence[str | None] | None = None,
             replace_env: bool = False) -> Forked:
        """A child running MODULE (or `module`) with `argv` (the command's arguments after the
        module) and `env` added (with `replace_env`, `env` is its whole environment), bound to
        `cores`; in `cwd`, with stdin, stdout and stderr from the files `stdio` names (None: the
        zygote's). OSError if the zygote does not answer."""
        request = {"argv": list(argv), "env": env, "cores": sorted(cores) if cores else None, "module": module,
                   "cwd": cwd, "stdio": list(stdio) if stdio else None, "replace_env": replace_env}
        with self._lock:  # one request and its reply at a time: the replies name pids in order
            os.write(self._requests, (json.dumps(request) + "\n").encode())
            deadline = time.monotonic() + timeout
            while not self._forked:
                if self.gone() or time.monotonic() > deadline:
                    raise OSError("the zygote did not fork")
                select.select([self._replies], [], [], 0.05)
                self._read()
            return Forked(self._forked.pop(0), self)

    def close(self) -> None:
        for fd in (self._requests, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
# The zygote process
# ---------------------------------------------------------------------------------------------


def _child(request: dict, module: str, fds: Sequence[int]) -> None:
    """In the forked child: become the restarted process, run MODULE, exit with its code."""
    import atexit
    import runpy
    import traceback

    code = 0
    try:
        for fd in fds:
            os.close(fd)
        os.setsid()
        if sys.platform.startswith("linux"):  # dies with the zygote, which dies with the launcher
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if request.get("cores"):
            os.sched_setaffinity(0, set(request["cores"]))
        if request.get("cwd"):
            os.chdir(request["cwd"])
            sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
        stdio = request.get("stdio") or ()
        for fd, path in zip((0, 1, 2), stdio):
            if path and fd == 2 and path == stdio[1]:
                os.dup2(1, 2)  # stderr to the same file as stdout: one descriptor, as 2>&1
            elif path:
                opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
        if request.get("replace_env"):
            os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(ENV_FDS, None)
        module = request.get("module") or module
        sys.argv = [module, *request["argv"]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:  # as the interpreter's own exit does: wait for non-daemon threads, then the atexit functions
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001 - the exit code stands
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    from jaxdp.cluster import malloc_env

    malloc_env.reexec_if_needed()  # the children inherit the tuned environment (jaxdp/cluster/malloc_env.py)
    import importlib

    module = sys.argv[1]
    requests, replies = (int(fd) for fd in os.environ[ENV_FDS].split(","))
    more = [name for name in os.environ.pop(ENV_PRELOAD, "").split(",") if name]
    for name in (*PRELOAD, *more):  # imports only: JAX's backend starts in each child
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    importlib.util.find_spec(module)

    def reply(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    reply({"ready": True})
    buffer = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        if readable:
            chunk = os.read(requests, 65536)
            if not chunk:  # the launcher is gone
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), module, (requests, replies))
                children.add(pid)
                reply({"pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
