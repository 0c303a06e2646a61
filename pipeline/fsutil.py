"""File helpers shared by the stages: content hashes and replacing a folder without a moment of loss."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def replace_dir(new: Path, target: Path) -> None:
    """Rename the finished folder new to target; an existing target is moved aside first and deleted only after."""
    old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)
