"""The run folder: its name (`--no-resume` picks a new one), its checks, its logs and the config it records."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from pipeline import config_merge as config_mod
from pipeline.config import Config
from pipeline.distributed.runtime import Dist, check_shared_dir
from pipeline.errors import UserError
from pipeline.folder_lock import hold
from pipeline.fsutil import write_text_atomic
from pipeline.ownership import mark
from pipeline.train.export import RUN_TEMPLATE
from pipeline.train.preflight import Plan
from pipeline.train.telemetry import log, setup_logging

LOCK = ".lock"
"""RUN/.lock: held by rank 0 of the job training in the folder (pipeline/folder_lock.py)."""


def new_run_name(cfg: Config, d: Dist) -> Config:
    """--no-resume on an existing run: rank 0 picks NAME-2, NAME-3, ... and tells the others; a new Config. A
    collective."""
    box = [cfg.run.experiment_name]
    if d.is_main and cfg.run_dir.exists():
        k = 2
        while (Path(cfg.run.save_dir) / f"{cfg.run.experiment_name}-{k}").exists():
            k += 1
        box[0] = f"{cfg.run.experiment_name}-{k}"
        log.warning("--no-resume: starting a new run %s; %s is kept as it is", box[0], cfg.run_dir)
    dist.broadcast_object_list(box, src=0)
    return replace(cfg, run=replace(cfg.run, experiment_name=box[0], no_resume=False))


def lock_run_dir(cfg: Config, d: Dist) -> None:
    """Rank 0 holds the run folder's lock until it exits; another job on the same folder (a second submission, a
    rerun while the first still runs) is refused on every rank, before it writes anything there. A collective."""
    busy = [hold(cfg.run_dir / LOCK, "fsdp1.py") if d.is_main else ""]
    dist.broadcast_object_list(busy, src=0)
    if busy[0]:
        raise UserError(f"{cfg.run_dir} is in use by {busy[0]}; wait for it to end (rerunning the same command then "
                        "resumes), or give this run another --experiment-name")


def open_run_dir(cfg: Config, d: Dist, plan: Plan) -> Config:
    """Create (or reopen) the run folder on storage every rank sees, start its log, and record the config and chat
    template. Returns the config with the run's final name. A collective."""
    if cfg.run.no_resume:
        cfg = new_run_name(cfg, d)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(cfg, d)
    check_shared_dir(cfg.run_dir, d, "--save-dir")
    setup_logging(cfg.run_dir, d.rank)
    if d.is_main:
        mark(cfg.run_dir, "run", "fsdp1.py")
        config_mod.save(cfg, cfg.run_dir / "config.yaml")
        if plan.spec.chat_template:  # pipeline.export of any of the run's checkpoints carries it too
            write_text_atomic(cfg.run_dir / RUN_TEMPLATE, plan.spec.chat_template)
        log.info("run directory %s (world size %d, device %s)", cfg.run_dir, d.world_size, d.device)
    return cfg
