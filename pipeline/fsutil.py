"""File helpers shared by the stages: content hashes, atomic writes, replacing a folder without a moment of loss, and
reading a YAML file the user named."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import yaml

from pipeline.errors import UserError, naming
from pipeline.yaml_bounds import YamlBoundsError, check_bounds


def hash_file(path: Path, digest) -> str:
    """Feed the file to a hashlib-style digest in 8 MB blocks (never the whole file in memory); its hex digest."""
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """write(fh) into a temporary file, fsync, rename, fsync of the folder: readers see the old or the new file,
    never a mix, and a crash never leaves a half-written one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming(path), open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writes:
    """Only a file's write method: numpy then writes through it, and a full disk raises OSError(ENOSPC). Given the
    file itself, numpy writes with tofile, whose full disk is an OSError with no errno ("N requested and M written"),
    which no handler can tell from any other failure."""

    def __init__(self, fh: BinaryIO):
        self.write = fh.write


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save's bytes, written as write_atomic writes."""
    write_atomic(path, lambda fh: np.save(_Writes(fh), array))


def allocate(path: Path) -> None:
    """Reserve the disk blocks of a file created sparse (np.lib.format.open_memmap): a full disk is then an
    OSError(ENOSPC) here, not a SIGBUS that kills the process, with no message, at the first page written through
    the memory map."""
    with naming(path), open(path, "r+b") as fh:
        os.posix_fallocate(fh.fileno(), 0, os.fstat(fh.fileno()).st_size)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def replace_dir(new: Path, target: Path) -> None:
    """Put the finished folder new at target; the old one is deleted only after. Where the file system can, the two
    are exchanged in one rename (renameat2's RENAME_EXCHANGE: ext4, xfs, btrfs, tmpfs), so no moment leaves target
    missing. Elsewhere the old one is moved aside first, and a kill between the two renames is undone by the next
    call for target (restore_replaced)."""
    restore_replaced(target)
    if target.exists() and _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # new now names the old folder
        return
    old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def restore_replaced(target: Path) -> None:
    """Undo what a replace_dir killed between its two renames left: target missing, and the folder it replaced
    hidden as .NAME.replaced-PID (PID no longer running) is renamed back. Such a folder beside a target that exists
    was killed after the second rename and is deleted."""
    for old in target.parent.glob(f".{glob.escape(target.name)}.replaced-*"):
        if not left_by_a_dead_process(old):
            continue
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, target)


def left_by_a_dead_process(path: Path) -> bool:
    """Whether a NAME-PID work path's process (this machine's) is gone, so what it left may be cleaned up."""
    pid = path.name.rsplit("-", 1)[-1]
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one rename; False where the C library or the file system cannot (then nothing moved)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc before 2.28, musl
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE from <fcntl.h> and <linux/fs.h>
    return renameat2(at_cwd, os.fsencode(a.absolute()), at_cwd, os.fsencode(b.absolute()), exchange) == 0


def read_yaml(path: Path, what: str) -> Any:
    """The YAML document of a file the user named (`what`: its flag), with one clear line when it cannot be read,
    and refused in one line beyond yaml_bounds' limits (a deep nesting or an alias bomb would crash or exhaust the
    loader)."""
    try:
        text = path.read_text(encoding="utf-8")
        check_bounds(text)
        return yaml.safe_load(text)
    except OSError:
        raise UserError(f"{what} {path} cannot be read") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not UTF-8 text") from None
    except YamlBoundsError as exc:
        raise UserError(f"{what} {path} is refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
