"""A mixture's blocks as one: each source keeps its own token cache (built as a lone dataset's would be, with the
run's one BlockSpec, so the blocks of all sources have the same shape and flags); the run reads them through
MixedBlocks, one index space in which source k's blocks follow source k-1's, and pipeline/data/sampler.py's
MixtureSampler draws them in proportion to the weights (pipeline/data/sources.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.data.batches import Part
from pipeline.data.sources import Source


class Stacked:
    """Read-only rows of several arrays (memory-mapped blocks) as one: row i of source k is row i - offsets[k].
    Indexing with an array of rows gathers them, source by source, into one new array."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.offsets = np.cumsum([0, *map(len, arrays)])
        self.shape = (int(self.offsets[-1]), *arrays[0].shape[1:])
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        rows = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx)
        out = np.empty((len(rows), *self.shape[1:]), dtype=self.dtype)
        source = np.searchsorted(self.offsets, rows, side="right") - 1
        for k in np.unique(source):
            pick = source == k
            out[pick] = self.arrays[k][rows[pick] - self.offsets[k]]
        return out


@dataclass
class MixedBlocks:
    """The blocks of a mixture, as the trainer reads a lone cache's (Blocks): train and val over every source in
    source order; val_parts apart, for each source's validation loss."""

    sources: list[Source]
    caches: list
    """Each source's Blocks (pipeline/data/token_cache.py), in source order."""

    def __post_init__(self) -> None:
        self.train = Stacked([b.train for b in self.caches])
        self.val = Stacked([b.val for b in self.caches])
        flagged = self.caches[0].train_flags is not None
        self.train_flags = Stacked([b.train_flags for b in self.caches]) if flagged else None
        self.val_flags = Stacked([b.val_flags for b in self.caches]) if flagged else None

    @property
    def sizes(self) -> list[int]:
        """Training blocks of each source."""
        return [len(b.train) for b in self.caches]

    def part(self, split: str) -> Part:
        if split == "train":
            return Part(self.train, self.train_flags)
        return Part(self.val, self.val_flags)

    def val_parts(self) -> list[tuple[str, Part]]:
        """Each source's validation split, by name."""
        return [(s.name, b.part("val")) for s, b in zip(self.sources, self.caches, strict=True)]
