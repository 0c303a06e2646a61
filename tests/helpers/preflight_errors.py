"""Preflight (fsdp1.py's checks before any process group) for several command lines in one process: a JSON list
of argument lists as the one argument; prints, per line, the one-line error each gives (or "ok") as JSON."""

import json
import sys

from pipeline.offline import switch_offline

switch_offline()  # as fsdp1.py does

from pipeline import config_merge  # noqa: E402
from pipeline.errors import UserError  # noqa: E402
from pipeline.strategies.registry import settle  # noqa: E402
from pipeline.train.preflight import preflight  # noqa: E402

for argv in json.loads(sys.argv[1]):
    try:
        preflight(settle(config_merge.resolve(argv)))
        print(json.dumps("ok"))
    except UserError as exc:
        print(json.dumps(str(exc)))
