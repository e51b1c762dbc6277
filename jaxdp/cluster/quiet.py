"""Orbax's, asyncio's and gloo's noise kept off the console: jaxdp reports each checkpoint problem in
one line instead of hundreds (--debug, the INFO level, keeps everything).

    with quiet():                        # a restore or save whose failures jaxdp reports itself
        ...
    first_line(err)                      # one readable line about an exception
    silence_asyncio()                    # after a failed save, for the rest of the process
    ignore_closed_event_loop_errors()    # after a failed restore's late reads
    filter_gloo_lines(enabled)           # multi-process CPU runs: no "[Gloo] Rank N is connected to ..."
    quiet_http_requests()                # an elastic run on torchft: no access line per state transfer
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from typing import Any, Callable


def first_line(err: BaseException) -> str:
    """One readable line about `err`: no pybind reprs, no tracebacks, at most 200 characters."""
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    line = re.split(r"\s*(?:See full TensorStore details|<bound method|<built-in method)", line)[0].rstrip(" .:;")
    return line[:200] or type(err).__name__


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


_DROP_ALL = _DropAll()


def silence_asyncio() -> None:
    """Drop every asyncio log record from now on (not with --debug). A filter, not a level:
    `quiet` puts levels back when its block ends, which would undo a level. So too Python's
    "coroutine ... was never awaited" warnings at exit: the stages of a failed save that never ran."""
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger("asyncio").addFilter(_DROP_ALL)
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)


def quiet_http_requests() -> None:
    """torchft's checkpoint server (a heal's state transfer: jaxdp/elastic/ft.py) writes an access line
    per request to stderr (`::ffff:127.0.0.1 - - [...] "GET /checkpoint/42/full HTTP/1.1" 200 -`):
    dropped in this process, since Python's http.server has no logger to set (not with --debug). Its
    errors still print."""
    if logging.getLogger().isEnabledFor(logging.INFO):
        return
    from http.server import BaseHTTPRequestHandler

    BaseHTTPRequestHandler.log_request = lambda self, code="-", size="-": None


_NOISY_LOGGERS = ("absl", "asyncio", "orbax", "jax._src.distributed")


@contextlib.contextmanager
def quiet():
    """Orbax and asyncio log every failed read or write with a traceback (100s of lines for one
    damaged checkpoint); jaxdp reports each failure in one line instead. --debug (INFO) keeps them."""
    if logging.getLogger().isEnabledFor(logging.INFO):
        yield
        return
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def ignore_closed_event_loop_errors() -> None:
    """Drop the "Event loop is closed" errors that a *failed* orbax restore reports as unraisable.

    Hazard: when one array of a restore fails, orbax closes its event loop while tensorstore still
    completes the other reads, some of them after `restore` has returned; each prints a RuntimeError
    traceback to stderr. They are noise after the real error, which `restore` reports in one line.
    So from the first restore on, this process ignores exactly those; everything else passes through.
    """
    previous = sys.unraisablehook
    if getattr(previous, "jaxdp_ignores_closed_event_loop", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and "Event loop is closed" in str(error)):
            previous(unraisable)

    hook.jaxdp_ignores_closed_event_loop = True
    sys.unraisablehook = hook


# Printed by gloo's C++ code (std::cout, fd 1) once per device when its connections are up, in every
# process of a multi-process CPU run: "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number
# of connected peer ranks is : 7". 8 devices, 8 lines per process, every run. The devices' threads
# print at the same moment, so their pieces interleave ("[Gloo] Rank [Gloo] Rank 0 is connected to
# ..."): a line is gloo's when it is made of nothing but those pieces.
GLOO_LINE = re.compile(rb"(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. ?|Expected number of connected "
                       rb"peer ranks is : ?|\s)+")
_GLOO_WORDS = (b"[Gloo]", b"peer ranks")
_MAYBE_GLOO = re.compile(rb"[\w\[\] .:]{0,4096}")  # a partial line that may still become one: held back


def is_gloo_line(line: bytes) -> bool:
    """Whether `line` (without its newline) is made of gloo's connection message and nothing else."""
    return any(word in line for word in _GLOO_WORDS) and GLOO_LINE.fullmatch(line) is not None


_filter: "_LineFilter | None" = None


class _LineFilter:
    """fd `fd` replaced by a pipe; a thread forwards what is written to it, line by line, to the
    original file, except lines that `drop` matches. Text is forwarded as soon as it arrives (a
    partial line too, unless it may become a dropped one)."""

    def __init__(self, fd: int, drop: Callable[[bytes], bool]):
        self.fd, self.drop = fd, drop
        self.target = os.dup(fd)  # where the output really goes
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._read = read
        self._thread = threading.Thread(target=self._forward, name=f"jaxdp-filter-fd{fd}", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            out = b"".join(line + b"\n" for line in lines if not self.drop(line))
            if pending and not _MAYBE_GLOO.fullmatch(pending):  # a partial line goes out now, unless
                out, pending = out + pending, b""                 # it may still become a dropped one
            self._write(out)
        if pending and not self.drop(pending):
            self._write(pending)
        os.close(self._read)

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self.target, data):]
            except OSError:
                return  # the reader went away (a closed pipe): nothing to forward to

    def stop(self) -> None:
        """Put the fd back and forward what is left (at exit: Python's and C's buffers first)."""
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).fflush(None)  # C stdio buffers (gloo writes through std::cout)
        os.dup2(self.target, self.fd)  # the pipe's last write end closes: the thread sees its end
        self._thread.join(timeout=5)
        os.close(self.target)


def filter_gloo_lines(enabled: bool = True) -> None:
    """Keep gloo's "[Gloo] Rank N is connected to M peer ranks" lines (stdout, one per device in
    every process of a multi-process CPU run) off the console; everything else on stdout passes
    unchanged. Call it once at start-up, before the first cross-process collective; `enabled`
    False (--debug) leaves stdout alone, as does a second call. It works at the file-descriptor
    level (gloo writes from C++, past Python's sys.stdout): fd 1 becomes a pipe that a thread
    filters; the original stdout is put back at exit."""
    global _filter
    if not enabled or _filter is not None:
        return
    try:
        _filter = _LineFilter(1, is_gloo_line)
    except OSError:  # no fd 1 to replace (closed): nothing to filter
        return
    atexit.register(_filter.stop)
