"""--reward entries: parsed (FILE.py:FUNCTION[:WEIGHT], a built-in NAME[:WEIGHT], a reward model's folder or Hub
id) and loaded, each with the identity the run's fingerprint holds (its file's content hash and its helpers')."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.rl import user_code
from pipeline.rl.builtin_rewards import BUILT_IN, RewardFn
from pipeline.rl.reward_model import RewardModelFn, is_model_folder, model_name


@dataclass(frozen=True)
class RewardSpec:
    """One --reward entry."""

    name: str
    """The function's name: TRL's rewards/NAME metrics."""
    weight: float
    path: str = ""
    """The Python file, "" for a built-in."""
    model: str = ""
    """A reward model's folder or Hub id (pipeline/rl/reward_model.py), "" for a function."""

    def identity(self, digest: str) -> str:
        if self.model:
            return f"model {self.model}:{self.weight!r}:{digest}"
        return f"{self.path or 'built-in'}:{self.name}:{self.weight!r}:{digest}"


FILE_ENTRY = re.compile(r"(?P<path>.+?\.py):(?P<name>[A-Za-z_]\w*)(?::(?P<weight>[^:,]*))?")
"""FILE.py:FUNCTION[:WEIGHT]; the path taken as short as the rest allows, so a path may hold ':' (and ',')."""
NAMED_ENTRY = re.compile(r"(?P<name>[^:]+)(?::(?P<weight>[^:,]*))?")
"""A built-in NAME[:WEIGHT] or a reward model's FOLDER[:WEIGHT]."""


def parse_rewards(text: str) -> list[RewardSpec]:
    """The --reward list: FILE.py:FUNCTION[:WEIGHT], NAME[:WEIGHT] (a built-in) or MODEL_FOLDER[:WEIGHT] (a reward
    model), comma-separated (a comma inside a path is part of it where the entry only reads whole with it); one line
    for an entry that is none of them, a weight that is not a finite number, or a name given twice."""
    specs = [_spec(entry) for entry in _entries(text)]
    names = [s.name for s in specs]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"--reward names {twice[0]} twice; each reward's metrics are named by its function, so give "
                        "each once (with a weight: NAME:2)")
    return specs


def _entries(text: str) -> list[str]:
    """The comma-separated entries; pieces join across a comma only where the joined text names something that
    exists (a file, FILE.py:FUNCTION[:WEIGHT], or a model folder), the longest such join first: a path may hold ','."""
    pieces = [p.strip() for p in text.split(",")]
    out, i = [], 0
    while i < len(pieces):
        joins = [j for j in range(len(pieces), i + 1, -1) if _exists(",".join(pieces[i:j]))]
        j = joins[0] if joins else i + 1
        if entry := ",".join(pieces[i:j]).strip():
            out.append(entry)
        i = j
    return out


def _exists(entry: str) -> bool:
    if found := FILE_ENTRY.fullmatch(entry):
        return Path(found["path"]).is_file()
    plain = NAMED_ENTRY.fullmatch(entry)
    return bool(plain) and (Path(plain["name"]) / "config.json").is_file()


def _spec(entry: str) -> RewardSpec:
    if found := FILE_ENTRY.fullmatch(entry):
        return RewardSpec(found["name"], _weight(entry, found["weight"]), found["path"])
    plain = NAMED_ENTRY.fullmatch(entry)
    if plain and plain["name"] in BUILT_IN:
        return RewardSpec(plain["name"], _weight(entry, plain["weight"]))
    if plain and is_model_folder(plain["name"]):
        return RewardSpec(model_name(plain["name"]), _weight(entry, plain["weight"]), model=plain["name"])
    raise UserError(f"--reward {entry} is neither FILE.py:FUNCTION[:WEIGHT], a built-in reward "
                    f"({', '.join(BUILT_IN)}) nor a reward model folder, each with an optional :WEIGHT")


def _weight(entry: str, text: str | None) -> float:
    if text is None:
        return 1.0
    try:
        weight = float(text)
    except ValueError:
        raise UserError(f"--reward {entry}: its weight {text!r} is not a number (FILE.py:FUNCTION:WEIGHT, e.g. "
                        ":0.5)") from None
    if not math.isfinite(weight) or abs(weight) > 1e6:
        raise UserError(f"--reward {entry}: the weight must be a finite number within +-1e6, got {text}")
    return weight


def load(spec: RewardSpec, chat_date: str) -> tuple[RewardFn, str]:
    """The function and the SHA-256 of its file and of the modules its import brought in from its own folder (the
    built-ins: their name; a reward model: its weights' digest), loaded as a module of its own."""
    if spec.model:
        fn = RewardModelFn(spec.model, chat_date)
        return fn, fn.digest
    if not spec.path:
        return BUILT_IN[spec.name], "built-in"
    module, digest = user_code.load_file(Path(spec.path), f"--reward {spec.path}")
    fn = getattr(module, spec.name, None)
    if not callable(fn):
        raise UserError(f"--reward {spec.path}:{spec.name}: the file defines no function {spec.name}")
    return fn, digest


def named(spec: RewardSpec) -> str:
    """How messages name a reward: FILE:FUNCTION, or its name."""
    return f"{spec.path}:{spec.name}" if spec.path else spec.name
