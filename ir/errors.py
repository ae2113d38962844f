"""The project's error types, their exit codes, and the one error path every command-line tool goes through.

A user error (bad input, bad files, unwritable paths, interrupts, closed pipes, a full disk) ends a CLI
with one line on stderr and a distinct exit code (docs/errors.md lists them); `--debug` or RUDA_DEBUG=1
adds the traceback. Anything else is a bug, reported as an internal error in one line too.
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import signal
import sys
import traceback
import warnings
from typing import Callable, NoReturn

DEBUG_ENV = "RUDA_DEBUG"
EXIT_INTERNAL = 70  # a bug: the message asks for a report
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # the reader of our output went away (128 + SIGPIPE)
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM)
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class RudaError(Exception):
    """A problem with the user's input or files, with a message that says what to do."""

    exit_code = 1


class UsageError(RudaError):
    """A command-line input that cannot be used: bad option values or combinations, unreadable input text."""

    exit_code = 2


class StorageError(RudaError):
    """A file or folder cannot be read or written: permissions, a full disk, a file-size limit."""

    exit_code = 8


class RudaWarning(UserWarning):
    """Something suspicious that does not stop the work (e.g. non-finite weights)."""


class Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so temporary files are removed."""


def storage_error(error: OSError, doing: str) -> StorageError:
    """A StorageError for an OSError met while `doing` something, naming the path and the fix."""
    path = error.filename or "?"
    if error.errno in _DISK_FULL:
        return StorageError(f"{path}: no space left (disk full or file size limit) while {doing}; free some space "
                            "or write somewhere else")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageError(f"{path}: permission denied while {doing}; fix its permissions or use another path")
    return StorageError(f"{path}: {error.strerror or error} while {doing}")


def positive_int(name: str):
    """An argparse type: an integer > 0, or a usage error naming the option `name`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer > 0, got {text!r}")
        return value
    return parse


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """The --debug option every CLI has."""
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks of errors (or set {DEBUG_ENV}=1)")


def exit_cli(main: Callable[[list[str]], int]) -> NoReturn:
    """End the process with the exit status of `run_cli(main)`."""
    code = run_cli(main)
    if code == EXIT_INTERRUPTED:
        # An interrupt that passed through exec() of a string (dataclasses make their methods so, as a module
        # imports) marks it unhandled to CPython, however it was handled: under `python -m` the process would end by
        # SIGINT at exit instead of with this status. So it ends here, its output flushed, without that exit.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # closed: nothing more can reach its reader
        os._exit(code)
    sys.exit(code)


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run a CLI's `main(argv)` behind the one error path; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    warnings.showwarning = _show_warning
    signals: list[int] = []  # what arrived: TVM reports an interrupt inside its own calls as a bare error
    signal.signal(signal.SIGINT, lambda signum, frame: _interrupt(signals, signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: _interrupt(signals, signum))
    if hasattr(signal, "SIGXFSZ"):  # past a file-size limit, writes fail with EFBIG instead of killing us silently
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        return main(argv)
    except (KeyboardInterrupt, Terminated, Exception) as error:
        message, code = _last_words(error, signals)
        if debug:
            traceback.print_exc()
    # The failed work's frames go now, not after our line: TVM objects they held may log as they are freed (a block
    # builder interrupted mid-function warns), and the one line a failure ends with must be the last on stderr.
    gc.collect()
    first, *_ = message.splitlines() or [""]
    try:
        print(first, file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr is gone too: the exit code is all that is left
    return code


def _last_words(error: BaseException, signals: list[int]) -> tuple[str, int]:
    """The message and the exit status a CLI ends with after `error`."""
    if isinstance(error, BrokenPipeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more can reach the reader
        return "error: output closed early (broken pipe); stopped", EXIT_BROKEN_PIPE
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(error, Terminated):
        return "terminated", EXIT_TERMINATED
    if isinstance(error, OSError):
        error = storage_error(error, "working")
    if isinstance(error, RudaError):
        return f"error: {error}", error.exit_code
    if isinstance(error, MemoryError):
        return "error: out of memory; close other programs or use a smaller model or buckets", 8
    if signals:  # a bug, or TVM reporting an interrupt inside its own calls as a bare error
        return ("interrupted", EXIT_INTERRUPTED) if signals[0] == signal.SIGINT else ("terminated", EXIT_TERMINATED)
    return (f"internal error: {type(error).__name__}: {error}; rerun with --debug for the traceback and report it",
            EXIT_INTERNAL)


def _interrupt(signals: list[int], signum: int):
    signals.append(signum)
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr, flush=True)
