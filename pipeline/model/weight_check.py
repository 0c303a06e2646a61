"""Weight files checked by content, not only by their headers: flipped bytes in a tensor pass every shape check and
train silently wrong.

In the hub cache a weight file is a blob named by its SHA-256, so the name is the reference. A model folder outside
the cache has none: its first check records each file's hash, and later checks compare with that. Each file is read
once: content_hash's stamps let a file whose size and time are unchanged skip the read.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.content_hash import HashRecord
from pipeline.errors import UserError
from pipeline.model.weight_files import weight_files

BLOB_NAME = re.compile(r"[0-9a-f]{64}")
RECORD = "verified.json"
"""The record of a hub repository's blobs, in its cache folder beside blobs/ (one for every snapshot)."""
FOLDER_RECORD = ".verified.json"
"""The record of a model folder outside the cache, inside it."""


@dataclass(frozen=True)
class Damage:
    file: Path
    found: str
    """Its SHA-256 now; "" when the file is missing."""
    expected: str
    hub: bool
    """The reference is the hub's (the blob's name); else the folder's previous check."""


@dataclass
class WeightCheck:
    files: int = 0
    read: int = 0
    """Files hashed now (the others' stamps vouched for them)."""
    read_bytes: int = 0
    seconds: float = 0.0
    damaged: list[Damage] = field(default_factory=list)
    changed: list[Path] = field(default_factory=list)
    """A folder's files whose new content was accepted as the reference (accept=True)."""
    record: Path | None = None
    kept: bool = True
    """Whether the record could be written (a read-only folder is hashed again at every check)."""
    digests: dict[str, str] = field(default_factory=dict)
    """Each sound weight file's SHA-256, by its name in the model folder: what the weights are, whoever checks."""


def hub_digest(file: Path) -> str | None:
    """The hub's SHA-256 of a file in the cache (its blob's name), or None outside the cache."""
    real = file.resolve()
    return real.name if real.parent.name == "blobs" and BLOB_NAME.fullmatch(real.name) else None


def record_path(model_dir: Path) -> Path:
    if model_dir.parent.name == "snapshots":
        return model_dir.parent.parent / RECORD
    return model_dir / FOLDER_RECORD


def check_weights(model_dir: Path, *, again: bool = False, accept: bool = False) -> WeightCheck:
    """Hash the weight files that need it and compare them with their reference. again: read every file, stamps or
    not (bit rot leaves size and time alone). accept: a folder's changed file becomes its new reference instead of
    damage (a hub blob's reference never changes)."""
    record = HashRecord(record_path(model_dir))
    check = WeightCheck(record=record.path)
    started = time.perf_counter()
    for file in weight_files(model_dir):
        check.files += 1
        hub = hub_digest(file)
        if not file.exists():  # a cache link whose blob was removed (a repair that could not fetch it again)
            check.damaged.append(Damage(file, "", hub or "", hub is not None))
            continue
        # a cache blob by its name (one record for every snapshot; a snapshot's file names may hold other content)
        key = hub or (file.resolve().name if record.path.name == RECORD else file.name)
        trusted = None if again else record.trusted(key, file)
        if trusted is not None and (hub is None or trusted.sha256 == hub):
            check.digests[file.name] = trusted.sha256
            continue
        stamp = record.read(file)
        check.read += 1
        check.read_bytes += stamp.size
        before = record.stamps.get(key)
        expected = hub or (before.sha256 if before is not None else stamp.sha256)
        if stamp.sha256 != expected and not (accept and hub is None):
            check.damaged.append(Damage(file, stamp.sha256, expected, hub is not None))
            continue
        if stamp.sha256 != expected:
            check.changed.append(file)
        record.keep(key, stamp)
        check.digests[file.name] = stamp.sha256
    check.seconds = time.perf_counter() - started
    check.kept = record.save()
    return check


def damaged(damage: Damage) -> str:
    """What is wrong with a weight file."""
    if not damage.found:
        return (f"weight file {damage.file} is missing (its blob {damage.expected[:16]}... is not in the cache)"
                if damage.hub else f"weight file {damage.file} is missing (a link to nothing)")
    if damage.hub:
        return (f"weight file {damage.file} is damaged: its SHA-256 is {damage.found[:16]}..., the hub's is "
                f"{damage.expected[:16]}...")
    return (f"weight file {damage.file} changed since it was checked (SHA-256 {damage.expected[:16]}... then, "
            f"{damage.found[:16]}... now)")


def damage_line(damage: Damage, model_name: str) -> str:
    """One line saying what is wrong with a weight file and the command that repairs it."""
    if damage.hub:
        return (f"{damaged(damage)}; repair it with python MODEL_DOWNLOAD.py --model-name {model_name} (add --source "
                "DIR to import it again from a copy)")
    return (f"{damaged(damage)}; restore it, or if you changed it on purpose accept it with python MODEL_DOWNLOAD.py "
            f"--model-name {damage.file.parent}")


def unchanged_weights(model_dir: Path, model_name: str) -> WeightCheck:
    """check_weights for a run that is about to read them: damaged or changed weights are one line (UserError)."""
    check = check_weights(model_dir)
    if check.damaged:
        raise UserError(damage_line(check.damaged[0], model_name))
    return check


def read_line(check: WeightCheck) -> str:
    """What a check read, and what the next one costs."""
    kept = (f"recorded in {check.record}, so unchanged files are not read again" if check.kept else
            f"{check.record} cannot be written, so every start reads them again")
    return (f"checked {check.read} of {check.files} weight files by content ({check.read_bytes / 2**30:.2f} GiB in "
            f"{check.seconds:.1f} s); {kept}")


def weights_digest(check: WeightCheck) -> str:
    """One hash of every weight file's content, by file name: which weights a folder holds, wherever it is (a hub
    snapshot, a copy, a folder replaced by another model of the same config and tokenizer)."""
    lines = "".join(f"{name}:{sha}\n" for name, sha in sorted(check.digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()[:32]


def check_same_base(model_dir: Path, model_name: str, expected: str, what: str, trained_on: str = "") -> None:
    """The weights at model_dir (model_name's) are sound and are the ones `what` (an adapter, a run) was trained on
    (trained_on, the base's name it records; default model_name): one line naming both otherwise."""
    trained_on = trained_on or model_name
    found = weights_digest(unchanged_weights(model_dir, model_name))
    if found != expected:
        now = (f"the weights now at {model_dir} are" if model_name == trained_on else
               f"{model_name}'s weights, at {model_dir}, are")
        raise UserError(f"{what} was trained on base model {trained_on} with weights {expected[:16]}..., but {now} "
                        f"{found[:16]}... (another model, or changed ones): point it at the base it was trained on, "
                        "or train again on this one")
