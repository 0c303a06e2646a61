"""Hold the token cache's build lock for fsdp1.py's arguments, as a --prepare-only job on the same node would, until a
line arrives on stdin. Prints "locked PATH" once it holds it."""

import sys

from pipeline.offline import switch_offline

switch_offline()

from pipeline import config_merge as config_mod  # noqa: E402
from pipeline.data.token_cache import build_lock  # noqa: E402
from pipeline.train.blocks import cache_path  # noqa: E402
from pipeline.train.preflight import preflight  # noqa: E402

if __name__ == "__main__":
    cfg = config_mod.resolve(sys.argv[1:])
    path = cache_path(cfg, preflight(cfg))
    with build_lock(path):
        print(f"locked {path}", flush=True)
        sys.stdin.readline()
