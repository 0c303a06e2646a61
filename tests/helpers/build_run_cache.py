"""Build the token cache of fsdp1.py's arguments as a run's builder does (pipeline.train.blocks.ensure_blocks, with
fsdp1.py's signal handling), with text chunks of CHUNK_BYTES so a small corpus makes many: for the stop test.

    python tests/helpers/build_run_cache.py CHUNK_BYTES FSDP1_ARGS...
"""

import logging
import sys

from pipeline.offline import switch_offline

switch_offline()

from pipeline import config_merge as config_mod  # noqa: E402
from pipeline.data import token_cache  # noqa: E402
from pipeline.signals import Interrupted, StopRequest  # noqa: E402
from pipeline.train.blocks import ensure_blocks  # noqa: E402
from pipeline.train.preflight import preflight  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    token_cache.CHUNK_BYTES = int(sys.argv[1])
    cfg = config_mod.resolve(sys.argv[2:])
    plan = preflight(cfg)
    StopRequest.install()
    try:
        ensure_blocks(cfg, plan, True)
    except Interrupted as stop:
        sys.exit(128 + stop.signum)
