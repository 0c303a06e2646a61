"""datasets.map as the token cache runs it: its Arrow output in the build's work folder, its workers only where they
pay, its progress bars on a terminal only, and a list column read back as one array per row."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def map_kwargs(work: Path, name: str, num_proc: int, rows: int) -> dict:
    """datasets.map arguments: workers only when each gets a batch or more of rows; its Arrow output in our work
    folder (by default datasets writes beside the dataset's own files)."""
    return {"batched": True, "batch_size": 1000, "num_proc": num_proc if num_proc > 1 and rows > 1000 else None,
            "cache_file_name": str(work / f"{name}.arrow"), "load_from_cache_file": False}


@contextlib.contextmanager
def datasets_bars(shown: bool) -> Iterator[None]:
    """datasets' progress bars shown or not within the block (a bar is for a terminal, and one per build)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    if not shown:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def ragged(ds, name: str, dtype) -> list[np.ndarray]:
    """A list column as one array per row (views of one flat copy, no per-row Python conversion)."""
    column = ds.data.column(name).combine_chunks()
    offsets = np.asarray(column.offsets.to_numpy())
    flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return np.split(flat, offsets[1:-1] - offsets[0]) if len(column) else []
