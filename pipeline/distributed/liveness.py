"""Noticing that the job has lost a process, and saying which: the launcher watchdog and the peer heartbeat.

Without them a lost node shows up as a raw backend traceback on every surviving rank (gloo: "Connection closed by
peer"), or, on NCCL, as a hang until the collective timeout. Here every rank beats a counter in the launcher's
key-value store (the TCPStore at MASTER_ADDR:MASTER_PORT that torchrun, srun and plain launches all start), and the
first rank of each node watches the next node's counters, so the store sees one read per rank per beat at any
scale. A counter that stops moving for `--peer-timeout-s` names its rank as lost; every rank reads that verdict at
its next beat and exits with it. A rank that finishes marks its counter done so it is never called lost; one that
fails with an error leaves its one-line reason, which its watcher passes on at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from pipeline.distributed.runtime import Dist

LOGGER = "pipeline"
"""The run's logger (train/telemetry.py gives it train.log), named here: this room comes before train/."""
DONE = -(1 << 40)
"""Added to a finished rank's counter: a negative counter is a rank that left on purpose."""


def watch_parent(interval_s: float = 1.0) -> None:
    """Under torchrun, exit when the launcher dies.

    A SIGKILLed torchrun agent cannot forward anything: its workers would sit in a collective until the timeout
    (an hour). A daemon thread notices the re-parenting and ends the process; collectives release the GIL, so it
    runs even while the main thread is blocked in one.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != launcher:
                os.write(2, f"rank {os.environ.get('RANK')}: launcher (pid {launcher}) died; exiting\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def is_collective_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank: DistBackendError, or gloo's plain RuntimeError when a peer's
    connection drops. The heartbeat, not this rank, can say what happened."""
    return isinstance(exc, dist.DistBackendError) or (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in ("gloo/transport", "Connection closed by peer",
                                                                       "Connection reset by peer")))


def watched_ranks(rank: int, world_size: int, local_world_size: int) -> list[int]:
    """What this rank watches: the first rank of each node watches every rank of the next node (ranks are numbered
    node by node, as torchrun and srun's block distribution do); on one node, its own other ranks; others, none."""
    if rank % local_world_size:
        return []
    nodes = max(world_size // local_world_size, 1)
    if nodes == 1:
        return [r for r in range(world_size) if r != rank]
    start = (rank // local_world_size + 1) % nodes * local_world_size
    return list(range(start, min(start + local_world_size, world_size)))


class PeerWatch:
    """The heartbeat of one rank (see the module docstring). start() after joining the process group; stop() on
    every rank before any rank exits, since one of them may host the store."""

    def __init__(self, d: Dist, timeout_s: float) -> None:
        self.d, self.timeout_s = d, timeout_s
        self.interval_s = min(max(timeout_s / 6, 0.2), 5.0)
        # torchrun's store outlives a restart of the workers: each attempt counts its own beats
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"fsdp1/peers/{attempt}/"
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self.watched = watched_ranks(d.rank, d.world_size, d.local_world_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.Store | None = None

    def start(self) -> PeerWatch:
        if self.timeout_s <= 0 or self.d.world_size == 1:
            return self
        # A client of its own (public API) rather than the process group's private store handle; same server.
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self._store.set(self._key("host", self.d.rank), socket.gethostname())
        self._thread = threading.Thread(target=self._run, name="peer-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, failure: str = "") -> None:
        """Mark this rank done (or failed, with the one line its watchers will print) and end the thread, so a
        store that goes away after this is no alarm."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(RuntimeError):  # the store is already gone: nobody is left to watch us
            if failure:
                self._store.set(self._key("failed", self.d.rank), failure)
            self._store.add(self._key("beat", self.d.rank), DONE)

    def failed_peer(self) -> tuple[str, bool] | None:
        """Another rank that has failed with an error of its own ("rank R failed: its line"), and whether it is on
        this node, whose console has its line already (None if none has, or nothing is watched): what a collective
        failing here is the echo of. One store read per rank."""
        if self._store is None:
            return None
        with contextlib.suppress(RuntimeError):  # the store is gone with its host: the heartbeat will say so
            for r in range(self.d.world_size):
                if r != self.d.rank and self._store.check([self._key("failed", r)]):
                    here = r // self.d.local_world_size == self.d.rank // self.d.local_world_size
                    return f"rank {r} failed: {self._store.get(self._key('failed', r)).decode()}", here
        return None

    def wait_for_verdict(self, give_up: Callable[[], bool]) -> None:
        """After a collective failed: give the heartbeat time to name the lost rank (it then ends the process
        itself) and return if it does not, or as soon as give_up() (e.g. the launcher is stopping us)."""
        deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if give_up():
                return
            time.sleep(0.1)

    def _key(self, kind: str, rank: int | str = "") -> str:
        return f"{self.prefix}{kind}/{rank}"

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self._key("beat", self.d.rank), 1)
                verdict = self._check_watched(seen)
                if verdict:
                    self._store.set(self._key("lost"), verdict)
                if self._store.check([self._key("lost")]):
                    self._exit(self._store.get(self._key("lost")).decode())
            except RuntimeError as exc:  # DistError and its kinds: the store is unreachable
                if self._stop.is_set():
                    return
                self._exit(f"lost the launcher's store at {self.address} ({type(exc).__name__}): the node that "
                           "hosts it (the first node: rank 0 or the rendezvous agent) is down or unreachable",
                           store_up=False)

    def _check_watched(self, seen: dict[int, tuple[int, float]]) -> str:
        """What is wrong with the watched ranks ("" if nothing): one that failed says why at once; one whose counter
        has not moved for timeout_s is lost. One store read per watched rank per beat."""
        now, lost = time.monotonic(), []
        for r in self.watched:
            count = self._store.add(self._key("beat", r), 0)
            if count < 0:
                if self._store.check([self._key("failed", r)]):
                    return f"rank {r} failed: {self._store.get(self._key('failed', r)).decode()}"
                continue
            if r not in seen or seen[r][0] != count:
                seen[r] = (count, now)
            elif now - seen[r][1] > self.timeout_s:
                lost.append(r)
        if not lost:
            return ""
        known = [r for r in lost if self._store.check([self._key("host", r)])]
        hosts = sorted({self._store.get(self._key("host", r)).decode() for r in known}) or ["an unknown host"]
        return (f"rank(s) {', '.join(map(str, lost))} on {', '.join(hosts)} stopped responding for "
                f"{self.timeout_s:g} s (a lost node or a killed process)")

    def _exit(self, why: str, store_up: bool = True) -> None:
        """End this process from the heartbeat thread: the main thread may be stuck in a collective that will only
        fail at the collective timeout (NCCL), so it cannot be asked. Its line is said unless a peer on this node
        failed and said why (store_up: the store can be asked which)."""
        line = (f"error: rank {self.d.rank}: {why}; exiting. Rerun the same command on every node to resume from the "
                "last complete checkpoint")
        failed = self.failed_peer() if store_up else None
        if not failed or not failed[1]:
            os.write(2, (line + "\n").encode())  # (a peer of this node that failed has said why on this console)
        record = logging.LogRecord(LOGGER, logging.ERROR, __file__, 0, line, None, None)
        for handler in logging.getLogger(LOGGER).handlers:  # the run's train.log too (the console has it already)
            if isinstance(handler, logging.FileHandler):
                with contextlib.suppress(Exception):  # a full disk: the line on stderr is what is left
                    handler.handle(record)
        os._exit(1)
