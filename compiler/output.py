"""Where a build writes: checks that never let it destroy user data, a lock, and the atomic swap into place.

A build writes into a hidden temporary folder beside its output (`.NAME.tmp-PID`) and renames it into
place only when everything is written, so an interrupted build never leaves a usable-looking artifact.
The output may replace only an empty directory or an artifact of this compiler. A lock file
(`.NAME.lock`) keeps two builds of one output from racing; whoever holds it first removes temporary
folders that killed builds left behind. Every temporary file of the compiler's tools (object files,
the linker's, nvcc's) goes inside the temporary folder, so nothing is left in the system temp folder.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import pickle
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ir.contract import ARTIFACT_FILES, KIND, MANIFEST
from ir.errors import RudaError, StorageError, storage_error


class OutputError(RudaError):
    """The output path cannot or must not be written: user data there, a file in the way, another build."""

    exit_code = 6


def is_artifact(directory: Path) -> bool:
    """Whether `directory` holds an artifact of this compiler: a manifest that says so (older formats included), or,
    for a damaged one, a manifest file among nothing but the files a build writes."""
    try:
        raw = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict) and (raw.get("kind") == KIND or {"format", "ir_hash", "code_hash"} <= raw.keys()):
        return True
    try:
        names = {entry.name for entry in directory.iterdir()}
    except OSError:
        return False
    return MANIFEST in names and names <= set(ARTIFACT_FILES)


def check_destination(out: Path, model_dir: Path, ours: Callable[[Path], bool] = is_artifact,
                      marker: str = MANIFEST) -> None:
    """Refuse an output that is a file, lies below a file, holds the model, or holds anything but what this compiler
    writes there (`ours`: an artifact, unless said otherwise, marked by its file `marker`)."""
    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == out else f"lies below {parent}, which is a file"
            raise OutputError(f"--out {out} {where}; choose a directory path")
    model, target = model_dir.resolve(), out.resolve()
    if target == model or target in model.parents:
        raise OutputError(f"--out {out} holds the model directory {model_dir}; choose another directory")
    if out.is_dir() and any(out.iterdir()) and not ours(out):
        raise OutputError(f"--out {out} exists and is not what this compiler writes there (it has no {marker} "
                          "marking it as ours); refusing to replace it: choose another --out, or remove it yourself")


class BuildOutput:
    """The locked output of one build: its temporary folder, and the swap that makes it the artifact."""

    def __init__(self, out: Path, tmp: Path):
        self.out = out
        self.tmp = tmp

    def commit(self, write: Callable[[Path], None]) -> None:
        """Write the artifact into the temporary folder with `write(folder)`, then swap it into place."""
        old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
        with _temp_files_in(self.tmp / "work"):
            in_child_process(lambda: write(self.tmp), f"writing {self.out}")
        shutil.rmtree(self.tmp / "work")
        if self.out.exists():
            self.out.rename(old)
        try:
            self.tmp.rename(self.out)
        except OSError:
            if old.exists():
                old.rename(self.out)  # keep the previous artifact rather than none
            raise
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def locked_output(out: Path, model_dir: Path, ours: Callable[[Path], bool] = is_artifact, marker: str = MANIFEST):
    """A BuildOutput for `out` after its checks (check_destination), holding its lock; the temporary folder is gone
    afterwards."""
    check_destination(out, model_dir, ours, marker)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = _acquire(out.parent / f".{out.name}.lock", out)
    except OSError as e:
        raise storage_error(e, f"preparing the output {out}") from None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by killed builds: the lock says none is running
        try:
            (tmp / "work").mkdir(parents=True)
        except OSError as e:
            raise storage_error(e, f"creating a temporary folder beside {out}") from None
        yield BuildOutput(out, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _release(lock)


def _acquire(path: Path, out: Path) -> tuple[int, Path]:
    """Lock `path` (created if need be) without waiting; the file is the same one that is locked on disk."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OutputError(f"another build is writing {out} right now; wait for it to finish") from None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, path
        os.close(fd)  # its holder removed the file after we opened it: lock the new one


def _release(lock: tuple[int, Path]) -> None:
    fd, path = lock
    try:
        path.unlink()
    except OSError:
        pass
    os.close(fd)


def in_child_process(work: Callable[[], None], doing: str) -> None:
    """Run `work` in a forked child and re-raise what it raised.

    LLVM ends its process when it cannot write a file (a full disk, a file-size limit), with no exception
    to catch; in a child, that costs the child only, and the build reports it and cleans up.
    """
    results, errors = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its stderr goes to the parent, its exception too
        code = 1
        try:
            os.close(results[0])
            os.close(errors[0])
            os.dup2(errors[1], 2)
            _die_with_parent()
            work()
            code = 0
        except BaseException as e:  # noqa: B036 - everything goes back to the parent
            os.write(results[1], pickle.dumps(_portable(e)))
        finally:
            os._exit(code)
    os.close(results[1])
    os.close(errors[1])
    try:
        stderr = _read_all(errors[0]).decode(errors="replace")
        raised = _read_all(results[0])
        _, status = os.waitpid(pid, 0)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    if raised:
        raise pickle.loads(raised)
    if status != 0:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"the process ended with status {status}"
        raise StorageError(f"{doing} failed ({reason}); check the free disk space and file-size limits, or build to "
                           "another --out")


def _portable(error: BaseException) -> BaseException:
    """The exception as something that pickles small: ours and OS errors as they are, others as their last line."""
    if isinstance(error, (RudaError, OSError, KeyboardInterrupt)):
        return error
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return RuntimeError(f"{type(error).__name__}: {lines[-1] if lines else ''}")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _die_with_parent() -> None:
    """Have Linux kill this process when its parent dies (a killed build leaves no writer behind)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


@contextmanager
def _temp_files_in(folder: Path):
    """Point Python's and child processes' temporary files (the linker's, nvcc's) into `folder`."""
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
