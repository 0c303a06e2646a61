"""The token cache: a dataset tokenized, packed into fixed-length blocks and split, on disk, shared by every run.

Text rows are tokenized without special tokens (a special token's text in a row stays text), each followed by EOS,
concatenated and cut into seq_length-token blocks (the tail shorter than a block is dropped). Conversation rows are
rendered with the chat template, masked and packed whole (pipeline/data/chat_blocks.py) after the text blocks.
Blocks are split into train and validation by a seeded permutation and saved as .npy files under a key of
everything that defines them (`token_cache_dir`), so every later run reuses them memory-mapped.

Building is made for corpora of tens of GB:
- Text is tokenized in chunks of about CHUNK_BYTES with datasets.map(num_proc); each chunk's ids are saved as
  OUT.partial/chunk-NNNNN.npy once complete, so a killed build resumes from its finished chunks.
- The tokenizer is given bounded pieces of a row (pipeline/data/text_tokens.py), and freed memory is handed back
  after each call, so a worker's memory does not follow the longest row or the corpus.
- The chunks then stream into memory-mapped train/val files in order, so memory holds a chunk, not the corpus.
  Conversations are still packed in memory (best-fit decreasing needs every length; their corpora are smaller).
- One builder at a time: an flock on the token_cache folder (held by a `--prepare-only` job, the first rank of a
  node, or a node sharing the file system). Every other process polls for OUT/meta.json or OUT.error: no collective
  is in flight while it waits, so no collective timeout fires however long the build takes.
- A stop asked for (ensure_token_cache's `stopping`: fsdp1.py's signal handler) ends the build before its next chunk
  and ends a wait at its next poll (BuildStopped), keeping the chunks done: a scheduler's grace period is minutes,
  a build of tens of GB is longer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data import packing, pair_tokens
from pipeline.data.batches import Part
from pipeline.data.chat_blocks import chat_blocks, pair_blocks
from pipeline.data.dataset import BlockSpec, conversation_rows, tokenizer_fingerprint
from pipeline.data.mapped import datasets_bars, map_kwargs
from pipeline.data.text_tokens import release_freed_memory, tokenize_rows
from pipeline.errors import UserError, disk_problem, naming
from pipeline.fsutil import allocate, save_npy_atomic, write_text_atomic
from pipeline.ownership import mark

log = logging.getLogger(__name__)

CACHE_FORMAT = 5
"""3: special-token texts inside the data stay text (BlockSpec.special_tokens_in_data). 4: conversations with tool
calls and reasoning traces, and templates that rewrite earlier turns trained turn by turn (such conversations were
dropped or trained without their traces before). 5: a preference pair whose prompt truncation would cut below
pair_tokens.MIN_PROMPT is dropped (it was trained with a prompt of one token), and the tokens cut are counted."""
CHUNK_BYTES = 64 * 2**20
"""Text per tokenized chunk: the unit a killed build resumes from, and (times a few) the build's working memory."""
COPY_BLOCKS = 4096
"""Blocks copied into the train/val files at a time."""


@dataclass
class Blocks:
    train: np.ndarray
    """(n_train, seq_length) token ids, memory-mapped."""
    val: np.ndarray
    """(n_val, seq_length) token ids, memory-mapped."""
    path: Path
    """The cache directory they were read from."""
    train_flags: np.ndarray | None = None
    """(n_train, seq_length) packing.TRAIN | packing.START per token; None for plain text blocks."""
    val_flags: np.ndarray | None = None
    train_ref: np.ndarray | None = None
    """(n_train, pairs, 2) a reference's log-probabilities of each block's pairs, where the objective has them
    (pipeline/objectives/reference_pass.py)."""
    val_ref: np.ndarray | None = None

    def part(self, split: str) -> Part:
        """The train or val split, with its flags and reference values."""
        if split == "train":
            return Part(self.train, self.train_flags, self.train_ref)
        return Part(self.val, self.val_flags, self.val_ref)

    def val_parts(self) -> list[tuple[str, Part]]:
        """The validation split as one unnamed part (a mixture's MixedBlocks has one per source)."""
        return [("", self.part("val"))]


def token_cache_dir(cache_root: Path, dataset_fp: str, model_dir: Path, spec: BlockSpec) -> Path:
    """Where the packed blocks of this dataset, tokenizer and cut live under cache_root: shared by every run that
    uses the same root (by default SAVE_DIR/token_cache)."""
    key = {"format": CACHE_FORMAT, "dataset": dataset_fp, "tokenizer": tokenizer_fingerprint(model_dir),
           **spec.key()}
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_root) / fp[:24]


def open_blocks(path: Path) -> Blocks:
    def load(name: str) -> np.ndarray | None:
        return np.load(path / name, mmap_mode="r") if (path / name).exists() else None

    return Blocks(load("train.npy"), load("val.npy"), path, load("train_flags.npy"), load("val_flags.npy"))


def beyond_vocabulary(blocks: Blocks, vocab: int, part: int, parts: int) -> str:
    """The first token id in part `part` of `parts` of the blocks (train, then val; contiguous rows) that the model
    has no embedding row for, as one line ("" when none). Such an id is not an error anywhere downstream: the
    vocabulary-parallel head finds its row on no rank and embeds it as zeros, so a run trains at ln(vocab) with a
    zero gradient and exits 0. A scan of the memory-mapped blocks, COPY_BLOCKS rows at a time."""
    for name, ids in (("train", blocks.train), ("val", blocks.val)):
        if ids is None:
            continue
        lo, hi = len(ids) * part // parts, len(ids) * (part + 1) // parts
        for start in range(lo, hi, COPY_BLOCKS):
            rows = np.asarray(ids[start:min(start + COPY_BLOCKS, hi)])
            if rows.size and int(rows.max()) >= vocab:
                row = start + int(np.flatnonzero(rows.max(axis=1) >= vocab)[0])
                return (f"the token cache {blocks.path} holds token id {int(ids[row].max())} (in {name} block {row}) "
                        f"but the model has {vocab} embedding rows: the cache is damaged or was built with another "
                        f"tokenizer; delete {blocks.path} to rebuild it")
    return ""


def split_blocks(n_blocks: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, val) block indices from a seeded permutation; one val block at least when n >= 2."""
    n_val = round(n_blocks * val_fraction)
    if val_fraction > 0 and n_blocks >= 2:
        n_val = max(1, n_val)
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


# --- waiting for, or taking the turn to build, a cache -------------------------------------------------------------

class BuildStopped(Exception):
    """`stopping` said so: the build ended before its next chunk (the chunks done are kept), or the wait for another
    process's build ended. The text says which."""


def never() -> bool:
    return False


def error_file(path: Path) -> Path:
    return path.with_name(f"{path.name}.error")


def ensure_token_cache(ds, tokenizer, spec: BlockSpec, num_proc: int, path: Path, builder: bool,
                       poll_s: float = 0.2, stopping: Callable[[], bool] = never) -> str:
    """The cache at path, built if missing: "hit", "built" or "waited". The builder (one process per node) takes the
    lock and builds; any other process polls until the cache or the builder's error appears. No collective.
    stopping() true ends the build between chunks, or the wait, with BuildStopped."""
    if (path / "meta.json").exists():
        return "hit"
    if not builder:
        _wait_for(path, time.time(), poll_s, stopping)
        return "waited"
    with build_lock(path, poll_s, stopping):
        mark(path.parent, "token_cache", "fsdp1.py")
        if (path / "meta.json").exists():  # built by whoever held the lock before us
            shutil.rmtree(path.with_name(f"{path.name}.partial"), ignore_errors=True)
            return "hit"
        error_file(path).unlink(missing_ok=True)
        log.info("building token cache %s", path)
        try:
            build_blocks(ds, tokenizer, spec, num_proc, path, stopping)
        except BuildStopped:
            # no error file: this run's waiting ranks get their own signal, and another run waiting for the cache
            # takes the lock and resumes the build from its chunks
            raise
        except FileNotFoundError as exc:
            if not Path(exc.filename or "").absolute().is_relative_to(path.parent.absolute()):
                raise
            # a file of ours was deleted under the build (the cache folder removed): nothing of the user's is lost,
            # and a rerun builds the cache again
            gone = UserError(f"{exc.filename} was removed while the token cache {path} was being built (was the "
                             f"folder {path.parent} deleted?); rerun the same command to build it again")
            _report_failure(path, str(gone))
            raise gone from exc
        except BaseException as exc:
            _report_failure(path, str(exc) if isinstance(exc, UserError) else disk_problem(exc) or
                            f"the token cache build on {socket.gethostname()} failed: {type(exc).__name__}: {exc}")
            raise
    return "built"


def _report_failure(path: Path, text: str) -> None:
    """The builder's failure, for the processes waiting on it. A full disk may refuse even this note; the waiting
    ranks then learn of the failure from their peer watch."""
    with contextlib.suppress(OSError):
        error_file(path).write_text(text + "\n")


def _wait_for(path: Path, since: float, poll_s: float, stopping: Callable[[], bool]) -> None:
    """Poll for the cache or for an error the builder wrote after we started waiting (an older one is stale)."""
    err = error_file(path)
    while not (path / "meta.json").exists():
        if stopping():
            raise BuildStopped(f"while waiting for the token cache {path}")
        with contextlib.suppress(FileNotFoundError):
            if err.stat().st_mtime >= since - 1:
                raise UserError(err.read_text().strip())
        time.sleep(poll_s)


@contextlib.contextmanager
def build_lock(path: Path, poll_s: float = 0.2, stopping: Callable[[], bool] = never) -> Iterator[None]:
    """An exclusive flock on the token_cache folder (no lock file left behind; builds of different caches in one
    save_dir take turns). The kernel releases it if the holder dies, so a killed build never blocks the next. A file
    system without flock builds unlocked: two builders then race to one identical rename. Taken by polling, not a
    blocking flock: a signal's handler returns and the kernel call would resume, so only a poll can ask stopping()."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another process is building the token cache %s; waiting for it", path.parent)
                _poll_lock(fd, path, poll_s, stopping)
        except OSError as exc:
            log.warning("cannot lock %s (%s); building without a lock", path.parent, exc)
        yield
    finally:
        os.close(fd)


def _poll_lock(fd: int, path: Path, poll_s: float, stopping: Callable[[], bool]) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stopping():
                raise BuildStopped(f"while waiting for another process's build of the token cache {path}") from None
            time.sleep(poll_s)


# --- building ---------------------------------------------------------------------------------------------------------

def _rows_per_chunk(text_rows) -> int:
    """Rows per chunk, from the table's bytes per row (no text read): the same on every attempt, so a resumed build
    cuts the same chunks."""
    table = text_rows.data
    per_row = max(1, table.nbytes // max(1, len(table)))
    return max(1, CHUNK_BYTES // per_row)


def _tokenized_chunks(text_rows, tokenizer, num_proc: int, work: Path, split_special: bool,
                      stopping: Callable[[], bool]) -> list[Path]:
    """Each chunk of text rows tokenized into work/chunk-NNNNN.npy (flat uint32 ids), skipping those a killed
    build already finished; stopping() is asked before each. A progress bar shows rows and throughput."""
    from tqdm import tqdm

    per_chunk = _rows_per_chunk(text_rows)
    plan = {"rows": len(text_rows), "rows_per_chunk": per_chunk}
    plan_file = work / "chunks.json"
    if not plan_file.exists() or json.loads(plan_file.read_text()) != plan:
        for stale in work.glob("chunk-*.npy"):
            stale.unlink()
        write_text_atomic(plan_file, json.dumps(plan) + "\n")
    starts = range(0, len(text_rows), per_chunk)
    paths = [work / f"chunk-{i:05d}.npy" for i in range(len(starts))]
    done = sum(p.exists() for p in paths)
    if done:
        log.info("token cache: resuming, %d of %d chunks already tokenized", done, len(paths))
    with tqdm(total=len(text_rows), unit="row", unit_scale=True, desc="tokenizing", file=sys.stderr,
              disable=None) as bar:
        for start, path in zip(starts, paths, strict=True):
            stop = min(start + per_chunk, len(text_rows))
            if not path.exists():
                if stopping():
                    raise BuildStopped(f"after {sum(p.exists() for p in paths)} of {len(paths)} chunks (kept in "
                                       f"{work})")
                _tokenize_chunk(text_rows.select(range(start, stop)), tokenizer, num_proc, work, path, split_special)
                # what the chunk's map freed here (its jobs pickled, its results read) goes back to the OS: glibc
                # kept it, and every later chunk's workers, forked from this process, carried it (BENCHMARKS.md 14)
                release_freed_memory()
            bar.update(stop - start)
    return paths


def _tokenize_chunk(rows, tokenizer, num_proc: int, work: Path, out: Path, split_special: bool) -> None:

    for leftover in [*work.glob("*.arrow"), *work.glob("tmp*")]:  # a killed map's partial output
        leftover.unlink()
    # one bar for the whole build, not one per chunk; datasets' writer reports a full disk with no file name
    with datasets_bars(False), naming(work):
        tokenized = rows.map(tokenize_rows, remove_columns=rows.column_names,
                             fn_kwargs={"tokenizer": tokenizer, "eos_id": tokenizer.eos_token_id,
                                        "split_special": split_special},
                             **map_kwargs(work, "text", num_proc, len(rows)))
    column = tokenized.data.column("input_ids")
    flat = np.concatenate([c.flatten().to_numpy() for c in column.chunks]).astype(np.uint32, copy=False)
    save_npy_atomic(out, flat)
    del tokenized, column
    for arrow in work.glob("*.arrow"):
        arrow.unlink()


def _text_block_batches(chunks: list[Path], seq_length: int) -> Iterator[np.ndarray]:
    """The text blocks in order, a few thousand at a time, from the chunk files (memory-mapped); the tokens that do
    not fill a chunk's last block open the next chunk's first."""
    carry = np.zeros(0, np.uint32)
    for path in chunks:
        ids = np.load(path, mmap_mode="r")
        if len(carry):
            need = seq_length - len(carry)
            if len(ids) < need:
                carry = np.concatenate([carry, ids])
                continue
            yield np.concatenate([carry, ids[:need]]).reshape(1, seq_length)
            ids = ids[need:]
        n = len(ids) // seq_length * seq_length
        for at in range(0, n, COPY_BLOCKS * seq_length):
            yield ids[at: min(n, at + COPY_BLOCKS * seq_length)].reshape(-1, seq_length)
        carry = np.array(ids[n:])


class _SplitWriter:
    """Routes blocks, in block order, to memory-mapped train.npy/val.npy (and their flags) at the rows the seeded
    split gives them; the files are the same bytes np.save writes for the whole arrays."""

    def __init__(self, out: Path, n_blocks: int, spec: BlockSpec):
        train_idx, val_idx = split_blocks(n_blocks, spec.val_fraction, spec.seed)
        self.is_val = np.zeros(n_blocks, dtype=bool)
        self.is_val[val_idx] = True
        self.row = np.empty(n_blocks, dtype=np.int64)
        self.row[train_idx], self.row[val_idx] = np.arange(len(train_idx)), np.arange(len(val_idx))
        self.next = 0
        self.targets = 0

        def file(name: str, rows: int, dtype) -> np.ndarray:
            with naming(out / name):
                array = np.lib.format.open_memmap(out / name, mode="w+", dtype=dtype, shape=(rows, spec.seq_length))
            allocate(out / name)
            return array

        self.ids = {False: file("train.npy", len(train_idx), np.uint32), True: file("val.npy", len(val_idx), np.uint32)}
        self.flags = {False: file("train_flags.npy", len(train_idx), np.uint8),
                      True: file("val_flags.npy", len(val_idx), np.uint8)} if spec.flagged else None

    def add(self, blocks: np.ndarray, flags: np.ndarray | None) -> None:
        at = np.arange(self.next, self.next + len(blocks))
        self.next += len(blocks)
        for val in (False, True):
            pick = self.is_val[at] == val
            rows = self.row[at[pick]]
            self.ids[val][rows] = blocks[pick]
            if self.flags is not None:
                self.flags[val][rows] = flags[pick]
        if flags is not None:
            self.targets += int(packing.targets(flags).sum())

    def close(self) -> None:
        for files in (self.ids, self.flags or {}):
            for array in files.values():
                array.flush()


def _write_blocks(final: Path, out: Path, work: Path, spec: BlockSpec, blocks: np.ndarray, flags: np.ndarray,
                  statuses: dict, cut: int, rows: int) -> None:
    """Pair blocks split into final/ with their meta.json, then renamed to out."""
    writer = _SplitWriter(final, len(blocks), spec)
    writer.add(blocks, flags)
    writer.close()
    n_val = int(writer.is_val.sum())
    meta = {"pairs": statuses, "pairs_prompt_tokens_cut": cut, "pair_blocks": len(blocks),
            "pairs_kept": pair_tokens.count_pairs(flags),
            "targets": writer.targets, "blocks": len(blocks), "train_blocks": len(blocks) - n_val, "val_blocks": n_val,
            "seq_length": spec.seq_length, "rows": rows, "flags": True}
    if spec.kto:
        undesirable = int(((flags & packing.START) > 0)[(flags & pair_tokens.UNDESIRABLE) > 0].sum())
        meta["kto"] = {"desirable": meta["pairs_kept"] - undesirable, "undesirable": undesirable}
    (final / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _publish(final, out, work)


def build_blocks(ds, tokenizer, spec: BlockSpec, num_proc: int, out: Path,
                 stopping: Callable[[], bool] = never) -> None:
    """Tokenize, pack and split into out/ (assembled in OUT.partial/, then renamed into place). stopping() is asked
    before each text chunk and after the last (before the conversations, one datasets.map, and the block write)."""
    work = out.with_name(f"{out.name}.partial")
    work.mkdir(parents=True, exist_ok=True)
    final = work / "blocks"
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir()
    if spec.pairs:  # a dataset of pairs holds nothing else (DATA-HF refuses a mix)
        _write_blocks(final, out, work, spec, *pair_blocks(ds, tokenizer, spec, num_proc, work), len(ds))
        return
    chats = conversation_rows(ds)
    # a hub dataset may have messages and no text column: its rows without a conversation have nothing to train
    text_rows = ds.select(np.flatnonzero(~chats) if "text" in ds.column_names else [])
    chunks = (_tokenized_chunks(text_rows, tokenizer, num_proc, work, not spec.special_tokens_in_data, stopping)
              if len(text_rows) else [])
    if stopping():
        raise BuildStopped(f"after its {len(chunks)} text chunks (kept in {work})")
    n_tokens = sum(len(np.load(p, mmap_mode="r")) for p in chunks)
    n_text = n_tokens // spec.seq_length
    meta: dict = {"text_tokens": int(n_tokens), "text_blocks": n_text}
    chat_ids = chat_flags = None
    if chats.any():
        chat_ids, chat_flags, meta["conversations"], turn_by_turn = chat_blocks(ds.select(np.flatnonzero(chats)),
                                                                                 tokenizer, spec, num_proc, work)
        if turn_by_turn["conversations"]:
            meta["turn_by_turn"] = turn_by_turn
        meta["chat_blocks"] = len(chat_ids)
    n_blocks = n_text + (len(chat_ids) if chat_ids is not None else 0)
    writer = _SplitWriter(final, n_blocks, spec)
    for blocks in _text_block_batches(chunks, spec.seq_length):
        writer.add(blocks, packing.text_flags(blocks, tokenizer.eos_token_id, spec.document_mask)
                   if spec.flagged else None)
    if chat_ids is not None:
        writer.add(chat_ids, chat_flags)
    writer.close()
    if spec.flagged:
        meta["targets"] = writer.targets
    n_val = int(writer.is_val.sum())
    meta.update({"blocks": n_blocks, "train_blocks": n_blocks - n_val, "val_blocks": n_val,
                 "seq_length": spec.seq_length, "rows": len(ds), "flags": spec.flagged})
    (final / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _publish(final, out, work)


def _publish(final: Path, out: Path, work: Path) -> None:
    try:
        os.rename(final, out)
    except OSError:
        if not (out / "meta.json").exists():  # another node built it at the same time: theirs is identical
            raise
    shutil.rmtree(work, ignore_errors=True)
