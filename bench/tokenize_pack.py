"""Tokenize + pack (fsdp1.py's token cache) against the raw fast tokenizer's batch encode of the same text.

The text: a DATA-HF dataset of real text gathered from this machine (bench/data_prep.py's gatherer). Ours:
pipeline.data.token_cache.build_blocks (datasets.map with num_proc in chunks, EOS appended, streamed into blocks, split,
saved). The limit: a fork pool of the same number of processes, each encoding batches of 1,000 rows with the same
tokenizer (add_special_tokens=False) and doing nothing else. Rust-side parallelism is off in both
(TOKENIZERS_PARALLELISM=false), so each process uses one core. Runs alternate.

    .venv/bin/python bench/tokenize_pack.py --num_proc 2 --target_mb 20 --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import time
from pathlib import Path

from common import ROOT, bar_chart, machine, spread, table, update_section

os.environ["TOKENIZERS_PARALLELISM"] = "false"
_STATE: dict = {}


def _encode(span: tuple[int, int]) -> int:
    texts = _STATE["ds"][span[0]:span[1]]["text"]
    return sum(len(ids) for ids in _STATE["tok"](texts, add_special_tokens=False)["input_ids"])


def encode_limit(ds, tokenizer, num_proc: int) -> float:
    _STATE.update(ds=ds, tok=tokenizer)  # inherited by the forked workers
    spans = [(i, min(i + 1000, len(ds))) for i in range(0, len(ds), 1000)]
    start = time.perf_counter()
    with mp.get_context("fork").Pool(num_proc) as pool:
        sum(pool.imap_unordered(_encode, spans))
    return time.perf_counter() - start


def ours(ds, tokenizer, num_proc: int, out: Path) -> float:
    from pipeline.data.dataset import BlockSpec
    from pipeline.data.token_cache import build_blocks

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    build_blocks(ds, tokenizer, BlockSpec(1024, 0.01, 0), num_proc, out)
    return time.perf_counter() - start


def main() -> None:
    from data_prep import gather
    from datasets import disable_progress_bars, load_from_disk

    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.prep.tiny import DEFAULT_CORPUS, corpus_texts, train_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "tokenize")
    p.add_argument("--num_proc", type=int, default=2)
    p.add_argument("--target_mb", type=float, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    disable_progress_bars()
    work = args.workdir
    if not (work / "dataset").exists():
        gather(work / "corpus", int(args.target_mb * 1e6))
        build_dataset(CorpusConfig(work / "corpus", work / "dataset", num_proc=args.num_proc))
    ds = load_from_disk(str(work / "dataset"))
    tokenizer = train_tokenizer(corpus_texts(DEFAULT_CORPUS), 1024)  # the tiny and bench models' tokenizer
    mb = sum(len(t.encode()) for t in ds["text"]) / 1e6
    limit, mine = [], []
    for _ in range(args.repeats):
        limit.append(encode_limit(ds, tokenizer, args.num_proc))
        mine.append(ours(ds, tokenizer, args.num_proc, work / "blocks"))
    ratio = statistics.median(limit) / statistics.median(mine)
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/tokenize_pack.py --num_proc {args.num_proc} --target_mb "
        f"{args.target_mb:g} --repeats {args.repeats}` (part of `make bench`).",
        f"- Text: {len(ds):,} rows, {mb:.1f} MB of UTF-8; the bench model's byte-level BPE tokenizer (1,024 "
        "entries, trained on the demo corpus); seq length 1024.",
        "",
        table(["", "seconds", "MB/s"],
              [["raw batch encode (limit)", spread(limit, 2), f"{mb / statistics.median(limit):.1f}"],
               ["tokenize + pack + save (ours)", spread(mine, 2), f"{mb / statistics.median(mine):.1f}"]]),
        "",
        f"Ratio: **{ratio:.2f}** of the limit (target 0.8).",
        "",
        bar_chart("tokenize_pack_cpu", "Tokenize + pack against raw batch encode (MB/s, higher is better)",
                  ["raw batch encode", "tokenize + pack (ours)"],
                  [mb / statistics.median(limit), mb / statistics.median(mine)], "MB/s"),
    ])
    update_section("tokenize_cpu", body)
    print(body)


if __name__ == "__main__":
    main()
