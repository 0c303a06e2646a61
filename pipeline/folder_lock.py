"""One writer per output folder: an exclusive lock that names its holder, so a second job writing the same run folder
or dataset gets one line instead of both exiting 0 over a mixed folder.

The lock is a kernel lock (flock) on a small file: inside a run folder (`RUN/.lock`), beside a dataset
(`.NAME.lock`), which may not exist yet and is replaced whole (DATA-HF renames a finished one into place). The kernel
drops the lock when its holder exits or is killed, so a dead job's lock is simply taken by the next one; the file
holds the holder's host, pid and start time for the message. On NFS the Linux client maps flock to
the server's byte-range locks, so jobs on different nodes exclude each other too; a file system without locks (some
Lustre mounts) gets a warning and no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_held: dict[Path, int] = {}
"""Lock file -> the descriptor this process holds it by, open until the process ends (closing it would unlock)."""


def beside(folder: Path) -> Path:
    """The lock file of a folder that may not exist yet or may be replaced whole: `.NAME.lock` next to it."""
    return folder.parent / f".{folder.name}.lock"


def hold(lock_file: Path, what: str) -> str:
    """Take the lock for the rest of this process and record `what` (e.g. "fsdp1.py") as its holder. Returns "" once
    held (or when the file system has no locks), else who holds it: "fsdp1.py (pid 123 on node7, since 2026-11-24
    08:40:01)", for the caller's one line. The file stays, naming the last holder."""
    if lock_file in _held:
        return ""
    fd, holder = _take(lock_file, what)
    if fd is not None:
        _held[lock_file] = fd
    return holder


@contextlib.contextmanager
def locked(lock_file: Path, what: str) -> Iterator[str]:
    """hold() for the block only: yields "" while held, else who holds it. The file is removed, while still locked,
    when the block ends, so nothing is left behind (_take checks that the file it locked is still the one there)."""
    fd, holder = _take(lock_file, what)
    try:
        yield holder
    finally:
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                lock_file.unlink()
            os.close(fd)


def _take(path: Path, what: str) -> tuple[int | None, str]:
    """(descriptor holding the lock, "") or (None, who holds it); (None, "") where the file system has no locks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            return None, holder
        except OSError as exc:
            os.close(fd)
            log.warning("cannot lock %s (%s): a second job writing the same output would not be refused", path, exc)
            return None, ""
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it between our open and our lock: lock the file there now
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    record = json.dumps({"what": what, "pid": os.getpid(), "host": socket.gethostname(), "since": since})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    return fd, ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote (it may still be writing it: then only that it is held)."""
    try:
        r = json.loads(os.pread(fd, 4096, 0))
        return f"{r['what']} (pid {r['pid']} on {r['host']}, since {r['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
