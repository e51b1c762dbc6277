"""One run per checkpoint directory, and one directory for every process of a run.

* Process 0 locks the directory itself (`fcntl.flock` on the directory, exclusive, non-blocking)
  for the run's life, so a second run pointed at the same directory stops at once with one line
  (exit 2) instead of both saving over each other's steps. The lock is the kernel's: a run that is
  killed releases it, and nothing is written into the directory for it. (Where a filesystem cannot
  lock a directory, e.g. some NFS setups, a `.jaxdp-lock` file in it is locked instead and stays.)
* In a multi-process run, process 0 writes a file `.jaxdp-run-<token>` into the directory and
  publishes the token through JAX's coordination service; every other process must find that file
  in its own directory of that name. A process that does not (node-local disks: each node has its
  own directory) makes every process stop with one line naming it, instead of a save that times out
  ~100 s later. Process 0 removes the file once every process has looked.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import uuid
from typing import Any

from jaxdp.errors import InputError

LOCK_NAME = ".jaxdp-lock"       # only where a directory cannot be locked
TOKEN_PREFIX = ".jaxdp-run-"
_KEY = "jaxdp/checkpoint_dir/"
_IDS = itertools.count()  # every process opens its checkpointers in the same order


class DirectoryInUse(InputError):
    """Another process holds the directory's lock (another run; in an elastic run, possibly the
    former lead: jaxdp/loop/lead.py)."""


class DirectoryLock:
    """Hold `directory`'s lock (process 0) and check that every process sees the same directory."""

    def __init__(self, directory: str, process: int = 0, count: int = 1, client: Any = None, timeout_s: float = 60):
        self.directory = directory
        self._fd: int | None = None
        error = None
        if process == 0:
            try:
                self._acquire()
            except InputError as err:
                error = err
        if count > 1:
            error = _check_shared(directory, process, count, client, error, timeout_s)
        if error is not None:
            self.release()
            raise error

    def _acquire(self) -> None:
        try:
            self._fd = _lock(os.open(self.directory, os.O_RDONLY), "the directory's lock", self.directory)
        except OSError:  # this filesystem cannot lock a directory: lock a file in it instead
            fd = os.open(os.path.join(self.directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            self._fd = _lock(fd, LOCK_NAME, self.directory)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the lock
            self._fd = None


def _check_shared(directory: str, process: int, count: int, client: Any, error: InputError | None,
                  timeout_s: float) -> InputError | None:
    """Every process's verdict on whether it sees process 0's token file; the first bad one, or None."""
    key, timeout_ms = f"{_KEY}{next(_IDS)}/", int(timeout_s * 1000)
    token_file = None
    if process == 0:
        token = uuid.uuid4().hex
        if error is None:
            token_file = os.path.join(directory, TOKEN_PREFIX + token)
            with open(token_file, "w") as f:
                f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        client.key_value_set(f"{key}token", f"!{error}" if error else token)
        verdict = f"!{error}" if error else "ok"
    else:
        published = client.blocking_key_value_get(f"{key}token", timeout_ms)
        if published.startswith("!"):
            verdict = published
        elif os.path.exists(os.path.join(directory, TOKEN_PREFIX + published)):
            verdict = "ok"
        else:
            verdict = (f"!checkpoint directory {directory!r} on process {process} is not the one process 0 writes (it "
                       f"does not see process 0's {TOKEN_PREFIX}{published[:8]}...): node-local disks? every process "
                       f"must write one shared directory; put it on a shared filesystem")
    client.key_value_set(f"{key}{process}", verdict)
    try:
        for p in range(count):
            seen = verdict if p == process else client.blocking_key_value_get(f"{key}{p}", timeout_ms)
            if seen.startswith("!"):
                return InputError(seen[1:], argument="directory")
    finally:
        if token_file is not None:
            os.remove(token_file)
    return error


def _lock(fd: int, what: str, directory: str) -> int:
    """flock `fd` without waiting; InputError if another run holds it (OSError if it cannot be locked)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(f"checkpoint directory {directory!r} is in use by another run (it holds {what}); wait "
                             f"for it to finish or use another directory", argument="directory") from None
    except OSError:
        os.close(fd)
        raise
