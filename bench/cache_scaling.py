"""Data preparation at growing corpus sizes: does time grow linearly and memory stay flat?

For each size (--sizes, MB of text): a folder of real text (bench/data_prep.py's gatherer, copied over as many times
as the size needs, each copy its own files) goes through DATA-HF.py, then `fsdp1.py --prepare-only` builds the token
cache from the dataset (the bundled tokenizer, or one of --vocab tokens trained on the gathered text; seq 1024). Each is
a real command in its own process tree, timed from launch to exit, with the peak of RssAnon summed over the tree
(heap and anonymous maps: not the file pages a memory map brings in) sampled every 50 ms. Writes the cache_scaling
section of BENCHMARKS.md (cache_scaling_VOCAB for another --vocab).

    .venv/bin/python bench/cache_scaling.py --sizes 40 160 320 --num_proc 2 [--vocab 128000]
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


def anon_bytes(pid: int) -> tuple[int, int]:
    """RssAnon and Pss_Anon of pid and its descendants, from /proc (0 for a process that is gone). RssAnon counts a
    forked worker's copy-on-write pages in full in every process that maps them; Pss_Anon divides each shared page
    among its processes, so its sum over the tree is the memory the tree really holds."""
    import psutil

    rss = pss = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for proc in procs:
        rss += _field(f"/proc/{proc.pid}/status", "RssAnon:")
        pss += _field(f"/proc/{proc.pid}/smaps_rollup", "Pss_Anon:")
    return rss, pss


def _field(path: str, name: str) -> int:
    """A kB figure of a /proc file, in bytes (0 when the process is gone); a kernel without it stops the bench
    rather than print a column of zeros."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for line in text.splitlines():
        if line.startswith(name):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"{path} has no {name} line (Linux 4.14 or later has it)")


def timed(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RssAnon, peak Pss_Anon) of one command's tree, run to its end."""
    peak = [0, 0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[:] = [max(a, b) for a, b in zip(peak, anon_bytes(proc.pid), strict=True)]
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return seconds, peak[0], peak[1]


def gathered(work: Path) -> Path:
    """work/gathered: real text from this machine (bench/data_prep.py's gatherer), about 40 MB or more, once."""
    from data_prep import gather

    base = work / "gathered"
    if not base.exists():
        gather(base, 40 * 10**6)
    return base


def tokenizer_model(work: Path, vocab: int) -> Path:
    """The tiny model whose tokenizer builds the caches: the bundled tokenizer (1,024 tokens, trained on the demo
    corpus) by default; another --vocab is trained on the gathered text, which has the words to fill it."""
    from pipeline.prep.tiny import build_tiny

    model = work / ("model" if vocab == 1024 else f"model-{vocab}")
    if not (model / "config.json").exists():
        extra = {} if vocab == 1024 else {"corpus": gathered(work), "vocab_size": vocab}
        build_tiny(model, tied=True, **extra)
    return model


def corpus(work: Path, mb: int) -> Path:
    """work/text-MB: copies of the gathered real text until mb MB (each copy in its own folder)."""
    base = gathered(work)
    unit = sum(f.stat().st_size for f in base.rglob("*") if f.is_file())
    out = work / f"text-{mb}"
    if not out.exists():
        for k in range(-(-mb * 10**6 // unit)):
            shutil.copytree(base, out / f"copy-{k:03d}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "scaling")
    p.add_argument("--sizes", type=int, nargs="+", default=[40, 160, 320])
    p.add_argument("--num_proc", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024, help="the tokenizer's vocabulary (default: the bundled 1,024; "
                   "another is a byte-level BPE trained on the gathered text, 128000 for a Llama 3-sized one)")
    args = p.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = tokenizer_model(work, args.vocab)
    rows = []
    for mb in args.sizes:
        text = corpus(work, mb)
        size = sum(f.stat().st_size for f in text.rglob("*") if f.is_file()) / 1e6
        dataset, runs = work / f"dataset-{mb}", work / f"runs-{mb}"
        shutil.rmtree(dataset, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)
        prep_s, prep_anon, _ = timed([sys.executable, str(ROOT / "DATA-HF.py"), "--data-folder", str(text),
                                      "--save-dir", str(dataset), "--num-proc", str(args.num_proc)])
        cache_s, cache_anon, cache_pss = timed([sys.executable, str(ROOT / "fsdp1.py"), "-e", "scaling", "-d",
                                                str(dataset), "-m", str(model), "--save-dir", str(runs),
                                                "--seq-length", "1024", "--num-proc", str(args.num_proc),
                                                "--prepare-only"])
        rows.append([f"{size:.0f}", f"{prep_s:.1f}", f"{size / prep_s:.1f}", f"{prep_anon / 1e6:.0f}",
                     f"{cache_s:.1f}", f"{size / cache_s:.1f}", f"{cache_anon / 1e6:.0f}", f"{cache_pss / 1e6:.0f}"])
        shutil.rmtree(runs, ignore_errors=True)
        shutil.rmtree(dataset, ignore_errors=True)
    update_section("cache_scaling" + ("" if args.vocab == 1024 else f"_{args.vocab}"), "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/cache_scaling.py --sizes {' '.join(map(str, args.sizes))} --num_proc "
        f"{args.num_proc}{'' if args.vocab == 1024 else f' --vocab {args.vocab}'}`.",
        "- Text: real text gathered from this machine, copied to each size; DATA-HF.py to a dataset, then `fsdp1.py "
        f"--prepare-only` (a byte-level BPE tokenizer of {args.vocab:,} tokens, seq 1024); peak RssAnon summed over "
        "each command's processes (a forked worker's shared pages counted in each), and the token cache's peak "
        "Pss_Anon summed the same way (shared pages divided among the processes: the memory really held).",
        "",
        table(["MB of text", "DATA-HF s", "DATA-HF MB/s", "DATA-HF peak anon MB", "token cache s", "token cache MB/s",
               "token cache peak anon MB", "token cache peak PSS anon MB"], rows),
    ]))
    print("\n".join(" | ".join(r) for r in rows))


if __name__ == "__main__":
    main()
