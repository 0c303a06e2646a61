"""DATA-HF throughput against its parse limit.

Gathers a corpus of real text from this machine's Python installation (JSON data files, YAML, plain text and
reStructuredText documentation, and Python sources stored as .txt until the target size is reached), then times:

- the parse limit: the same files read and parsed (json.loads, the C YAML loader, UTF-8 decode) by a process pool
  of --num_proc workers doing nothing else;
- DATA-HF: pipeline.prep.corpus.build_dataset with the same --num_proc, from listing the folder to the renamed dataset.

Runs alternate between the two and the medians are reported. Usage:
    .venv/bin/python bench/data_prep.py --num_proc 2 --target_mb 100 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.prep.corpus import CorpusConfig, build_dataset, list_files  # noqa: E402
from pipeline.prep.extract import SkipFile, decode  # noqa: E402

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_AS = {".json": ".json", ".yaml": ".yaml", ".yml": ".yml", ".txt": ".txt", ".md": ".md", ".rst": ".md"}


def gather(out: Path, target_bytes: int) -> int:
    """Copy real text files into out (data files first, then .py sources as .txt); returns bytes gathered."""
    roots = sorted({Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])})
    total = 0
    for pass_exts in (tuple(_AS), (".py",)):
        for root in roots:
            for path in sorted(root.rglob("*")):
                ext = path.suffix.lower()
                if ext not in pass_exts or not path.is_file() or path.is_symlink():
                    continue
                dest = out / root.name / path.relative_to(root)
                dest = dest.with_suffix(_AS.get(ext, ".txt"))
                if dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
                total += dest.stat().st_size
                if pass_exts == (".py",) and total >= target_bytes:
                    return total
    return total


def parse_only(path: str) -> int:
    """What any extractor must do at least: read the bytes and parse them. Returns bytes read."""
    data = Path(path).read_bytes()
    try:
        text = decode(data)
        ext = Path(path).suffix.lower()
        if ext == ".json":
            json.loads(text)
        elif ext in (".yaml", ".yml"):
            list(yaml.load_all(text, Loader=_LOADER))
    except (SkipFile, ValueError, RecursionError, yaml.YAMLError):
        pass
    return len(data)


def time_parse_limit(root: Path, files: list[str], num_proc: int) -> float:
    paths = [str(root / f) for f in files]
    start = time.perf_counter()
    with mp.get_context("fork").Pool(num_proc) as pool:
        sum(pool.imap_unordered(parse_only, paths, chunksize=8))
    return time.perf_counter() - start


def time_data_hf(root: Path, save: Path, num_proc: int) -> float:
    start = time.perf_counter()
    build_dataset(CorpusConfig(root, save, num_proc=num_proc, overwrite=True))
    return time.perf_counter() - start


def write_section(args, r: dict) -> None:
    from common import bar_chart, machine, table, update_section

    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/data_prep.py --num_proc {args.num_proc} --target_mb {args.target_mb:g} "
        f"--repeats {args.repeats} --write` (part of `make bench`). {r['files']:,} files, {r['mb']} MB.",
        "",
        table(["", "seconds per run", "MB/s (median)"],
              [["parse limit", ", ".join(map(str, r["parse_limit_s"])), r["parse_limit_mb_s"]],
               ["DATA-HF", ", ".join(map(str, r["data_hf_s"])), r["data_hf_mb_s"]]]),
        "",
        f"Ratio: **{r['ratio']:.2f}** of the parse limit (target 0.8).",
        "",
        bar_chart("data_prep_cpu", "DATA-HF against its parse limit (MB/s, higher is better)",
                  ["parse limit", "DATA-HF"], [r["parse_limit_mb_s"], r["data_hf_mb_s"]], "MB/s"),
    ])
    update_section("data_prep_cpu", body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num_proc", type=int, default=2)
    p.add_argument("--target_mb", type=float, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None, help="keep the gathered corpus here (default: a temp dir)")
    p.add_argument("--write", action="store_true", help="rewrite the DATA-HF table of BENCHMARKS.md")
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-data-"))
    corpus = work / "corpus"
    if not corpus.exists():
        gather(corpus, int(args.target_mb * 1e6))
    files, _, _ = list_files(corpus)
    mb = sum((corpus / f).stat().st_size for f in files) / 1e6
    limit, ours = [], []
    for _ in range(args.repeats):
        limit.append(time_parse_limit(corpus, files, args.num_proc))
        ours.append(time_data_hf(corpus, work / "dataset", args.num_proc))
    result = {
        "machine": f"{platform.machine()} {mp.cpu_count()} cores, Python {platform.python_version()}",
        "files": len(files), "mb": round(mb, 1), "num_proc": args.num_proc,
        "parse_limit_s": [round(t, 2) for t in limit], "data_hf_s": [round(t, 2) for t in ours],
        "parse_limit_mb_s": round(mb / statistics.median(limit), 1),
        "data_hf_mb_s": round(mb / statistics.median(ours), 1),
        "ratio": round(statistics.median(limit) / statistics.median(ours), 3),
    }
    print(json.dumps(result, indent=2))
    if args.write:
        write_section(args, result)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
