"""DATA-HF: extract text from a folder of .txt/.md/.json/.jsonl/.yaml files into a Hugging Face Arrow dataset.

One bad file never stops the run: it is skipped and reported by reason, and every good file's text is kept.
The dataset is built in a hidden sibling folder and renamed into place, so an interrupted run leaves nothing at
--save_dir, and --overwrite replaces an existing dataset only once the new one is complete.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import re
import secrets
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow as pa
from tqdm import tqdm

from pipeline.data.dataset import DATA_RECORD
from pipeline.errors import ArgumentParser, UserError, naming
from pipeline.folder_lock import beside, locked
from pipeline.fsutil import left_by_a_dead_process, replace_dir, restore_replaced
from pipeline.ownership import OWNER_FILE, check_apart, check_not_nested, check_only, check_target, mark
from pipeline.prep.conversations import OPTIONAL, Chat
from pipeline.prep.extract import SUPPORTED, Limits, Row, SkipFile, extract_file, row_chars
from pipeline.prep.organize import MANIFEST
from pipeline.prep.preferences import Pair, files_holding
from pipeline.prep.prompts import Prompt, mixed_folder
from pipeline.prep.report import REPORT, by_reason, format_summary, kind_report

WRITE_CHARS = 8_000_000
"""A worker writes its buffered rows to its Arrow shard once they hold this many characters."""


@dataclass
class CorpusConfig:
    data_folder: Path
    """Folder to read recursively (typically ORGANIZE_DATA's --dst_root)."""
    save_dir: Path
    """Where the dataset is written, in save_to_disk's layout (load_from_disk reads it). Must not exist unless overwrite
    is set."""
    num_proc: int = os.cpu_count() or 1
    """Worker processes for extraction."""
    overwrite: bool = False
    """Replace an existing dataset at save_dir (only once the new one is complete)."""
    max_file_mb: float = 256
    """A .json or .yaml file (parsed whole) larger than this many MiB is skipped as too_large."""
    max_row_mb: float = 64
    """A row (a .jsonl line, a record's text, a conversation) longer than this many Mi characters is skipped as
    row_too_large."""

    def __post_init__(self) -> None:
        self.data_folder, self.save_dir = Path(self.data_folder), Path(self.save_dir)
        if self.num_proc < 1:
            raise UserError(f"--num_proc must be at least 1, got {self.num_proc}")
        for name in ("max_file_mb", "max_row_mb"):  # as bytes an int: inf or 1e308 would not convert
            if not 0 < getattr(self, name) <= 2**20:
                raise UserError(f"--{name} must be in (0, {2**20}] (a TiB), got {getattr(self, name)}")
        if not self.data_folder.is_dir():
            raise UserError(f"--data_folder {self.data_folder} does not exist or is not a directory")
        check_apart(self.save_dir, "--save_dir", [(self.data_folder, "--data_folder")],
                    "a later run would read the dataset back as input")
        check_not_nested(self.save_dir, "dataset", "--save_dir")
        self.check_target()

    @property
    def limits(self) -> Limits:
        return Limits(int(self.max_file_mb * 2**20), int(self.max_row_mb * 2**20))

    def check_target(self) -> None:
        """What is at save_dir now may be replaced: nothing, or a dataset DATA-HF wrote, with --overwrite."""
        check_target(self.save_dir, "dataset", "--save_dir", "choose a new --save_dir")
        if os.path.ismount(self.save_dir):  # replacing it renames over it, which a mount point refuses (EBUSY)
            raise UserError(f"--save_dir {self.save_dir} is a mount point, which cannot be replaced as a whole: write "
                            f"the dataset to a folder inside it (e.g. {self.save_dir / 'dataset'})")
        if self.save_dir.exists() and not self.overwrite:
            raise UserError(f"--save_dir {self.save_dir} already exists; pass --overwrite to replace it")
        check_only(self.save_dir, "--save_dir", _dataset_file, "DATA-HF.py", "move those out first, or choose a new "
                   "--save_dir")


_DATASET_FILE = re.compile(r"data-\d{5}-of-\d{5}\.arrow|cache-.*\.arrow")
"""The Arrow files of a DATA-HF dataset, and those datasets' map() leaves beside a dataset it was loaded from."""


def _dataset_file(path: Path) -> bool:
    """What DATA-HF (and datasets, for a dataset it wrote) puts in a dataset folder."""
    return path.is_file() and (path.name in {"state.json", "dataset_info.json", REPORT, DATA_RECORD, OWNER_FILE}
                               or _DATASET_FILE.fullmatch(path.name) is not None)


# ----------------------------------------------------------------------------------------------- extraction


MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string"),
                          **{key: datasets.Value("string") for key in OPTIONAL}})
