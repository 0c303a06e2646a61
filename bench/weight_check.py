"""The cost of checking weights by content (pipeline/model/weight_check.py): what a start pays to hash a model's
weight files the first time, with the files in the page cache and read from disk, and what every later start pays
when the record's stamps vouch for them.

    .venv/bin/python bench/weight_check.py --gb 4 --files 2 --repeats 3 [--cold]

The files are random bytes named *.safetensors (the check hashes bytes; it does not parse them), in a model folder
outside the hub cache, so the reference is the folder's own first check. --cold drops the page cache before each
first check (needs root), as on a node that has just started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import common
from resume import drop_page_cache

from pipeline.model.weight_check import check_weights, record_path

RESULTS = common.ROOT / "bench" / "data" / "weight_check_cpu.json"


def build(folder: Path, gb: float, files: int) -> int:
    """files weight files of gb GiB together; returns their bytes."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    each = int(gb * 2**30) // files
    for i in range(files):
        with open(folder / f"model-{i:05d}-of-{files:05d}.safetensors", "wb") as fh:
            for _ in range(each // 2**26):
                fh.write(os.urandom(2**26))
        old = time.time() - 3600  # written long before the check, as a real download is (no racy stamp)
        os.utime(folder / f"model-{i:05d}-of-{files:05d}.safetensors", (old, old))
    return each * files


def timed(folder: Path) -> tuple[float, int]:
    started = time.perf_counter()
    check = check_weights(folder)
    return time.perf_counter() - started, check.read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--workdir", type=Path, default=common.ROOT / ".bench" / "weight_check")
    args = p.parse_args()
    folder = args.workdir / "model"
    size = build(folder, args.gb, args.files)
    rows = {"first check, warm page cache": [], "later start (stamps vouch)": []}
    if args.cold:
        rows["first check, cold page cache"] = []
    for _ in range(args.repeats):
        for label in rows:
            if label.startswith("first"):
                record_path(folder).unlink(missing_ok=True)
                if "cold" in label:
                    drop_page_cache()
            seconds, read = timed(folder)
            assert read == (args.files if label.startswith("first") else 0), (label, read)
            rows[label].append(seconds)
    raw = {"machine": common.machine(), "gb": size / 2**30, "files": args.files, "seconds": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(raw, indent=2))
    body = [f"- Machine: {raw['machine']}.",
            f"- Command: `.venv/bin/python bench/weight_check.py --gb {args.gb:g} --files {args.files} --repeats "
            f"{args.repeats}{' --cold' if args.cold else ''}`; raw results in {RESULTS.relative_to(common.ROOT)}.",
            f"- {args.files} weight files, {size / 2**30:.2f} GiB together; SHA-256 of every byte.", "",
            common.table(["check", "seconds", "GiB/s"],
                         [[label, common.spread(values, 3), f"{size / 2**30 / min(values):.2f}" if "first" in label
                           else "-"] for label, values in rows.items()])]
    common.update_section("weight_check_cpu", "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
