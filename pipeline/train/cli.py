"""fsdp1.py's command line: the config resolved and checked, preflight, the process group and liveness, the run, and
its failures mapped to one line (exit 2) or a clean stop's exit code."""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import config_merge as config_mod
from pipeline.config import Config
from pipeline.distributed.launch import Launch
from pipeline.distributed.launch import detect as detect_launch
from pipeline.distributed.liveness import PeerWatch, is_collective_failure, watch_parent
from pipeline.distributed.runtime import Dist, init_distributed
from pipeline.distributed.spawn import nproc_arg, run_workers
from pipeline.errors import PeerFailed, UserError, first_line, naming
from pipeline.eval.harness import Tasks, check_tasks
from pipeline.signals import Interrupted, StopRequest
from pipeline.strategies.auto import check_agreed
from pipeline.strategies.registry import out_of_memory_hints, settle
from pipeline.train.blocks import prepare_only
from pipeline.train.export import described
from pipeline.train.lm_eval_run import run_at_end
from pipeline.train.preflight import Plan, preflight
from pipeline.train.rundir import open_run_dir
from pipeline.train.telemetry import log
from pipeline.train.trainer import Trainer

SCRIPT = Path(__file__).resolve().parents[2] / "fsdp1.py"
"""What --nproc-per-node's workers run."""


def run(cfg: Config, d: Dist, plan: Plan) -> Trainer:
    """Set up the run directory and logs, then train."""
    check_agreed(cfg, d)
    cfg = open_run_dir(cfg, d, plan)
    StopRequest.install()
    trainer = Trainer(cfg, d, plan)
    trainer.fit()
    dist.barrier()  # no rank tears the group down while another still has collectives in flight
    if d.is_main:
        log.info("done: %s, metrics %s, plot %s, log %s", described(cfg), cfg.run_dir / "metrics.jsonl",
                 cfg.run_dir / "loss.png", cfg.run_dir / "train.log")
    return trainer


def out_of_memory_message(cfg: Config, d: Dist) -> str:
    """What to change when a step does not fit (NCCL reports the same failure as an 'unhandled cuda error')."""
    return (f"rank {d.rank} ran out of {d.device.type.upper()} memory at batch {cfg.train.batch_size} x seq "
            f"{cfg.data.seq_length}; {out_of_memory_hints(cfg)}; the last complete checkpoint (if any) resumes with "
            "the same command")


def main(argv: list[str] | None = None) -> int:
    """fsdp1.py: resolve the config, check everything cheap, then join the process group and train; with
    --nproc-per-node N, check, then start N workers that do (pipeline/distributed/spawn.py)."""
    nproc, argv = nproc_arg(sys.argv[1:] if argv is None else list(argv))
    cfg = settle(config_mod.resolve(argv))
    launch = detect_launch()  # a launcher's missing variable is one line before any heavy work
    if nproc is not None:
        if launch.launcher != "single":
            raise UserError(f"--nproc-per-node starts its own workers: run it as a plain command, not under "
                            f"{launch.launcher} (which starts them already)")
        launch = Launch("spawn", 0, nproc, 0, nproc, "127.0.0.1", 0)
    tasks = None if cfg.data.prepare_only else Tasks.of(cfg.train)
    if tasks is not None:  # on every rank, as preflight: one refusing alone would leave the others at the rendezvous
        check_tasks(tasks)
    plan = preflight(cfg, launch)
    cfg = plan.config  # --strategy auto resolved
    if cfg.data.prepare_only:
        return prepare_only(cfg, plan, launch)
    if nproc is not None:  # every check passed here: the workers redo them (cheaply) and train
        return run_workers(nproc, SCRIPT, argv)
    d = init_distributed(timedelta(seconds=cfg.run.collective_timeout_s))
    watch_parent()
    peers = PeerWatch(d, cfg.run.peer_timeout_s).start()
    try:
        code = train_or_stop(cfg, d, plan, peers)
    except BaseException as exc:
        if not is_collective_failure(exc) and not isinstance(exc, PeerFailed):  # its own, not another's echo
            peers.stop(failure=first_line(exc))
        # No destroy_process_group here: another rank may still be inside a collective, and tearing the group down
        # under it can block this rank (torchtitan#1342). fsdp1.py leaves without finalization (errors.leave).
        raise
    peers.stop()
    dist.barrier()  # every rank's heartbeat has stopped before any rank (one may host the store) exits
    dist.destroy_process_group()
    if code == 0 and tasks is not None and d.is_main and not StopRequest.signum:  # not after a stop was asked for
        StopRequest.uninstall()  # training is over: a signal now ends the scoring at once, not at a step boundary
        run_at_end(cfg, plan, tasks, d)
    return code


def _raised_at(exc: BaseException) -> str:
    """Where an exception was raised: the innermost frame's file and line."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"


def train_or_stop(cfg: Config, d: Dist, plan: Plan, peers: PeerWatch) -> int:
    """run(), its clean stop as an exit code, and its failures as one line where we can say what happened."""
    try:
        with naming(cfg.run_dir, unnamed_only=True):  # a write naming no file (transformers' JSON) is the run's
            run(cfg, d, plan)
    except Interrupted as stop:
        return 128 + stop.signum
    except SystemExit as exc:  # code of the user's, or a library's, ending the process mid-run: never exit 0
        raise UserError(f"the run was ended by {exc!r} raised at {_raised_at(exc)}, before it finished; it exits "
                        "with an error (a rerun of the same command resumes from the last checkpoint)") from None
    except torch.OutOfMemoryError:
        raise UserError(out_of_memory_message(cfg, d)) from None
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        if "out of memory" in str(exc):  # NCCL's report of a CUDA OOM
            raise UserError(out_of_memory_message(cfg, d)) from None
        if failed := peers.failed_peer():  # the echo of a peer's own failure: its line is the whole story
            line, here = failed
            raise PeerFailed("" if here else f"rank {d.rank}: stopped because {line}") from None
        # Most often a peer died: the heartbeat names it and ends the process; a launcher that is already
        # stopping us (another worker failed on this node) needs no wait
        peers.wait_for_verdict(give_up=lambda: StopRequest.signum != 0)
        raise
    return 0
