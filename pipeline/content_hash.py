"""Content hashes of large files (model weights, Arrow data), each read once: a record kept beside the files holds
each file's size, modification time and SHA-256, so a file whose size and time are unchanged is not read again.

Racy stamps (git's "racy clean" problem): file systems keep modification times at a clock tick's resolution, so a
file changed within the same tick as the moment it was read looks unchanged. A stamp is trusted only when the file
was already older than RACY_NS when it was read; a younger one is read again next time.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.fsutil import sha256_file, write_text_atomic

RACY_NS = 2_000_000_000


@dataclass(frozen=True)
class Stamp:
    """What was read, and when."""

    size: int
    mtime_ns: int
    sha256: str
    read_ns: int
    """Wall time when the read began (for the racy-stamp rule)."""

    def vouches_for(self, st: os.stat_result) -> bool:
        """Whether the file behind st is, without a doubt, the one that was read."""
        return (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns) and self.mtime_ns < self.read_ns - RACY_NS


class HashRecord:
    """The stamps of the files of one folder, in one JSON file. Losing or damaging it costs a read, never a wrong
    answer: an unreadable record is an empty one, and a record that cannot be written (a read-only folder) is kept in
    memory only."""

    def __init__(self, path: Path):
        self.path = path
        self.stamps: dict[str, Stamp] = {}
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            self.stamps = {k: Stamp(**v) for k, v in raw.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            self.stamps = {}
        self.changed = False

    def trusted(self, key: str, file: Path) -> Stamp | None:
        """The stamp of key when it still vouches for file, else None (the file must be read)."""
        stamp = self.stamps.get(key)
        return stamp if stamp is not None and stamp.vouches_for(file.stat()) else None

    def read(self, file: Path) -> Stamp:
        """Hash file now. The stat is taken before the read, so a change during the read is seen next time."""
        started = time.time_ns()
        st = file.stat()
        return Stamp(st.st_size, st.st_mtime_ns, sha256_file(file), started)

    def keep(self, key: str, stamp: Stamp) -> None:
        self.stamps[key] = stamp
        self.changed = True

    def save(self) -> bool:
        """Write the record if it changed; False when its folder cannot be written (hashes are then not kept)."""
        if not self.changed:
            return True
        try:
            write_text_atomic(self.path, json.dumps({k: asdict(v) for k, v in sorted(self.stamps.items())}, indent=1))
        except OSError:
            return False
        self.changed = False
        return True

    def digest(self, key: str, file: Path) -> str:
        """file's SHA-256: from its stamp when it vouches for it, else read now and kept."""
        stamp = self.trusted(key, file)
        if stamp is None:
            stamp = self.read(file)
            self.keep(key, stamp)
        return stamp.sha256
