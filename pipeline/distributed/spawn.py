"""`python fsdp1.py --nproc-per-node N ...`: one command that owns its workers on this node, through torch's elastic
launcher (the API torchrun itself is built on, as `accelerate launch` and `tune run` wrap it), so that what the user
sees is ours: a worker's error is our one line and its exit code (2 for a user error), a stop signal our stop line
and 128 + the signal, and nothing of the launcher's own (its failure report, its traceback, its warnings).

The parent has already run the workers' checks (the config, the model in the cache, the dataset) before this, so
the commonest mistakes are one line before any worker or rendezvous exists. Under plain torchrun none of this
applies: torchrun prints its own report around our line (README, "Launching").
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

from pipeline.errors import UserError, say

SHUTDOWN_S = 300
"""Seconds the workers get to finish their step and write their stop checkpoint after a signal before the launcher
kills them (torch's default is 30, less than a large model's checkpoint takes)."""


def nproc_arg(argv: list[str]) -> tuple[int | None, list[str]]:
    """--nproc-per-node N (or --nproc_per_node, =N) taken out of argv: (N or None, the rest)."""
    rest, nproc, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a number of processes, e.g. {name} 4")
                value, i = argv[i + 1], i + 1
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"{name} must be a whole number of processes, at least 1, got {value!r}")
            nproc = int(value)
        else:
            rest.append(arg)
        i += 1
    return nproc, rest


def run_workers(nproc: int, script: Path, argv: list[str]) -> int:
    """Start nproc workers running `script argv` on this node (a standalone rendezvous on a free port), wait for
    them, and turn how they ended into this process's exit code, printing only our own line."""
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # the level torch's elastic loggers take when they are made
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_S))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name in list(logging.Logger.manager.loggerDict):  # those made already: what they say is about themselves
        if name.startswith("torch.distributed.elastic"):  # (a worker's failure: its own line says why)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="fsdp1-launch-") as logs:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                              monitor_interval=0.1, start_method="spawn",
                              logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.NONE, tee=Std.NONE))
        try:
            elastic_launch(config, sys.executable)("-u", str(script), *argv)
        except SignalException as stop:  # the workers said their stop line; the launcher's own report is not ours
            return 128 + int(stop.sigval)
        except ChildFailedError as failed:
            return _first_failure(failed)
    return 0


def _first_failure(failed) -> int:
    """The first failing worker's line (from its error file, errors.say), printed once; its exit code. A worker that
    printed its own line (a lost peer) or a traceback (a bug) left no line of ours to repeat; one that stopped
    silently because another failed (errors.PeerFailed) left none, so the first worker with a line is the cause."""
    failure = failed.get_first_failure()[1]
    said = [f for f in failed.failures.values() if _said(f)]
    if said and failure.exitcode >= 0:  # (a worker the kernel killed first is the cause, line or not)
        failure = min(said, key=lambda f: f.timestamp)
    message = _said(failure)
    if message:
        say(message)
    if failure.exitcode < 0:  # killed by a signal it did not handle (the kernel's OOM killer sends SIGKILL)
        say(f"error: a worker was killed by signal {-failure.exitcode} ({failure.signal_name()}): if it was the "
            "out-of-memory killer, use a smaller -b or more --grad-accum; rerun the same command to resume")
        return 128 - failure.exitcode
    return failure.exitcode


def _said(failure) -> str:
    """A failed worker's line from its error file ("" without one)."""
    return failure.message.get("message", "") if isinstance(failure.message, dict) else ""
