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
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import yaml
from tqdm import tqdm

from pipeline.errors import ArgumentParser, UserError
from pipeline.fsutil import replace_dir
from pipeline.organize import MANIFEST

TEXT_TYPES = (".txt", ".md")
SUPPORTED = (*TEXT_TYPES, ".json", ".jsonl", ".yaml", ".yml")
ROW_CHARS = 1_000_000
"""Plain-text files larger than this are cut into rows of about this many characters at paragraph boundaries."""
WRITE_CHARS = 8_000_000
"""A worker writes its buffered rows to its Arrow shard once they hold this many characters."""
REPORT = "prep_report.json"
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # SafeLoader family only: no tag can run code
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass
class CorpusConfig:
    data_folder: Path
    """Folder to read recursively (typically ORGANIZE_DATA's --dst_root)."""
    save_dir: Path
    """Where the dataset is saved with save_to_disk. Must not exist unless overwrite is set."""
    num_proc: int = os.cpu_count() or 1
    """Worker processes for extraction."""
    overwrite: bool = False
    """Replace an existing dataset at save_dir (only once the new one is complete)."""

    def __post_init__(self) -> None:
        self.data_folder, self.save_dir = Path(self.data_folder), Path(self.save_dir)
        if self.num_proc < 1:
            raise UserError(f"--num_proc must be at least 1, got {self.num_proc}")
        if not self.data_folder.is_dir():
            raise UserError(f"--data_folder {self.data_folder} does not exist or is not a directory")
        data, save = self.data_folder.resolve(), self.save_dir.resolve()
        if save == data or data in save.parents:
            raise UserError(f"--save_dir {self.save_dir} is inside --data_folder {self.data_folder}; "
                            "a later run would read the dataset back as input")
        if self.save_dir.exists():
            if not self.overwrite:
                raise UserError(f"--save_dir {self.save_dir} already exists; pass --overwrite to replace it")
            if not _is_replaceable(self.save_dir):
                raise UserError(f"--save_dir {self.save_dir} exists and is not a saved dataset; refusing to "
                                "replace it even with --overwrite")


def _is_replaceable(path: Path) -> bool:
    return path.is_dir() and (not any(path.iterdir()) or any((path / m).exists() for m in _DATASET_MARKERS))


# ----------------------------------------------------------------------------------------------- extraction


class SkipFile(Exception):
    """The whole file is unusable; the message is the reason reported."""


def strings_in(obj: object) -> list[str]:
    """All non-blank string values in document order, iteratively so that depth cannot overflow the stack."""
    out: list[str] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.strip():
                out.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return out


def decode(data: bytes) -> str:
    """UTF-8 text (BOM or not), or SkipFile with the reason: empty, binary or undecodable."""
    if not data.strip():
        raise SkipFile("empty")
    if b"\x00" in data[:8192]:
        raise SkipFile("binary")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise SkipFile("undecodable") from None
    if not text.strip():
        raise SkipFile("empty")
    return text


def split_paragraphs(text: str, limit: int = ROW_CHARS) -> list[str]:
    """Cut text into pieces of at most about limit characters, at blank lines where possible."""
    if len(text) <= limit:
        return [text]
    rows: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        while len(para) > limit:  # one paragraph bigger than a row: cut at a line break, else hard
            cut = para.rfind("\n", 0, limit)
            cut = cut if cut > 0 else limit
            rows.append(para[:cut])
            para = para[cut:].lstrip("\n")
        if current and size + len(para) + 2 > limit:
            rows.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        rows.append("\n\n".join(current))
    return [r for r in rows if r.strip()]


def _parse(loader, text: str, reason: str):
    try:
        return loader(text)
    except RecursionError:
        raise SkipFile("too_deeply_nested") from None
    except (ValueError, yaml.YAMLError):
        raise SkipFile(reason) from None


def _json_rows(text: str) -> list[str]:
    doc = _parse(json.loads, text, "invalid_json")
    parts = doc if isinstance(doc, list) else [doc]
    return [row for row in ("\n".join(strings_in(p)) for p in parts) if row]


def _yaml_rows(text: str) -> list[str]:
    docs = _parse(lambda t: list(yaml.load_all(t, Loader=_YAML_LOADER)), text, "invalid_yaml")
    return [row for row in ("\n".join(strings_in(d)) for d in docs) if row]


def _jsonl_rows(text: str) -> tuple[list[str], list[int]]:
    rows, bad = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = "\n".join(strings_in(json.loads(line)))
        except (ValueError, RecursionError):
            bad.append(lineno)
            continue
        if row:
            rows.append(row)
    if bad and not rows:
        raise SkipFile("invalid_jsonl")
    return rows, bad


def extract_file(path: Path) -> tuple[list[str], list[int]]:
    """Rows of text from one file and the numbers of unparsable .jsonl lines; SkipFile when nothing is usable."""
    text = decode(path.read_bytes())
    ext = path.suffix.lower()
    bad: list[int] = []
    if ext in TEXT_TYPES:
        rows = split_paragraphs(text)
    elif ext == ".json":
        rows = _json_rows(text)
    elif ext == ".jsonl":
        rows, bad = _jsonl_rows(text)
    else:
        rows = _yaml_rows(text)
    if not rows:
        raise SkipFile("no_text")
    return rows, bad


FEATURES = datasets.Features({"text": datasets.Value("string"), "source": datasets.Value("string")})


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


