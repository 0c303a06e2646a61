"""Signals: SIGTERM/SIGINT are noted by the handler and acted on at the next step boundary, where every rank agrees;
the run then saves a checkpoint and stops with `Interrupted`."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class Interrupted(Exception):
    """SIGTERM/SIGINT: a checkpoint was saved and the run stopped cleanly."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """Set by the signal handler; acted on at the next step boundary, where all ranks agree on it."""

    signum = 0

    @classmethod
    def install(cls) -> None:
        def handler(signum, _frame):
            cls.signum = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    @staticmethod
    def uninstall() -> None:
        """Python's own handling back: SIGINT raises KeyboardInterrupt, SIGTERM ends the process."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def agreed_stop() -> bool:
    """Whether any rank got a signal: one small all-reduce, so every rank gets the same answer (a collective: every
    rank calls it at the same point). For long phases between step boundaries (a reference pass, a validation)."""
    asked = torch.tensor([float(StopRequest.signum != 0)])
    dist.all_reduce(asked, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, no device sync
    return bool(asked.item())
