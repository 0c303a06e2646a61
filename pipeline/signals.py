"""Signals: SIGTERM/SIGINT are noted by the handler and acted on at the next point where every rank agrees (a step
boundary, or inside a long phase: a generation's token, a reference pass's or validation's round); the run then
saves a checkpoint and stops with `Interrupted`. The user's own code (a reward function) is the exception: a signal
while it runs interrupts it at once, as it may never return (pipeline/rl/user_code.py)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist


class Interrupted(Exception):
    """SIGTERM/SIGINT: a checkpoint was saved and the run stopped cleanly."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(Exception):
    """A long phase (a generation, a validation, the rewards) was abandoned at a point every rank agreed on because a
    signal asked for it: nothing of it counts. The message says where ("during generation")."""


class SignalInUserCode(BaseException):  # noqa: N818 - a BaseException, so the user's `except Exception` lets it by
    """Raised by the signal handler inside StopRequest.interrupting(): the user's code was cut short."""


class StopRequest:
    """Set by the signal handler; acted on where all ranks agree on it."""

    signum = 0
    interrupting_now = False
    """Inside StopRequest.interrupting(): the handler raises SignalInUserCode as well."""

    @classmethod
    def install(cls) -> None:
        def handler(signum, _frame):
            cls.signum = signum
            if cls.interrupting_now:
                cls.interrupting_now = False  # once: the user's `finally` may take its time
                raise SignalInUserCode(signal.Signals(signum).name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    @staticmethod
    def uninstall() -> None:
        """Python's own handling back: SIGINT raises KeyboardInterrupt, SIGTERM ends the process."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    @classmethod
    @contextlib.contextmanager
    def interrupting(cls) -> Iterator[None]:
        """Around code that may never return (the user's): a stop signal, or one already noted, raises
        SignalInUserCode in it at once."""
        if cls.signum:
            raise SignalInUserCode(signal.Signals(cls.signum).name)
        cls.interrupting_now = True
        try:
            yield
        finally:
            cls.interrupting_now = False


def agreed_stop() -> bool:
    """Whether any rank got a signal: one small all-reduce, so every rank gets the same answer (a collective: every
    rank calls it at the same point). For long phases between step boundaries (a reference pass, a validation).
    Without a process group (pipeline.evaluate in one process), this process's own."""
    asked = torch.tensor([float(StopRequest.signum != 0)])
    if dist.is_initialized():
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, no device sync
    return bool(asked.item())
