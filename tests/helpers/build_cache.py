"""Build a token cache in this process, as fsdp1.py's builder does (for the kill-and-resume test).

    python tests/helpers/build_cache.py DATASET MODEL_DIR OUT CHUNK_BYTES
"""

import logging
import sys
from pathlib import Path

from transformers import AutoTokenizer

from pipeline.data import token_cache
from pipeline.data.dataset import BlockSpec, load_text_dataset

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dataset, model, out, chunk_bytes = sys.argv[1:]
    token_cache.CHUNK_BYTES = int(chunk_bytes)
    token_cache.build_blocks(load_text_dataset(dataset), AutoTokenizer.from_pretrained(model), BlockSpec(64, 0.1, 0), 1,
                             Path(out))
