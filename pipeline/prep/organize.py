"""ORGANIZE_DATA: spread a tree of raw files over N folders balanced by bytes, with a sha256 manifest.

The source is only ever read. Every file keeps its path relative to the source inside its split, so same-named
files in different folders never collide. The plan is a pure function of (source contents, num_dirs, seed), so a
rerun produces the same layout and only writes what is missing or stale.

A run that is killed or fills the disk can be rerun: before anything is placed, the destination gets JOURNAL, and
each file's row is appended to it before the file is written, so the rerun knows every file a run of ours may have
left (and removes what the plan no longer wants). The manifest replaces the journal at the end.
"""

from __future__ import annotations

import argparse
import errno
import glob
import hashlib
import heapq
import json
import os
import shutil
import stat
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pipeline.errors import ArgumentParser, UserError, naming
from pipeline.folder_lock import beside, locked
from pipeline.fsutil import sha256_file, write_text_atomic
from pipeline.ownership import check_apart, check_not_nested, check_target, mark

MANIFEST = "manifest.jsonl"
JOURNAL = "manifest.partial.jsonl"
"""The rows of an unfinished run, one appended before each file is placed; a folder holding it is ours."""
MODES = ("copy", "hardlink", "symlink")


@dataclass
class OrganizeConfig:
    src_dir: Path
    """Tree of raw files to organise. Never modified."""
    dst_root: Path = Path("splits")
    """Where split_00 .. split_{N-1} and manifest.jsonl are written."""
    num_dirs: int = 20
    """Number of split folders."""
    mode: str = "copy"
    """copy, hardlink (falls back to copy across filesystems) or symlink (absolute links to the source)."""
    seed: int = 0
    """Breaks ties between files of equal size, deterministically."""
    asked_dirs: int = 0
    """--num_dirs as given, when it was more than the files and so lowered to their number (0: not lowered)."""

    def __post_init__(self) -> None:
        self.src_dir = Path(self.src_dir)
        self.dst_root = Path(self.dst_root)
        if self.num_dirs < 1:
            raise UserError(f"--num_dirs must be at least 1, got {self.num_dirs}")
        if self.mode not in MODES:
            raise UserError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.src_dir.is_dir():
            raise UserError(f"--src_dir {self.src_dir} does not exist or is not a directory")
        check_apart(self.dst_root, "--dst_root", [(self.src_dir, "--src_dir")], "choose a folder outside it")
        check_not_nested(self.dst_root, "splits", "--dst_root")


@dataclass
class SourceFile:
    rel: str
    """Path relative to the source root, with forward slashes."""
    size: int


@dataclass
class Scan:
    files: list[SourceFile] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def _classify_link(path: Path, src_real: Path) -> str | None:
    """Why a symlink is skipped. Links are never followed: a target inside the tree is reached on its own path."""
    try:
        os.stat(path)
    except OSError as exc:
        return "link_loop" if exc.errno == errno.ELOOP else "broken_link"
    target = Path(os.path.realpath(path))
    if target != src_real and src_real not in target.parents:
        return "link_outside_source"
    parent = path.parent.resolve()
    if target.is_dir() and (target == parent or target in parent.parents):
        return "link_loop"
    return "link_inside_source"


def scan_source(src_dir: Path) -> Scan:
    """List regular files under src_dir in sorted order; report links and special or unreadable files."""
    scan = Scan()
    src_real = src_dir.resolve()
    stack = [src_dir]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name, reverse=True)
        except OSError:
            scan.skipped["unreadable"].append(folder.relative_to(src_dir).as_posix() + "/")
            continue
        for entry in entries:
            path = Path(entry.path)
            rel = path.relative_to(src_dir).as_posix()
            if entry.is_symlink():
                scan.skipped[_classify_link(path, src_real)].append(rel)
            elif entry.is_dir(follow_symlinks=False):
                stack.append(path)
            elif not stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                scan.skipped["not_a_regular_file"].append(rel)
            elif not os.access(path, os.R_OK, effective_ids=os.access in os.supports_effective_ids):
                scan.skipped["unreadable"].append(rel)
            else:
                scan.files.append(SourceFile(rel, entry.stat(follow_symlinks=False).st_size))
    scan.files.sort(key=lambda f: f.rel)
    for paths in scan.skipped.values():
        paths.sort()
    return scan


def _tie_key(seed: int, rel: str) -> str:
    return hashlib.sha256(f"{seed}:{rel}".encode("utf-8", "surrogateescape")).hexdigest()  # a name's own bytes


