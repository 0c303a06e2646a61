"""The datasets a run names: `-d DATASET`, or a mixture trained in given ratios, `-d mine:0.7,general:0.3` (YAML: a
list of {path, weight}). Parsed before anything heavy is imported (the launcher checks flags first); the blocks of a
mixture are pipeline/data/mixture.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

MAX_WEIGHT = 1e6
"""The largest weight: the weights' sum stays far from overflow, and shares from rounding to nothing."""
MIN_SHARE = 1e-6
"""The smallest share of the draws a source may have: below it no run of any length would draw it."""


@dataclass(frozen=True)
class Source:
    name: str
    """How logs and eval events call it (eval/loss/NAME): the last part of its path or hub id."""
    path: str
    """What load_text_dataset reads: a DATA-HF folder or a hub id."""
    weight: float
    """Its share of the training blocks, as given (the shares are the weights over their sum)."""


def _weight(text: str, item: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise UserError(f"--dataset-name {item!r}: the weight after the last ':' must be a number, got "
                        f"{text!r}") from None
    if not (0 < weight <= MAX_WEIGHT):
        raise UserError(f"--dataset-name {item!r}: a weight must be a number in (0, {MAX_WEIGHT:g}], got {text}")
    return weight


def parse_sources(value: str) -> list[Source]:
    """The datasets -d names: one path or hub id (weight 1), or a mixture NAME:WEIGHT,NAME:WEIGHT. One line for a
    weight missing or not positive, an empty item, or a source named twice."""
    items = [item.strip() for item in value.split(",")]
    if len(items) == 1 and not _has_weight(items[0]):
        return [Source(_name(items[0]), items[0], 1.0)]
    sources = []
    for item in items:
        if not item:
            raise UserError(f"--dataset-name {value!r} has an empty item; write NAME:WEIGHT,NAME:WEIGHT")
        path, sep, weight = item.rpartition(":")
        if not sep or not path:
            raise UserError(f"--dataset-name {item!r} has no weight; a mixture names each dataset with one, "
                            "as NAME:WEIGHT,NAME:WEIGHT")
        sources.append(Source(_name(path), path, _weight(weight, item)))
    total = sum(s.weight for s in sources)
    for s in sources:
        if s.weight / total < MIN_SHARE:
            raise UserError(f"--dataset-name {s.path}:{s.weight!r} is {s.weight / total:.2g} of the draws, which no "
                            f"run would draw; each source needs at least {MIN_SHARE:g} of the weights' sum")
    seen: dict[str, str] = {}
    for s in sources:
        if s.name in seen:
            twice = "named twice" if seen[s.name] == s.path else f"and {seen[s.name]} share the name {s.name!r}"
            raise UserError(f"--dataset-name: {s.path} {twice}; a mixture names each dataset once (its eval loss is "
                            "eval/loss/NAME by the folder's name)")
        seen[s.name] = s.path
    return sources


def _has_weight(item: str) -> bool:
    """Whether an item ends in :NUMBER (a weight), not a path that holds a colon."""
    path, sep, tail = item.rpartition(":")
    try:
        float(tail)
    except ValueError:
        return False
    return bool(sep and path)


def _name(path: str) -> str:
    return Path(path.rstrip("/")).name or path


def joined(entries: list) -> str:
    """A YAML list of {path, weight} as the flag's text."""
    items = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "weight"}:
            raise UserError(f"dataset_name: each entry of a mixture is a mapping of path and weight, got {entry!r:.80}")
        items.append(f"{entry['path']}:{entry['weight']}")
    return ",".join(items)
