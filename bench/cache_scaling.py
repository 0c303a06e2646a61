"""Data preparation at growing corpus sizes: does time grow linearly and memory stay flat?

For each size (--sizes, MB of text): a folder of real text (bench/data_prep.py's gatherer, copied over as many times
as the size needs, each copy its own files) goes through DATA-HF.py, then `fsdp1.py --prepare-only` builds the token
cache from the dataset (the bench model's byte-level BPE tokenizer, seq 1024). Each is a real command in its own
process tree, timed from launch to exit, with the peak of RssAnon summed over the tree (heap and anonymous maps: not
the file pages a memory map brings in) sampled every 50 ms. Writes the cache_scaling section of BENCHMARKS.md.

    .venv/bin/python bench/cache_scaling.py --sizes 40 160 320 --num_proc 2
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import ROOT, bench_env, machine, table, update_section


def anon_bytes(pid: int) -> int:
    """RssAnon of pid and its descendants, from /proc (0 for a process that is gone)."""
    import psutil

    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def timed(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak anonymous bytes of the tree) of one command run to its end."""
    peak = [0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon_bytes(proc.pid))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return seconds, peak[0]


def corpus(work: Path, mb: int) -> Path:
    """work/text-MB: copies of the gathered real text until mb MB (each copy in its own folder)."""
    from data_prep import gather

    base = work / "gathered"
    if not base.exists():
        gather(base, 40 * 10**6)
    unit = sum(f.stat().st_size for f in base.rglob("*") if f.is_file())
    out = work / f"text-{mb}"
    if not out.exists():
        for k in range(-(-mb * 10**6 // unit)):
            shutil.copytree(base, out / f"copy-{k:03d}")
    return out


def main() -> None:
    from pipeline.prep.tiny import build_tiny

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "scaling")
    p.add_argument("--sizes", type=int, nargs="+", default=[40, 160, 320])
    p.add_argument("--num_proc", type=int, default=2)
    args = p.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model" if (work / "model" / "config.json").exists() else build_tiny(work / "model", tied=True)
    rows = []
    for mb in args.sizes:
        text = corpus(work, mb)
        size = sum(f.stat().st_size for f in text.rglob("*") if f.is_file()) / 1e6
        dataset, runs = work / f"dataset-{mb}", work / f"runs-{mb}"
        shutil.rmtree(dataset, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)
        prep_s, prep_anon = timed([sys.executable, str(ROOT / "DATA-HF.py"), "--data-folder", str(text), "--save-dir",
                                   str(dataset), "--num-proc", str(args.num_proc)])
        cache_s, cache_anon = timed([sys.executable, str(ROOT / "fsdp1.py"), "-e", "scaling", "-d", str(dataset), "-m",
                                     str(model), "--save-dir", str(runs), "--seq-length", "1024", "--num-proc",
                                     str(args.num_proc), "--prepare-only"])
        rows.append([f"{size:.0f}", f"{prep_s:.1f}", f"{size / prep_s:.1f}", f"{prep_anon / 1e6:.0f}",
                     f"{cache_s:.1f}", f"{size / cache_s:.1f}", f"{cache_anon / 1e6:.0f}"])
        shutil.rmtree(runs, ignore_errors=True)
        shutil.rmtree(dataset, ignore_errors=True)
    update_section("cache_scaling", "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/cache_scaling.py --sizes {' '.join(map(str, args.sizes))} --num_proc "
        f"{args.num_proc}`.",
        "- Text: real text gathered from this machine, copied to each size; DATA-HF.py to a dataset, then `fsdp1.py "
        "--prepare-only` (bench model's tokenizer, seq 1024); peak RssAnon summed over each command's processes.",
        "",
        table(["MB of text", "DATA-HF s", "DATA-HF MB/s", "DATA-HF peak anon MB", "token cache s", "token cache MB/s",
               "token cache peak anon MB"], rows),
    ]))
    print("\n".join(" | ".join(r) for r in rows))


if __name__ == "__main__":
    main()
