"""Orbax's and asyncio's noise kept off the console: jaxdp reports each checkpoint problem in one
line instead of hundreds (--debug, the INFO level, keeps everything).

    with quiet():                        # a restore or save whose failures jaxdp reports itself
        ...
    first_line(err)                      # one readable line about an exception
    silence_asyncio()                    # after a failed save, for the rest of the process
    ignore_closed_event_loop_errors()    # after a failed restore's late reads
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from typing import Any


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
    `quiet` puts levels back when its block ends, which would undo a level."""
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger("asyncio").addFilter(_DROP_ALL)


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