def extract_chunk(index: int, root: str, rels: list[str], shard: str) -> ChunkResult:
    """Worker: extract every file of the chunk and write its rows, in file order, to one Arrow shard."""
    res = ChunkResult(index, shard, 0, 0, [], [], [])
    texts: list[str] = []
    sources: list[str] = []
    buffered = 0
    # the Arrow IPC stream datasets itself caches (Dataset.from_file reads it back); the schema carries FEATURES
    schema = FEATURES.arrow_schema
    writer = pa.ipc.new_stream(shard, schema)

    def write(texts: list[str], sources: list[str]) -> None:
        writer.write_batch(pa.record_batch([pa.array(texts, pa.string()), pa.array(sources, pa.string())],
                                           schema=schema))

    try:
        for rel in rels:
            try:
                rows, bad = extract_file(Path(root) / rel)
            except SkipFile as exc:
                res.skipped.append((str(exc), rel))
                continue
            except OSError:
                res.skipped.append(("unreadable", rel))
                continue
            texts.extend(rows)
            sources.extend([rel] * len(rows))
            chars = sum(map(len, rows))
            buffered += chars
            res.chars += chars
            res.rows += len(rows)
            res.good.append(rel)
            res.bad_lines.extend(f"{rel}:{n}" for n in bad)
            if buffered >= WRITE_CHARS:  # a write per file costs more than parsing small files
                write(texts, sources)
                texts, sources, buffered = [], [], 0
        if texts:
            write(texts, sources)
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
            elif rel == MANIFEST:
                continue  # ORGANIZE_DATA's own index, not corpus text
            elif not entry.is_file():
                skipped["not_a_regular_file"].append(rel)
            elif os.path.splitext(entry.name)[1].lower() not in SUPPORTED:
                skipped["unsupported_type"].append(rel)
            else:
                found.append((rel, entry.stat().st_size))
    found.sort()
    return [f for f, _ in found], [s for _, s in found], skipped


def _clean_stale_partials(save_dir: Path) -> None:
    """Remove leftovers of runs that were killed (their pid is gone)."""
    for stale in save_dir.parent.glob(f".{save_dir.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _extract_all(cfg: CorpusConfig, files: list[str], sizes: list[int], work: Path) -> list[ChunkResult]:
    """Extract in a pool of cfg.num_proc processes; results come back in file order."""
    chunks = plan_chunks(sizes, cfg.num_proc)
    jobs = [(i, str(cfg.data_folder), files[r.start:r.stop], str(work / f"chunk-{i:05d}.arrow"))
            for i, r in enumerate(chunks)]
    results: list[ChunkResult] = []
    with tqdm(total=len(files), unit="file", desc="extracting") as bar:
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
        "files_by_type": dict(sorted(Counter(Path(s).suffix.lower() for s in good).items())),
        "rows": sum(r.rows for r in results),
        "characters": sum(r.chars for r in results),
        "skipped": {r: {"count": len(p), "paths": sorted(p)} for r, p in sorted(skipped.items())},
        "bad_jsonl_lines": {"count": len(bad_lines), "where": bad_lines[:1000]},
        "num_proc": cfg.num_proc,
        "seconds": 0.0,
    }


def build_dataset(cfg: CorpusConfig) -> dict:
    """Extract, save atomically to cfg.save_dir, and return the report (also saved as prep_report.json)."""
    start = time.perf_counter()
    files, sizes, pre_skipped = list_files(cfg.data_folder)
    if not files:
        raise UserError(f"--data_folder {cfg.data_folder} holds no {'/'.join(SUPPORTED)} files")
    cfg.save_dir.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_partials(cfg.save_dir)
    work = cfg.save_dir.parent / f".{cfg.save_dir.name}.partial-{os.getpid()}"
    work.mkdir()
    try:
        results = _extract_all(cfg, files, sizes, work)
        shards = [datasets.Dataset.from_file(r.shard) for r in results if r.rows]
        ds = datasets.concatenate_datasets(shards) if shards else None
        report = _report(cfg, results, pre_skipped)
        if ds is None:
            reasons = ", ".join(f"{r}: {v['count']}" for r, v in report["skipped"].items())
            raise UserError(f"no text extracted from {cfg.data_folder} ({reasons})")
        ds.save_to_disk(str(work / "dataset"))
        report["seconds"] = round(time.perf_counter() - start, 3)
        (work / "dataset" / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        replace_dir(work / "dataset", cfg.save_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def format_summary(report: dict) -> str:
    lines = [
        f"saved {report['rows']:,} rows ({report['characters']:,} characters) from {report['files_read']} files "
        f"to {report['save_dir']} in {report['seconds']:.1f}s",
        "  files by type: " + ", ".join(f"{k} {v}" for k, v in report["files_by_type"].items()),
    ]
    for reason, info in report["skipped"].items():
        paths = info["paths"]
        lines.append(f"  skipped {info['count']} ({reason}): {', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''}")
    if report["bad_jsonl_lines"]["count"]:
        lines.append(f"  unparsable .jsonl lines skipped: {report['bad_jsonl_lines']['count']}")
    lines.append(f"  report: {Path(report['save_dir']) / REPORT}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description="Convert a folder of text files into a Hugging Face Arrow dataset.")
    p.add_argument("--data_folder", required=True, type=Path, help="folder to read (e.g. ORGANIZE_DATA output)")
    p.add_argument("--save_dir", required=True, type=Path, help="where the dataset is saved")
    p.add_argument("--num_proc", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --save_dir")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = CorpusConfig(args.data_folder, args.save_dir, args.num_proc, args.overwrite)
    print(format_summary(build_dataset(cfg)))
    return 0
