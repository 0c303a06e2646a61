"""Run under torchrun with 2 ranks: which checkpoint to resume from (Checkpointer.choose) and its check (verify)
when the ranks see different files, as ranks on nodes with their own copy of --save-dir would. Rank N reads the run
folder ROOT/rank-N; for each case named in ROOT/cases.json ({case: --resume-from}), every rank's outcome ("ok" or the
UserError's text) is gathered and rank 0 writes them to ROOT/outcomes.json.

    rank_views.py ROOT
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from pipeline.dist.runtime import init_distributed
from pipeline.errors import UserError
from pipeline.train.checkpoint import Checkpointer


def outcome(ckpt: Checkpointer, resume_from: str) -> str:
    try:
        path = ckpt.choose(resume_from)
        if path is not None:
            ckpt.verify(path)
    except UserError as exc:
        return str(exc)
    return "ok"


def main() -> None:
    # a rank left waiting in a collective the other never joins fails within the test's patience, not an hour
    d = init_distributed(timedelta(seconds=60))
    root = Path(sys.argv[1])
    outcomes = {}
    for case, resume_from in json.loads((root / "cases.json").read_text()).items():
        ckpt = Checkpointer(root / case / f"rank-{d.rank}", d, 2, False, {})
        everyone = [None] * d.world_size
        dist.all_gather_object(everyone, outcome(ckpt, resume_from))
        outcomes[case] = everyone
    if d.is_main:
        (root / "outcomes.json").write_text(json.dumps(outcomes))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
