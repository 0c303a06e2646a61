"""The cost of the token-id check at start (token_cache.beyond_vocabulary): one rank's share of a 1 GiB train.npy
of uint32 ids, memory-mapped and in the page cache, with 1 and 2 ranks; then a cache with one bad id in its last block.

    PYTHONPATH=. .venv/bin/python bench/vocab_scan.py [WORKDIR]
"""

import shutil
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.data.token_cache import Blocks, beyond_vocabulary

VOCAB, SEQ = 128_256, 2048


def timed(blocks: Blocks, parts: int) -> tuple[float, str]:
    started = time.perf_counter()
    found = beyond_vocabulary(blocks, VOCAB, 0, parts)
    return time.perf_counter() - started, found


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".bench/vocab_scan")
    out.mkdir(parents=True, exist_ok=True)
    n = (1 << 30) // (4 * SEQ)
    ids = np.lib.format.open_memmap(out / "train.npy", mode="w+", dtype=np.uint32, shape=(n, SEQ))
    ids[:] = np.random.default_rng(0).integers(0, VOCAB, size=(n, SEQ), dtype=np.uint32)
    ids[n - 1, 5] = VOCAB + 1
    ids.flush()
    del ids
    blocks = Blocks(np.load(out / "train.npy", mmap_mode="r"), None, out)
    for parts in (1, 2):
        seconds = min(timed(blocks, parts)[0] for _ in range(3))
        print(f"{parts} rank(s): one rank's share of 1 GiB ({n} blocks of {SEQ}) in {seconds:.3f} s")
    print(f"the bad id found by one rank in {timed(blocks, 1)[0]:.3f} s")
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