def plan_splits(files: list[SourceFile], num_dirs: int, seed: int) -> list[int]:
    """Largest-first greedy: each file goes to the currently lightest split. Returns a split index per file."""
    order = sorted(range(len(files)), key=lambda i: (-files[i].size, _tie_key(seed, files[i].rel)))
    heap = [(0, 0, k) for k in range(num_dirs)]  # (bytes, files, split) so ties prefer fewer files, then index
    assignment = [0] * len(files)
    for i in order:
        load, count, k = heapq.heappop(heap)
        assignment[i] = k
        heapq.heappush(heap, (load + files[i].size, count + 1, k))
    return assignment


def split_name(k: int, num_dirs: int) -> str:
    return f"split_{k:0{max(2, len(str(num_dirs - 1)))}d}"


def _is_current(src: Path, dst: Path, mode: str, size: int, sha: str) -> bool:
    """Whether dst already holds what this run would place there (so a rerun writes nothing)."""
    if mode == "symlink":
        return dst.is_symlink() and os.readlink(dst) == str(src.resolve())
    if dst.is_symlink() or not dst.is_file():
        return False
    if mode == "hardlink" and os.path.samefile(src, dst):
        return True
    return dst.stat().st_size == size and sha256_file(dst) == sha


def _place(src: Path, dst: Path, mode: str) -> str:
    """Write dst atomically (temporary name, then rename) so an interrupted run never leaves a partial file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        with naming(dst):
            used = _place_as(src, tmp, mode)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dst)
    return used


def _place_as(src: Path, tmp: Path, mode: str) -> str:
    used = mode
    if mode == "symlink":
        os.symlink(src.resolve(), tmp)
    elif mode == "hardlink":
        try:
            os.link(src, tmp)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copy2(src, tmp)
            used = "copy"
    else:
        shutil.copy2(src, tmp)
    return used


def _read_rows(path: Path) -> list[dict]:
    """The rows of a manifest or journal; a journal's last line may be cut short by a kill, and is then not a row."""
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("destination"), str) and _inside(r)]


def _inside(row: dict) -> bool:
    """Whether a row's destination is a path inside dst_root: a damaged row must not delete anything outside it."""
    parts = PurePosixPath(row["destination"]).parts
    return bool(parts) and parts[0] != "/" and ".." not in parts


def _remove_temporaries(dst_root: Path, rows: list[dict]) -> None:
    """The temporary files a killed run's _place left beside these destinations."""
    for row in rows:
        dst = dst_root / row["destination"]
        for tmp in dst.parent.glob(f".{glob.escape(dst.name)}.tmp-*") if dst.parent.is_dir() else ():
            tmp.unlink()


def _check_destination(dst_root: Path) -> None:
    check_target(dst_root, "splits", "--dst_root", "choose an empty or new folder so nothing of yours is mixed in or "
                 "overwritten")


def _remove_stale(dst_root: Path, old: list[dict], keep: set[str]) -> int:
    """Delete files an earlier run placed that this plan no longer wants (else a file could appear twice)."""
    removed = 0
    for row in old:
        if row["destination"] in keep:
            continue
        path = dst_root / row["destination"]
        if path.is_symlink() or path.is_file():
            path.unlink()
            removed += 1
        parent = path.parent
        while parent != dst_root and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    return removed


