"""Packing whole sequences (conversations) into fixed-length blocks: best-fit decreasing, never splitting one.

A block carries per-token flags next to its ids: TRAIN (the token is a target of the loss) and START (the token
begins a new sequence). From the flags the trainer derives labels, position ids that restart at 0 for each sequence,
and so, in the model, attention that never crosses sequences.
"""

from __future__ import annotations

import numpy as np

TRAIN = 1
START = 2


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's lengths summing to at most capacity (every length must be <= capacity).
    Longest first (ties in index order), each into the open bin with the least room that still fits it, else a new
    bin: deterministic. Open bins are bucketed by free room, and the smallest room >= n is the lowest set bit of a
    bit set of non-empty buckets, so each item costs a few big-integer operations, not a scan of the bins."""
    bins: list[list[int]] = []
    room: list[int] = []
    buckets: dict[int, list[int]] = {}
    nonempty = 0  # bit r set: some open bin has exactly r free tokens
    for i in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        n = int(lengths[i])
        above = nonempty >> n
        if above:
            r = n + (above & -above).bit_length() - 1
            b = buckets[r].pop()
            if not buckets[r]:
                nonempty &= ~(1 << r)
        else:
            b, r = len(bins), capacity
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] = r - n
        if room[b] > 0:
            buckets.setdefault(room[b], []).append(b)
            nonempty |= 1 << room[b]
    return bins


def pack(ids: list[np.ndarray], trained: list[np.ndarray], capacity: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks [n, capacity] uint32, flags [n, capacity] uint8) of the sequences packed best-fit decreasing; the
    room left in a block is padding: one more sequence, never trained."""
    bins = best_fit_decreasing(np.array([len(x) for x in ids], dtype=np.int64), capacity)
    blocks = np.full((len(bins), capacity), pad_id, dtype=np.uint32)
    flags = np.zeros((len(bins), capacity), dtype=np.uint8)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            n = len(ids[i])
            blocks[b, at:at + n] = ids[i]
            flags[b, at:at + n] = np.where(trained[i], TRAIN, 0)
            flags[b, at] |= START
            at += n
        if at < capacity:
            flags[b, at] = START
    return blocks, flags


def text_flags(blocks: np.ndarray, eos_id: int, document_mask: bool) -> np.ndarray:
    """Flags of text blocks (documents concatenated, each ending with EOS): every token trained and one sequence
    per block; with document_mask, a new sequence starts after each EOS and its first token is not a target (it
    would be predicted from another document)."""
    flags = np.full(blocks.shape, TRAIN, dtype=np.uint8)
    flags[:, 0] = START
    if document_mask:
        after_eos = np.zeros(blocks.shape, dtype=bool)
        after_eos[:, 1:] = blocks[:, :-1] == eos_id
        flags[after_eos] = START
    return flags


def positions(flags: np.ndarray) -> np.ndarray:
    """Position ids [batch, seq] restarting at 0 at every START."""
    idx = np.broadcast_to(np.arange(flags.shape[1]), flags.shape)
    starts = np.where(flags & START, idx, 0)
    return idx - np.maximum.accumulate(starts, axis=1)


def targets(flags: np.ndarray) -> np.ndarray:
    """How many tokens of each block are targets of the loss (its first token never is: nothing predicts it)."""
    return (flags[:, 1:] & TRAIN).astype(bool).sum(axis=1)
