"""Run under torchrun with 2 ranks: the refusals every rank must agree on when the ranks see different things.
Which checkpoint to resume from (Checkpointer.choose) and its check (verify), as ranks on nodes with their own copy
of --save-dir would: rank N reads the run folder ROOT/CASE/rank-N for each case of ROOT/cases.json ({case:
--resume-from}). And the strategy --strategy auto resolved (case "strategy": ddp on rank 0, fsdp2 on rank 1, as
nodes with different memory could). Every rank's outcome ("ok" or the UserError's text) is gathered and rank 0
writes them to ROOT/outcomes.json.

    rank_views.py ROOT
"""

import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from pipeline.config_merge import from_flat
from pipeline.distributed.runtime import gather_objects, init_distributed
from pipeline.errors import UserError, run_cli
from pipeline.strategies.auto import check_agreed
from pipeline.strategies.registry import settle
from pipeline.train.checkpoint import Checkpointer


def outcome(check: Callable[..., object], *args: object) -> str:
    try:
        check(*args)
    except UserError as exc:
        return str(exc)
    return "ok"


def resume(ckpt: Checkpointer, resume_from: str) -> None:
    path = ckpt.choose(resume_from)
    if path is not None:
        ckpt.verify(path)


def main() -> None:
    # a rank left waiting in a collective the other never joins fails within the test's patience, not an hour
    d = init_distributed(timedelta(seconds=60))
    root = Path(sys.argv[1])
    outcomes = {}
    for case, resume_from in json.loads((root / "cases.json").read_text()).items():
        ckpt = Checkpointer(root / case / f"rank-{d.rank}", d, 2, False, {})
        outcomes[case] = outcome(resume, ckpt, resume_from)
    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": "m",
                            "strategy": "ddp" if d.rank == 0 else "fsdp2"}))
    outcomes["strategy"] = outcome(check_agreed, cfg, d)
    everyone = gather_objects(outcomes)
    if d.is_main:
        (root / "outcomes.json").write_text(json.dumps({case: [r[case] for r in everyone] for case in outcomes}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