def _write_manifest(dst_root: Path, rows: list[dict]) -> None:
    write_text_atomic(dst_root / MANIFEST, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


@dataclass
class OrganizeResult:
    rows: list[dict]
    written: int
    unchanged: int
    removed: int
    copied_instead_of_linked: int
    skipped: dict[str, list[str]]
    split_bytes: list[int]


def organize(cfg: OrganizeConfig) -> OrganizeResult:
    """Plan and materialise the splits; returns what was done. Idempotent for unchanged inputs; a run killed part way
    is finished by the next. Another run writing the same --dst_root is refused in one line."""
    _check_destination(cfg.dst_root)
    scan = scan_source(cfg.src_dir)
    if not scan.files:
        raise UserError(f"--src_dir {cfg.src_dir} holds no readable regular files")
    if cfg.num_dirs > len(scan.files):  # an empty split is a folder of nothing: one per file at most
        cfg.asked_dirs, cfg.num_dirs = cfg.num_dirs, len(scan.files)
    cfg.dst_root.parent.mkdir(parents=True, exist_ok=True)
    with locked(beside(cfg.dst_root), "ORGANIZE_DATA.py") as holder:
        if holder:
            raise UserError(f"--dst_root {cfg.dst_root} is being written by {holder}; wait for it to end, or choose "
                            "another --dst_root")
        _check_destination(cfg.dst_root)  # again, now that no other run can write it
        return _organize_locked(cfg, scan)


def _organize_locked(cfg: OrganizeConfig, scan: Scan) -> OrganizeResult:
    assignment = plan_splits(scan.files, cfg.num_dirs, cfg.seed)
    mark(cfg.dst_root, "splits", "ORGANIZE_DATA.py")
    manifest = _read_rows(cfg.dst_root / MANIFEST)
    unfinished = _read_rows(cfg.dst_root / JOURNAL)
    _remove_temporaries(cfg.dst_root, unfinished)
    rows, written, unchanged, fallbacks = [], 0, 0, 0
    split_bytes = [0] * cfg.num_dirs
    # opening creates the journal (appending to a killed run's): the folder is marked ours before any file is placed
    with open(cfg.dst_root / JOURNAL, "a", encoding="utf-8") as journal:
        for f, k in zip(scan.files, assignment, strict=True):
            src = cfg.src_dir / f.rel
            sha = sha256_file(src)
            dest_rel = f"{split_name(k, cfg.num_dirs)}/{f.rel}"
            row = {"source": f.rel, "destination": dest_rel, "split": k, "bytes": f.size, "sha256": sha}
            dst = cfg.dst_root / dest_rel
            if _is_current(src, dst, cfg.mode, f.size, sha):
                unchanged += 1
            else:
                journal.write(json.dumps(row, sort_keys=True) + "\n")
                journal.flush()  # before the file exists; a kill loses no page cache, so no fsync per file
                if dst.is_symlink() or dst.exists():
                    dst.unlink()
                fallbacks += _place(src, dst, cfg.mode) != cfg.mode
                written += 1
            split_bytes[k] += f.size
            rows.append(row)
    removed = _remove_stale(cfg.dst_root, manifest + unfinished, {r["destination"] for r in rows})
    for k in range(cfg.num_dirs):
        (cfg.dst_root / split_name(k, cfg.num_dirs)).mkdir(exist_ok=True)
    rows.sort(key=lambda r: r["destination"])
    if rows != manifest:
        _write_manifest(cfg.dst_root, rows)
    (cfg.dst_root / JOURNAL).unlink()
    return OrganizeResult(rows, written, unchanged, removed, fallbacks, dict(scan.skipped), split_bytes)


def format_summary(cfg: OrganizeConfig, res: OrganizeResult) -> str:
    total = sum(res.split_bytes)
    lines = [
        f"organized {len(res.rows)} files ({total:,} bytes) from {cfg.src_dir} into {cfg.num_dirs} splits "
        f"under {cfg.dst_root} ({cfg.mode})",
        f"  written {res.written}, unchanged {res.unchanged}, stale removed {res.removed}",
        f"  split bytes: min {min(res.split_bytes):,}, max {max(res.split_bytes):,}",
        f"  manifest: {cfg.dst_root / MANIFEST}",
    ]
    if cfg.asked_dirs:
        lines.append(f"  --num_dirs {cfg.asked_dirs} is more than the {cfg.num_dirs} files: {cfg.num_dirs} splits, one "
                     "file each")
    if res.copied_instead_of_linked:
        lines.append(f"  {res.copied_instead_of_linked} files copied: hard links cannot cross filesystems")
    for reason, paths in sorted(res.skipped.items()):
        lines.append(f"  skipped {len(paths)} ({reason}): {', '.join(paths[:10])}{' ...' if len(paths) > 10 else ''}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description="Split a tree of raw text files into folders balanced by bytes.")
    p.add_argument("--src_dir", required=True, type=Path, help="raw files (never modified)")
    p.add_argument("--dst_root", default=Path("splits"), type=Path, help="output root (default: splits)")
    p.add_argument("--num_dirs", default=20, type=int, help="number of split folders (default: 20)")
    p.add_argument("--mode", default="copy", choices=MODES, help="how files are placed (default: copy)")
    p.add_argument("--seed", default=0, type=int, help="tie-break seed (default: 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = OrganizeConfig(args.src_dir, args.dst_root, args.num_dirs, args.mode, args.seed)
    print(format_summary(cfg, organize(cfg)))
    return 0
