"""DATA-HF: extract text from a folder of .txt/.md/.json/.jsonl/.yaml files into a Hugging Face Arrow dataset.

One bad file never stops the run: it is skipped and reported by reason, and every good file's text is kept.
The dataset is built in a hidden sibling folder and renamed into place, so an interrupted run leaves nothing at
--save_dir, and --overwrite replaces an existing dataset only once the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow.compute as pc
import yaml

from pipeline.errors import UserError
from pipeline.organize import MANIFEST

TEXT_TYPES = (".txt", ".md")
SUPPORTED = (*TEXT_TYPES, ".json", ".jsonl", ".yaml", ".yml")
ROW_CHARS = 1_000_000
"""Plain-text files larger than this are cut into rows of about this many characters at paragraph boundaries."""
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


def _extract_batch(batch: dict, root: str) -> dict:
    """datasets.map worker: one output row per text row; skips and bad lines become rows with a status."""
    out: dict[str, list] = {"text": [], "source": [], "status": []}

    def emit(text: str, source: str, status: str) -> None:
        out["text"].append(text)
        out["source"].append(source)
        out["status"].append(status)

    for rel in batch["source"]:
        try:
            rows, bad = extract_file(Path(root) / rel)
        except SkipFile as exc:
            emit("", rel, f"skip:{exc}")
            continue
        except OSError:
            emit("", rel, "skip:unreadable")
            continue
        for row in rows:
            emit(row, rel, "")
        for lineno in bad:
            emit("", rel, f"bad_line:{lineno}")
    return out


# ------------------------------------------------------------------------------------------------- the stage


def list_files(data_folder: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Supported files (sorted relative paths, following file links) and the others by reason."""
    files, skipped = [], defaultdict(list)
    for dirpath, dirnames, filenames in os.walk(data_folder):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(data_folder).as_posix()
            if rel == MANIFEST:
                continue  # ORGANIZE_DATA's own index, not corpus text
            if not path.is_file():
                skipped["not_a_regular_file"].append(rel)
            elif path.suffix.lower() not in SUPPORTED:
                skipped["unsupported_type"].append(rel)
            else:
                files.append(rel)
    files.sort()
    return files, skipped


def _clean_stale_partials(save_dir: Path) -> None:
    """Remove leftovers of runs that were killed (their pid is gone)."""
    for stale in save_dir.parent.glob(f".{save_dir.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _report(cfg: CorpusConfig, extracted: datasets.Dataset, pre_skipped: dict, seconds: float) -> dict:
    status = extracted["status"]
    sources = extracted["source"]
    skipped: dict[str, list[str]] = defaultdict(list, {k: list(v) for k, v in pre_skipped.items()})
    bad_lines: list[str] = []
    good_sources = set()
    for src, st in zip(sources, status, strict=True):
        if not st:
            good_sources.add(src)
        elif st.startswith("skip:"):
            skipped[st[5:]].append(src)
        else:
            bad_lines.append(f"{src}:{st.split(':', 1)[1]}")
    chars = pc.sum(pc.utf8_length(extracted.data.column("text"))).as_py() or 0
    by_type = Counter(Path(s).suffix.lower() for s in good_sources)
    return {
        "data_folder": str(cfg.data_folder),
        "save_dir": str(cfg.save_dir),
        "files_read": len(good_sources),
        "files_by_type": dict(sorted(by_type.items())),
        "rows": status.count(""),
        "characters": chars,
        "skipped": {r: {"count": len(p), "paths": sorted(p)} for r, p in sorted(skipped.items())},
        "bad_jsonl_lines": {"count": len(bad_lines), "where": bad_lines[:1000]},
        "num_proc": cfg.num_proc,
        "seconds": round(seconds, 3),
    }


def build_dataset(cfg: CorpusConfig) -> dict:
    """Extract, save atomically to cfg.save_dir, and return the report (also saved as prep_report.json)."""
    start = time.perf_counter()
    files, pre_skipped = list_files(cfg.data_folder)
    if not files:
        raise UserError(f"--data_folder {cfg.data_folder} holds no {'/'.join(SUPPORTED)} files")
    cfg.save_dir.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_partials(cfg.save_dir)
    work = cfg.save_dir.parent / f".{cfg.save_dir.name}.partial-{os.getpid()}"
    work.mkdir()
    try:
        extracted = datasets.Dataset.from_dict({"source": files}).map(
            _extract_batch, batched=True, batch_size=8, fn_kwargs={"root": str(cfg.data_folder)},
            num_proc=min(cfg.num_proc, len(files)), remove_columns=["source"],
            cache_file_name=str(work / "extract.arrow"), desc="extracting files",
        )
        report = _report(cfg, extracted, pre_skipped, 0.0)
        if report["rows"] == 0:
            reasons = ", ".join(f"{r}: {v['count']}" for r, v in report["skipped"].items())
            raise UserError(f"no text extracted from {cfg.data_folder} ({reasons})")
        kept = extracted.filter(lambda st: [s == "" for s in st], input_columns="status", batched=True,
                                batch_size=10_000, cache_file_name=str(work / "kept.arrow"),
                                desc="keeping text rows").select_columns(["text", "source"])
        kept.save_to_disk(str(work / "dataset"))
        report["seconds"] = round(time.perf_counter() - start, 3)
        (work / "dataset" / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        _swap_into_place(work / "dataset", cfg.save_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _swap_into_place(new: Path, target: Path) -> None:
    """Rename the finished dataset to target; an existing one is moved aside first and deleted only after."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.replaced-{os.getpid()}"
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old)


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
    p = argparse.ArgumentParser(description="Convert a folder of text files into a Hugging Face Arrow dataset.")
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
