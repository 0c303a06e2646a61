"""What hostile inputs cost a worker: DATA-HF on a whitespace-free row of --row-mb MB (in a .jsonl line and in a .json
document, skipped at the default --max_row_mb and kept above it) and on a sparse 2 GB file, and the token cache's
tokenizer on such a row. Peak resident memory of the process above its start, and seconds. And (--part user-code)
the user's own code inside training as a hostile user writes it (bench/hostile_user_code.py): what each case ends
in, how fast a stop comes.

    .venv/bin/python bench/hostile_inputs.py --row-mb 100
    .venv/bin/python bench/hostile_inputs.py --part user-code

Each case runs in a process of its own (DATA-HF with --num_proc 1, so the worker is the process measured).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
import hostile_user_code

RESULTS = common.ROOT / "bench" / "data" / "hostile_inputs.json"
HWM = "int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
"""The process's peak resident KiB so far: VmHWM, which starts anew at exec (getrusage's ru_maxrss keeps the
parent's peak from before the exec, so a child of a big parent would read that)."""
PEAK = (f"import runpy, sys; sys.argv = sys.argv[1:]; start = {HWM}\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        f"finally:\n    print('PEAK', start, {HWM}, file=sys.stderr)")
"""Runs a script and prints its peak RSS (KiB) before and after: what the script itself added."""
TOKENIZE = f"""
import base64, os, random, sys, time
from transformers import AutoTokenizer
from pipeline.data.text_tokens import tokenize_rows
tok = AutoTokenizer.from_pretrained(sys.argv[1])
text = base64.b64encode(random.Random(0).randbytes(int(sys.argv[2]) * 3 // 4)).decode()
start = {HWM}
t = time.perf_counter()
ids = tokenize_rows({{"text": [text]}}, tok, tok.eos_token_id, True)["input_ids"][0]
print("RESULT", len(ids), time.perf_counter() - t, start, {HWM})
"""


def blob(n: int) -> str:
    return base64.b64encode(random.Random(0).randbytes(n * 3 // 4)).decode()


def data_hf(folder: Path, out: Path, *flags: str) -> dict:
    """DATA-HF in a process of its own: seconds, peak MB above its start, its report."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-c", PEAK, str(common.ROOT / "DATA-HF.py"), "--data_folder", str(folder), "--save_dir",
           str(out), "--num_proc", "1", *flags]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak = next(line.split() for line in proc.stderr.splitlines() if line.startswith("PEAK"))
    report = json.loads((out / "prep_report.json").read_text()) if (out / "prep_report.json").exists() else {}
    return {"seconds": round(seconds, 2), "peak_mb": round((int(peak[2]) - int(peak[1])) / 1024, 1),
            "rows": report.get("rows"), "skipped": {k: v["count"] for k, v in report.get("skipped", {}).items()},
            "rows_skipped": {k: v["count"] for k, v in report.get("rows_skipped", {}).items()}}


def tokenize(model: Path, chars: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", TOKENIZE, str(model), str(chars)], cwd=common.ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(common.ROOT)})
    n, seconds, start, end = next(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return {"seconds": round(float(seconds), 1), "peak_mb": round((int(end) - int(start)) / 1024, 1), "ids": int(n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row-mb", type=int, default=100)
    p.add_argument("--workdir", type=Path, default=common.ROOT / ".bench" / "hostile")
    p.add_argument("--part", choices=("data", "user-code", "all"), default="all")
    args = p.parse_args()
    if args.part in ("user-code", "all"):
        user_code(args.workdir / "user-code")
    if args.part in ("data", "all"):
        data(args)


def user_code(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = hostile_user_code.run_all(work)
    raw = {"machine": common.machine(), "cases": results}
    out = RESULTS.with_name("hostile_user_code.json")
    out.write_text(json.dumps(raw, indent=2))
    body = [f"- Machine: {raw['machine']}.",
            f"- Command: `.venv/bin/python bench/hostile_inputs.py --part user-code`; raw results in "
            f"{out.relative_to(common.ROOT)}.",
            "- Each case a `fsdp1.py --nproc-per-node 2` GRPO run on the bundled tiny model (bench/hostile_user_code.py"
            " holds the reward functions); seconds from the start, or from the SIGTERM for a stop; the lines printed "
            "beyond the case's one line and rank 0's log; whether a traceback was printed; the last line (paths "
            "relative to the work folder).", "", hostile_user_code.table(results, work)]
    common.update_section("hostile_user_code", "\n".join(body))
    print("\n".join(body))


def data(args: argparse.Namespace) -> None:
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    chars = args.row_mb * 10**6
    text = blob(chars)
    (work / "baseline").mkdir(parents=True)
    (work / "baseline" / "small.txt").write_text("one small file, kept\n")
    cases = {"baseline: one small file": data_hf(work / "baseline", work / "out")}
    for name, content in (("jsonl", json.dumps({"text": text}) + "\n"), ("json", json.dumps({"text": text}))):
        (work / name).mkdir()
        (work / name / f"row.{name}").write_text(content)
        (work / name / "small.txt").write_text("one small file, kept\n")
        cases[f"{args.row_mb} MB row in a .{name}, default limits (skipped)"] = data_hf(work / name, work / "out")
        cases[f"{args.row_mb} MB row in a .{name}, --max_row_mb {2 * args.row_mb} (kept)"] = \
            data_hf(work / name, work / "out", "--max_row_mb", str(2 * args.row_mb))
    (work / "sparse").mkdir()
    with open(work / "sparse" / "x.json", "wb") as fh:
        fh.truncate(2**31)
    (work / "sparse" / "small.txt").write_text("one small file, kept\n")
    cases["2 GB sparse .json (skipped as binary)"] = data_hf(work / "sparse", work / "out")
    from pipeline.prep.tiny import build_tiny

    model = build_tiny(work / "tiny")
    tokenizer = {f"{n / 10**6:g} M characters": tokenize(model, n) for n in (8 * 10**6, chars)}
    raw = {"machine": common.machine(), "data_hf": cases, "tokenizer": tokenizer}
    base = cases["baseline: one small file"]["peak_mb"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(raw, indent=2))
    body = [f"- Machine: {raw['machine']}.",
            f"- Command: `.venv/bin/python bench/hostile_inputs.py --row-mb {args.row_mb}`; raw results in "
            f"{RESULTS.relative_to(common.ROOT)}.",
            "- DATA-HF with `--num_proc 1` (the worker is the process): its peak resident memory (imports included), "
            "that peak above the baseline's (one small file), and wall seconds of the whole command.", "",
            common.table(["DATA-HF input", "seconds", "peak MB", "above baseline", "rows kept", "skipped"],
                         [[k, v["seconds"], v["peak_mb"], round(v["peak_mb"] - base, 1), v["rows"] or 0,
                           ", ".join(f"{r} {c}" for r, c in {**v["skipped"], **v["rows_skipped"]}.items()) or "-"]
                          for k, v in cases.items()]),
            "", "The token cache's tokenizer on one whitespace-free (base64) row, in bounded pieces "
            "(`pipeline/data/text_tokens.py`): the process's peak memory above what it held once the row was made.",
            "",
            common.table(["row", "seconds", "peak MB", "ids"],
                         [[k, v["seconds"], v["peak_mb"], v["ids"]] for k, v in tokenizer.items()])]
    common.update_section("hostile_inputs", "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