FEATURES = datasets.Features({
    "text": datasets.Value("string"),
    "messages": MESSAGES,
    "source": datasets.Value("string"),
    "chosen": MESSAGES,
    "rejected": MESSAGES,
    "tools": datasets.Value("string"),
    "columns": datasets.Value("string"),
})
"""A text row has messages []; a conversation row has text "" (one dataset holds both, so a corpus of documents and
chats trains in one run, each row in its own way) and its tool schemas in tools ("" for none). A message's optional
fields (conversations.OPTIONAL) are null where it has none; datasets written before they existed have role and
content alone and still read. A preference row has its chosen and rejected answers (each a list of assistant
messages), and its prompt in messages (conversational) or in text (standard); an unpaired (KTO) row has one of them,
chosen when labelled desirable, rejected when not; the other rows have them empty. A prompt row (for online RL) has
its prompt in text or messages and the record's other keys as a JSON object in columns, "" in every other row (and
no such column in datasets written before it existed). A dataset holds preference rows alone, or prompt rows alone
(DATA-HF refuses a folder that mixes them with others)."""


@dataclass
class ChunkResult:
    """What one worker reports for a contiguous run of files; its rows are in an Arrow shard on disk."""

    index: int
    shard: str
    rows: int
    chars: int
    good: list[str]
    skipped: list[tuple[str, str]]
    bad_lines: list[str]
    conversations: Counter = field(default_factory=Counter)
    """Conversations kept, by input format."""
    bad_chats: list[tuple[str, str]] = field(default_factory=list)
    """(reason, "file:line N") of each conversation skipped."""
    bad_rows: list[tuple[str, str]] = field(default_factory=list)
    """(reason, "file:line N") of each other row skipped (row_too_large)."""
    pairs: Counter = field(default_factory=Counter)
    """Preference pairs kept, by input form."""
    bad_pairs: list[tuple[str, str]] = field(default_factory=list)
    """(reason, "file:line N") of each preference record skipped."""
    prompts: Counter = field(default_factory=Counter)
    """Prompts kept, by form."""
    bad_prompts: list[tuple[str, str]] = field(default_factory=list)
    """(reason, "file:line N") of each prompt record skipped."""
    wrapped: list[str] = field(default_factory=list)
    """"file: key" of each list of records read from inside an object."""


class ShardWriter:
    """Rows to one Arrow IPC stream (the format datasets caches in; Dataset.from_file reads it back), written in
    batches of about WRITE_CHARS characters: a write per file costs more than parsing small files."""

    def __init__(self, path: str):
        self.schema = FEATURES.arrow_schema  # carries FEATURES, so datasets reads the columns' types back
        self.writer = pa.ipc.new_stream(path, self.schema)
        self.rows: list[Row] = []
        self.sources: list[str] = []
        self.buffered = 0
        self.failed = False
        """A write failed: an OSError raised while a file's rows are read is the shard's, not the file's."""

    def sink(self, source: str) -> Callable[[Row], None]:
        """What takes one file's rows, as extraction finds them."""
        # a name that is not UTF-8 (its bytes kept as surrogates) cannot be an Arrow string: those bytes escaped
        source = source.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")

        def add(row: Row) -> None:
            self.rows.append(row)
            self.sources.append(source)
            self.buffered += row_chars(row)
            if self.buffered >= WRITE_CHARS:
                self.flush()

        return add

    def flush(self) -> None:
        if not self.rows:
            return
        # a comprehension per column and no object per row: a tuple per row (100k objects for the garbage collector to
        # track per flush) made extraction 40% slower
        prompted = (Pair, Prompt)  # the rows whose prompt is in text or messages
        texts = [r if isinstance(r, str) else r.prompt_text if isinstance(r, prompted) else "" for r in self.rows]
        chats = [[] if isinstance(r, str) else r.prompt_messages if isinstance(r, prompted) else r.messages
                 for r in self.rows]
        chosen = [r.chosen if isinstance(r, Pair) else [] for r in self.rows]
        rejected = [r.rejected if isinstance(r, Pair) else [] for r in self.rows]
        tools = [r.tools if isinstance(r, (Chat, Prompt)) else "" for r in self.rows]
        keys = [r.columns if isinstance(r, Prompt) else "" for r in self.rows]
        kind = self.schema.field("messages").type
        columns = [pa.array(texts, pa.string()), pa.array(chats, kind), pa.array(self.sources, pa.string()),
                   pa.array(chosen, kind), pa.array(rejected, kind), pa.array(tools, pa.string()),
                   pa.array(keys, pa.string())]
        try:
            self.writer.write_batch(pa.record_batch(columns, schema=self.schema))
        except OSError:
            self.failed = True
            raise
        self.rows, self.sources, self.buffered = [], [], 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


