"""Exit codes of the command-line tools, and the exception types for bad user input (`InputError`; in flag
terms, `ConfigError`).

Every exit code jaxdp's commands use is defined here and nowhere else; the README's table is
checked against this module by a test. Codes above 2 come from BSD's sysexits.h where one fits.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from typing import Callable

EXIT_OK = 0
EXIT_ERROR = 1            # anything unexpected: a bug or an environment problem (--debug: traceback)
EXIT_BAD_INPUT = 2        # bad flags, files or config: one line on stderr, nothing changed on disk
EXIT_DIVERGED = 65        # EX_DATAERR: the loss or gradient norm became NaN or infinite; nothing bad was saved
EXIT_PEER_LOST = 69       # EX_UNAVAILABLE: a peer process of a multi-process run died, never arrived or stalled
EXIT_CANNOT_SAVE = 73     # EX_CANTCREAT: a checkpoint could not be written (disk full, permissions); earlier ones are intact
EXIT_PREEMPTED = 75       # EX_TEMPFAIL: stopped by SIGTERM / SIGUSR1 after saving a checkpoint; rerun to resume
EXIT_INTERRUPTED = 130    # Ctrl-C (128 + SIGINT), as shells report it

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_ERROR: "an unexpected error (rerun with --debug for the traceback)",
    EXIT_BAD_INPUT: "bad input: a one-line message says what to change",
    EXIT_DIVERGED: "training diverged (NaN or infinite loss or gradient norm); the last checkpoint is intact",
    EXIT_PEER_LOST: "a peer process died, never arrived or stopped answering",
    EXIT_CANNOT_SAVE: "a checkpoint could not be written (disk full, permissions); the earlier ones are intact",
    EXIT_PREEMPTED: "preempted: a checkpoint was saved; rerun the same command to resume",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); with a checkpoint directory, the first Ctrl-C saves first: rerun to resume",
}


class InputError(ValueError):
    """Bad input to a library call, said in one sentence that tells what to change.

    `argument` names the parameter in the library's terms ("directory", "dataset", "devices"); the
    command line prefixes the message with the flag that fed that parameter. `setting` names a
    `jaxdp.config.Config` field the message mentions as `name=value`; the command line spells it
    as its flag.
    """

    def __init__(self, message: str, *, argument: str | None = None, setting: str | None = None):
        super().__init__(message)
        self.argument, self.setting = argument, setting


class ConfigError(InputError):
    """Bad command-line input. The message is one sentence, in flag terms, that says what to change."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint save failed (disk full, permissions, a vanished directory): exit EXIT_CANNOT_SAVE.

    The message is one line that names the step and the directory. Earlier checkpoints are intact;
    the failed save is left as `<step>.orbax-checkpoint-tmp`, which is never restored.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse for the tools (sample, export, prepare): a usage error raises InputError, so it is
    one line on stderr and exit code 2, without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(message)


def out_of_memory(err: BaseException) -> str | None:
    """XLA's out-of-memory error (RESOURCE_EXHAUSTED, followed by a report of many lines) said in a
    few words, or None for any other error."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text or "memory" not in text.lower():
        return None
    wanted = re.search(r"allocate (\d+) bytes", text)
    return "out of device memory" + (f" (XLA could not allocate {int(wanted.group(1)) / 2**30:.2f} GiB more)"
                                     if wanted else "")


def run_tool(body: Callable[[], int], *, debug: bool, describe: Callable[[InputError], str] = str,
             before_unexpected: Callable[[], None] | None = None, memory_advice: str = "") -> int:
    """A tool's `main` around `body` (which returns its exit code): bad input is one line
    `jaxdp: error: ...` (`describe` puts it in flag terms) and EXIT_BAD_INPUT, Ctrl-C is
    EXIT_INTERRUPTED, anything else one line and EXIT_ERROR, after `before_unexpected()` if given
    (running out of device memory: that, and `memory_advice`, what to change);
    `debug` (--debug) adds the traceback. `body` handles the errors of its own (train: divergence,
    failed saves) and returns their codes."""
    try:
        return body()
    except InputError as err:
        if debug:
            traceback.print_exc()
        print(f"jaxdp: error: {describe(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("jaxdp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # a bug or an environment problem: one line
        if before_unexpected is not None:
            before_unexpected()
        if debug:
            traceback.print_exc()
        elif (memory := out_of_memory(err)) is not None:
            print(f"jaxdp: error: {memory}{memory_advice} (rerun with --debug for XLA's report)", file=sys.stderr)
        else:
            print(f"jaxdp: error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR
