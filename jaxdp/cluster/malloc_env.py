"""Run the command-line entry points with glibc malloc tuned for big buffers.

Why: XLA's CPU runtime allocates its buffers with malloc on every step. glibc serves requests of
32 MB and more with a fresh mmap and unmaps them on free, so every step page-faults its big
buffers in again (README "Big buffers and glibc malloc" has the figures). glibc reads
its tuning variables once, when the process starts, so setting them from Python is too late.

What: the command-line entry points (`python -m jaxdp.train`, the `jaxdp-train` script,
`python -m jaxdp.bench`) call `reexec_if_needed()` first, before JAX is imported. On glibc, when
the variables are not set yet, it replaces the process (`os.execve`, same PID, same argv and
interpreter flags) with one that has them set. Exit codes and signals are untouched: there is no
parent process left to forward them. It happens at most once (`JAXDP_MALLOC_ENV=1` marks the new
process), never when an allocator is preloaded (tcmalloc, jemalloc), and never on import:
notebooks, pytest and user scripts that import jaxdp are left alone. `JAXDP_MALLOC_ENV=0` turns it
off.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping

MALLOC_ENV = {
    "MALLOC_MMAP_MAX_": "0",                      # never mmap: big buffers come from the heap...
    "MALLOC_TRIM_THRESHOLD_": "68719476736",      # ...and freed ones stay there (64 GiB trim threshold)
    "MALLOC_ARENA_MAX": "1",                      # one arena: a buffer freed by one thread is reused by all
}
MARK = "JAXDP_MALLOC_ENV"  # "1": set by the re-exec (or by hand); "0": never re-exec


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """True when this process (or one started with `env`) should re-exec itself with MALLOC_ENV
    (entry points only ask)."""
    env = os.environ if env is None else env
    return (env.get(MARK, "") not in ("0", "1")
            and not all(env.get(k) == v for k, v in MALLOC_ENV.items())
            and not any(name in env.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc"))
            and sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")


def tuned(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as the re-exec leaves it: MALLOC_ENV set and the process marked."""
    return {**env, **MALLOC_ENV, MARK: "1"}


def reexec_if_needed() -> None:
    """Call first thing in a command-line entry point, before JAX is imported."""
    if wanted():
        env = tuned(os.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