def extract_chunk(index: int, root: str, rels: list[str], shard: str, limits: Limits = Limits()) -> ChunkResult:
    """Worker: extract every file of the chunk and write its rows, in file order, to one Arrow shard. A file's rows
    reach the writer as they are found (a large file is never whole in memory); a file that is skipped gives none
    before its reason is known (extract.py checks a streamed file whole first)."""
    res = ChunkResult(index, shard, 0, 0, [], [], [])
    writer = ShardWriter(shard)
    try:
        for rel in rels:
            try:
                got = extract_file(Path(root) / rel, limits, writer.sink(rel))
            except SkipFile as exc:
                res.skipped.append((str(exc), rel))
                continue
            except OSError:
                if writer.failed:  # the shard could not be written (a full disk): not the file's fault
                    raise
                res.skipped.append(("unreadable", rel))
                continue
            res.bad_lines.extend(f"{rel}:{n}" for n in got.bad_lines)
            res.bad_chats.extend((reason, f"{rel}:{where}") for reason, where in got.bad_chats)
            res.bad_rows.extend((reason, f"{rel}:{where}") for reason, where in got.bad_rows)
            res.bad_pairs.extend((reason, f"{rel}:{where}") for reason, where in got.bad_pairs)
            res.bad_prompts.extend((reason, f"{rel}:{where}") for reason, where in got.bad_prompts)
            res.wrapped.extend(f"{rel}: {key}" for key in dict.fromkeys(got.wrapped))
            if not got.count:
                res.skipped.append((got.nothing_kept, rel))
                continue
            res.pairs.update(got.pair_forms)
            res.prompts.update(got.prompt_forms)
            res.chars += got.chars
            res.rows += got.count
            res.conversations.update(got.formats)
            res.good.append(rel)
    finally:
        writer.close()
    return res


def _run_chunk(args: tuple) -> ChunkResult:
    return extract_chunk(*args)


def plan_chunks(sizes: list[int], num_proc: int, target_bytes: int = 4 << 20) -> list[range]:
    """Contiguous ranges of about equal bytes; several per worker so that slow files (YAML) even out."""
    total = sum(sizes)
    n = max(num_proc, min(64 * num_proc, total // target_bytes), 1)
    n = min(n, len(sizes))
    bounds, acc, k = [0], 0, 1
    for i, size in enumerate(sizes):
        acc += size
        if k < n and acc >= total * k / n and i + 1 < len(sizes):
            bounds.append(i + 1)
            k += 1
    bounds.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]


# ------------------------------------------------------------------------------------------------- the stage


def suffix(rel: str) -> str:
    """Path(rel).suffix.lower() from string operations: building a Path per file cost DATA-HF 0.15 s per 18,000
    files (6% of its time on the bench)."""
    name = rel[rel.rfind("/") + 1:]
    dot = name.rfind(".")
    return name[dot:].lower() if 0 < dot < len(name) - 1 else ""


def list_files(data_folder: Path) -> tuple[list[str], list[int], dict[str, list[str]]]:
    """Supported files (sorted relative paths, following file links), their sizes, and the others by reason."""
    found: list[tuple[str, int]] = []
    skipped: dict[str, list[str]] = defaultdict(list)
    prefix = len(str(data_folder).rstrip(os.sep)) + 1  # string slicing: pathlib per entry dominates big trees
    stack = [str(data_folder)]
    while stack:
        for entry in os.scandir(stack.pop()):
            rel = entry.path[prefix:].replace(os.sep, "/")
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            elif rel == MANIFEST or entry.name == OWNER_FILE:
                continue  # ORGANIZE_DATA's own index and the stages' marks, not corpus text
            elif not _is_file(entry):
                skipped["not_a_regular_file"].append(rel)
            elif suffix(entry.name) not in SUPPORTED:
                skipped["unsupported_type"].append(rel)
            else:
                found.append((rel, entry.stat().st_size))
    found.sort()
    return [f for f, _ in found], [s for _, s in found], skipped


def _is_file(entry: os.DirEntry) -> bool:
    """A file, or a link to one; a link loop or a link whose target is unreadable is not."""
    try:
        return entry.is_file()
    except OSError:  # ELOOP, EACCES on the target's folder
        return False


def _clean_stale_partials(save_dir: Path) -> None:
    """Remove leftovers of runs that were killed (their pid is gone)."""
    for stale in save_dir.parent.glob(f".{save_dir.name}.partial-*"):
        if left_by_a_dead_process(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _extract_all(cfg: CorpusConfig, files: list[str], sizes: list[int], work: Path) -> list[ChunkResult]:
    """Extract in a pool of cfg.num_proc processes; results come back in file order."""
    chunks = plan_chunks(sizes, cfg.num_proc)
    jobs = [(i, str(cfg.data_folder), files[r.start:r.stop], str(work / f"chunk-{i:05d}.arrow"), cfg.limits)
            for i, r in enumerate(chunks)]
    results: list[ChunkResult] = []
    with tqdm(total=len(files), unit="file", desc="extracting", disable=None) as bar:  # a terminal only
        if cfg.num_proc == 1:
            for job in jobs:
                results.append(_run_chunk(job))
                bar.update(len(job[2]))
        else:
            # fork: workers inherit the imported modules, so start-up costs milliseconds, not an import each
            with mp.get_context("fork").Pool(min(cfg.num_proc, len(jobs))) as pool:
                for res in pool.imap_unordered(_run_chunk, jobs):
                    results.append(res)
                    bar.update(len(jobs[res.index][2]))
    return sorted(results, key=lambda r: r.index)


def _report(cfg: CorpusConfig, results: list[ChunkResult], pre_skipped: dict) -> dict:
    skipped: dict[str, list[str]] = defaultdict(list, {k: list(v) for k, v in pre_skipped.items()})
    for res in results:
        for reason, rel in res.skipped:
            skipped[reason].append(rel)
    good = [rel for res in results for rel in res.good]
    bad_lines = [b for res in results for b in res.bad_lines]
    return {
        "data_folder": str(cfg.data_folder),
        "save_dir": str(cfg.save_dir),
        "files_read": len(good),
        "files_by_type": dict(sorted(Counter(map(suffix, good)).items())),
        "rows": sum(r.rows for r in results),
        "characters": sum(r.chars for r in results),
        "skipped": {r: {"count": len(p), "paths": sorted(p)} for r, p in sorted(skipped.items())},
        "bad_jsonl_lines": {"count": len(bad_lines), "where": bad_lines[:1000]},
        "rows_skipped": by_reason(res.bad_rows for res in results),
        "records_in_wrappers": {"count": sum(len(r.wrapped) for r in results),
                                "where": [w for r in results for w in r.wrapped][:1000]},
        "limits": {"max_file_mb": cfg.max_file_mb, "max_row_mb": cfg.max_row_mb},
        "conversations": kind_report([r.conversations for r in results], [r.bad_chats for r in results],
                                      "by_format"),
        "preferences": kind_report([r.pairs for r in results], [r.bad_pairs for r in results], "by_form"),
        "prompts": kind_report([r.prompts for r in results], [r.bad_prompts for r in results], "by_form"),
        "num_proc": cfg.num_proc,
        "seconds": 0.0,
    }


def write_layout(folder: Path, shards: list[Path]) -> None:
    """The workers' Arrow shards, in order, renamed into the layout save_to_disk writes (data-K-of-N.arrow,
    state.json, dataset_info.json), so load_from_disk reads the dataset and the data is written once: save_to_disk
    would rewrite all of it (the largest cost after parsing, BENCHMARKS.md section 1)."""
    mark(folder, "dataset", "DATA-HF.py")
    names = [f"data-{k:05d}-of-{len(shards):05d}.arrow" for k in range(len(shards))]
    for shard, name in zip(shards, names, strict=True):
        os.rename(shard, folder / name)
    # the keys save_to_disk writes and load_from_disk reads; a fresh fingerprint per build, as save_to_disk gives
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": secrets.token_hex(8),
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    datasets.DatasetInfo(features=FEATURES).write_to_directory(str(folder))


def build_dataset(cfg: CorpusConfig) -> dict:
    """Extract, save atomically to cfg.save_dir, and return the report (also saved as prep_report.json). Another
    DATA-HF writing the same save_dir at the same time is refused in one line."""
    start = time.perf_counter()
    files, sizes, pre_skipped = list_files(cfg.data_folder)
    if not files:
        raise UserError(f"--data_folder {cfg.data_folder} holds no {'/'.join(SUPPORTED)} files")
    cfg.save_dir.parent.mkdir(parents=True, exist_ok=True)
    with locked(beside(cfg.save_dir), "DATA-HF.py") as holder:
        if holder:
            raise UserError(f"--save_dir {cfg.save_dir} is being written by {holder}; wait for it to end, or choose "
                            "another --save_dir")
        restore_replaced(cfg.save_dir)  # a run killed between replace_dir's two renames hid the dataset it replaced
        cfg.check_target()  # again, now that no other run can write it: one may have finished since the first check
        with naming(cfg.save_dir):  # a full disk is named as the folder the user chose
            return _build_locked(cfg, files, sizes, pre_skipped, start)


def records_skipped(report: dict) -> str:
    """The records' own reasons behind files skipped for holding no valid record of their kind (no_valid_pair: KTO
    labels written as "true", pairs whose answers are equal), each with where it was first: "" when none."""
    kinds = (("conversations", "conversations"), ("preferences", "preference records"), ("prompts", "prompt records"))
    return "".join(f"; {what} skipped: " + "; ".join(f"{reason} {v['count']}, first at {v['where'][0]}"
                                                    for reason, v in report[key]["skipped"].items())
                   for key, what in kinds if report[key]["skipped"])


def _build_locked(cfg: CorpusConfig, files: list[str], sizes: list[int], pre_skipped: dict, start: float) -> dict:
    _clean_stale_partials(cfg.save_dir)
    work = cfg.save_dir.parent / f".{cfg.save_dir.name}.partial-{os.getpid()}"
    work.mkdir()
    try:
        results = _extract_all(cfg, files, sizes, work)
        report = _report(cfg, results, pre_skipped)
        if not report["rows"]:
            reasons = ", ".join(f"{r}: {v['count']}" for r, v in report["skipped"].items())
            raise UserError(f"no text extracted from {cfg.data_folder} ({reasons}{records_skipped(report)})")
        if refused := mixed_folder(cfg.data_folder, report, [r.shard for r in results if r.rows]):
            raise UserError(refused)
        if 0 < (pairs := report["preferences"]["rows"]) < report["rows"]:
            others = report["rows"] - pairs
            held = files_holding([r.shard for r in results if r.rows], pairs <= others)
            fewer = f"the {'pairs' if pairs <= others else 'others'} are in {held}"
            kind = "preference records" if report["preferences"]["by_form"].get("unpaired") else "preference pairs"
            raise UserError(f"{cfg.data_folder} mixes {pairs} {kind} with {others} text or conversation "
                            f"rows ({fewer}): a run trains on one kind (SFT or a preference objective); convert them "
                            "from separate folders into separate datasets")
        write_layout(work / "dataset", [Path(r.shard) for r in results if r.rows])
        report["seconds"] = round(time.perf_counter() - start, 3)
        (work / "dataset" / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        replace_dir(work / "dataset", cfg.save_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description="Convert a folder of text files into a Hugging Face Arrow dataset.")
    p.add_argument("--data_folder", required=True, type=Path, help="folder to read (e.g. ORGANIZE_DATA output)")
    p.add_argument("--save_dir", required=True, type=Path, help="where the dataset is saved")
    p.add_argument("--num_proc", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --save_dir")
    p.add_argument("--max_file_mb", type=float, default=256, help="skip a .json/.yaml file (parsed whole) larger "
                   "than this (default: 256)")
    p.add_argument("--max_row_mb", type=float, default=64, help="skip a row (a .jsonl line, a record's text) longer "
                   "than this many Mi characters (default: 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = CorpusConfig(args.data_folder, args.save_dir, args.num_proc, args.overwrite, args.max_file_mb,
                       args.max_row_mb)
    print(format_summary(build_dataset(cfg)))
    return 0
