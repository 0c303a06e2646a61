"""File helpers shared by the stages: content hashes, replacing a folder without a moment of loss, and the two checks
every stage makes of what the user named (a YAML file read, an output kept out of its input)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

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


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def replace_dir(new: Path, target: Path) -> None:
    """Rename the finished folder new to target; an existing target is moved aside first and deleted only after."""
    old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


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


def refuse_inside(inner: Path, inner_flag: str, outer: Path, outer_flag: str, why: str) -> None:
    """An output folder (inner) at or under the input folder (outer) is refused: it would be read back as input."""
    a, b = inner.resolve(), outer.resolve()
    if a == b or b in a.parents:
        raise UserError(f"{inner_flag} {inner} is inside {outer_flag} {outer}; {why}")
