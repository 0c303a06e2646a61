"""Which stage a folder belongs to, and the one rule every stage follows before it writes: a stage writes into, or
replaces, only a new or empty folder or one of its own kind, and no output sits inside an input, an input inside an
output, or an output inside a folder of another kind (a run inside a dataset, a dataset inside a run).

Each stage marks the folders it creates with OWNER_FILE, naming their kind. Folders written before the mark existed
are recognised by what those versions left in them (a dataset's prep_report.json beside its Arrow metadata, a run's
config.yaml beside its log or checkpoints), so they resume, and are marked at their next write.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from pipeline.errors import UserError
from pipeline.fsutil import write_text_atomic

OWNER_FILE = ".pipeline-kind.json"
"""Inside every folder a stage creates: {"kind": KIND, "by": the stage}."""
KINDS = {
    "splits": ("split folders", "ORGANIZE_DATA.py"),
    "dataset": ("a dataset", "DATA-HF.py"),
    "run": ("a training run", "fsdp1.py"),
    "token_cache": ("a token cache", "fsdp1.py"),
    "export": ("a model or adapter folder", "an export"),
}
"""Each kind: what a message calls it, and the stage that writes it."""
MAY_CONTAIN = {"run": ("export", "token_cache")}
"""The outputs that may sit inside a folder of another kind: a run's own exports (RUN/hf, RUN/adapter) and a token
cache a user keeps with the run."""
_CACHE_ENTRY = re.compile(r"[0-9a-f]{24}(\.partial|\.error)?")


def kind_of(folder: Path) -> str | None:
    """The kind of folder: its mark, else what an earlier version of a stage left in it; None for anything else (a
    user's folder, an empty one, one that does not exist)."""
    try:
        if not folder.is_dir():
            return None
        if (folder / OWNER_FILE).is_file():
            kind = read_mark(folder).get("kind")
            return kind if kind in KINDS else None
        return _earlier_kind(folder)
    except OSError:  # unreadable: not a kind we know
        return None


def _earlier_kind(folder: Path) -> str | None:
    """The kind of an unmarked folder from what the stages wrote before folders were marked."""
    names = set(os.listdir(folder))  # names only: this reads every ancestor of an output, /tmp's thousands too
    if {"prep_report.json", "state.json", "dataset_info.json"} <= names:
        return "dataset"
    if "config.yaml" in names and names & {"checkpoints", "metrics.jsonl", "train.log", "state.json"}:
        return "run"
    if {"manifest.jsonl", "manifest.partial.jsonl"} & names:
        return "splits"
    if names and all(_CACHE_ENTRY.fullmatch(n) for n in names):
        return "token_cache"
    if names & {"config.json", "adapter_config.json"} and any(n.endswith(".safetensors") for n in names) and \
            not any((folder / n).is_dir() for n in names):
        return "export"
    return None


def is_marked(folder: Path, kind: str) -> bool:
    """Whether folder carries the mark of kind (not only looks like one)."""
    return read_mark(folder).get("kind") == kind


def describe(kind: str | None) -> str:
    return KINDS[kind][0] if kind in KINDS else "a folder this pipeline did not write"


def is_empty(folder: Path) -> bool:
    return folder.is_dir() and not any(folder.iterdir())


def check_target(folder: Path, kind: str, flag: str, hint: str, earlier: Callable[[Path], bool] | None = None) -> None:
    """folder may be written as kind: it does not exist, is empty, carries kind's mark, or is an unmarked folder of
    that kind that earlier(folder) accepts (default: what kind_of infers). Else one line, naming what it is (or the
    first files in it that the stage did not write), ending with hint (what to do instead)."""
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file, not a folder; {hint}")
    if is_empty(folder):
        return
    found = kind_of(folder)
    if is_marked(folder, kind) or (found == kind and (earlier is None or earlier(folder))):
        return
    if found is not None and found != kind:
        raise UserError(f"{flag} {folder} is {describe(found)}, not {describe(kind)}; refusing to write into it: "
                        f"{hint}")
    raise UserError(f"{flag} {folder} holds files {KINDS[kind][1]} did not write ({_listed(folder.iterdir())}); "
                    f"refusing to write into it: {hint}")


def check_only(folder: Path, flag: str, allowed: Callable[[Path], bool], writer: str, hint: str) -> None:
    """Before folder is replaced whole: everything in it is what its writer writes (allowed), else one line naming
    the first others (a run folder a user put inside a dataset, a user's notes in an export)."""
    foreign = [p for p in folder.iterdir() if not allowed(p)] if folder.is_dir() else []
    if foreign:
        raise UserError(f"{flag} {folder} holds what {writer} does not write ({_listed(foreign)}); refusing to replace "
                        f"it: {hint}")


def _listed(entries: Iterable[Path]) -> str:
    """The first three names, sorted, folders with a trailing slash, and how many more."""
    shown = sorted(p.name + ("/" if p.is_dir() else "") for p in entries)
    return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")


def check_not_nested(folder: Path, kind: str, flag: str) -> None:
    """folder (an output of kind) is not inside a folder of another kind (a run inside a dataset would be deleted
    by the dataset's next --overwrite; a dataset inside a run, by nothing of ours, but read as the run's)."""
    for parent in folder.resolve().parents:
        found = kind_of(parent)
        if found is not None and kind not in MAY_CONTAIN.get(found, ()):
            raise UserError(f"{flag} {folder} is inside {parent}, {describe(found)}; put it in a folder of its own")


def check_apart(output: Path, output_flag: str, inputs: Iterable[tuple[Path, str]],
                why: str = "put the output outside it") -> None:
    """No input is the output, inside it, or holds it: an output inside its input is read back as input (why says
    so), an input inside its output is deleted or overwritten with it."""
    out = output.resolve()
    for path, flag in inputs:
        inp = path.resolve()
        if inp == out:
            raise UserError(f"{output_flag} {output} is {flag} {path}; the output would overwrite its own input")
        if inp in out.parents:
            raise UserError(f"{output_flag} {output} is inside {flag} {path}; {why}")
        if out in inp.parents:
            raise UserError(f"{flag} {path} is inside {output_flag} {output}; writing the output would overwrite "
                            "it: move it out first")


def mark(folder: Path, kind: str, by: str, **details: str) -> None:
    """Record folder (created if missing) as kind, written by `by`, with details (an export's: the base it was
    trained on, what it was trained on); a folder already marked is left as it is."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / OWNER_FILE).is_file():
        write_text_atomic(folder / OWNER_FILE, json.dumps({"kind": kind, "by": by, **details}) + "\n")


def read_mark(folder: Path) -> dict:
    """What a folder's mark says ({} without one, or an unreadable one)."""
    try:
        found = json.loads((folder / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
