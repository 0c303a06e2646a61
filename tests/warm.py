"""The tests' side of the warm launcher (tests/helpers/warm_launcher.py): which runs start warm, the launchers of this
pytest process, and a started run handled as a subprocess.Popen of it is."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline.offline import SWITCHES as OFFLINE_SWITCHES  # what fsdp1.py sets before its first Hugging Face import

ROOT = Path(__file__).resolve().parents[1]

PER_RUN = ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
           "LOCAL_WORLD_SIZE")
"""Variables no import reads that differ between runs: left out of a launcher's key (a run sets torch's thread
count from the first itself; pytest sets the second per test; the launch variables are read when a run sets up its
process group, and torchrun's own workers, forks of a launcher that imported without them, get them the same way)."""
PER_RUN_PREFIXES = ("SLURM_",)
"""Families of per-run variables: srun's, which the launch reads as it reads torchrun's."""


def warm_launches() -> bool:
    """Whether torchrun() and run_script("fsdp1.py") start their runs warm: on Linux, without a GPU (a fork's CUDA is
    its own hazard, and a GPU machine's cores start a cold interpreter fast enough), unless FSDP1_TESTS_COLD=1 asks
    for cold starts."""
    cold = os.environ.get("FSDP1_TESTS_COLD") == "1"
    return sys.platform == "linux" and not os.path.exists("/dev/nvidiactl") and not cold


def kill_tree(proc) -> None:
    """SIGKILL a run started in a session of its own and everything under it: its process group, and torchrun's
    workers, which torchrun starts in sessions of their own (left alone they would run on until they notice the
    launcher is gone, still writing the run folder and holding its lock). Returns once every one of them is gone."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # it ended, and a warm run's parent (its keeper) reaped it at once
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def request(path: str, fds: list[int], argv: list[str], cwd: str, env: dict[str, str]) -> socket.socket:
    """Ask the warm launcher at path for `python ARGV` in cwd with env, its stdout and stderr the descriptors fds (the
    protocol of tests/helpers/warm_launcher.py); the connection its answers come on (WarmProcess reads them)."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    socket.send_fds(conn, [b"F"], fds)
    conn.sendall(json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode() + b"\n")
    return conn


class WarmLaunchers:
    """This pytest process's warm launchers, one per environment a run's imports would see (a library reads some
    variables while importing, which a fork cannot change afterwards); the least recently used beyond MAX stopped."""

    MAX = 5
    """About 500 MB each. The hub and data tests start one per test (an HF_HOME of their own each): with room for a
    few of them beside the training runs' launchers, theirs is not the one stopped and started again."""

    def __init__(self):
        self.servers: dict[tuple, tuple[subprocess.Popen, str]] = {}

    def server(self, env: dict[str, str]) -> str:
        import tempfile

        key = tuple(sorted(env.items()))
        if key in self.servers:
            self.servers[key] = self.servers.pop(key)  # most recently used last
            return self.servers[key][1]
        while len(self.servers) >= self.MAX:
            self.stop(next(iter(self.servers)))
        path = str(Path(tempfile.mkdtemp(prefix="warm-")) / "socket")
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "warm_launcher.py"), path],
                                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n", "the warm launcher did not start"
        self.servers[key] = (proc, path)
        return path

    def stop(self, key: tuple) -> None:
        import shutil

        proc, path = self.servers.pop(key)
        proc.kill()
        proc.wait()
        shutil.rmtree(Path(path).parent, ignore_errors=True)

    def close(self) -> None:
        while self.servers:
            self.stop(next(iter(self.servers)))

    def stop_naming(self, folder: str) -> None:
        """Stop the launchers whose environment names folder (a test's own HF_HOME, say): no later test can use
        them, and left to the least-recently-used rule they would push out a launcher that later tests do use."""
        for key in [k for k in self.servers
                    if any(value == folder or value.startswith(folder + os.sep) for _, value in k)]:
            self.stop(key)

    @staticmethod
    def imports_see(env: dict[str, str], offline: bool) -> dict[str, str]:
        """What a run's imports read of env (a launcher's key); offline: the script sets the offline switches before
        it imports a Hugging Face library, as fsdp1.py does."""
        seen = {k: v for k, v in env.items() if k not in PER_RUN and not k.startswith(PER_RUN_PREFIXES)}
        if offline:
            seen.update(dict.fromkeys(OFFLINE_SWITCHES, "1"))
        return seen

    def running(self, env: dict[str, str], offline: bool) -> bool:
        """Whether a launcher for this environment is up (a run under it starts warm without starting one)."""
        return tuple(sorted(self.imports_see(env, offline).items())) in self.servers

    def start(self, argv: list[str], env: dict[str, str], offline: bool, stdout=None, stderr=None,
              cwd: str | Path = ROOT) -> WarmProcess:
        """`python ARGV` in cwd (the repository unless given) with env, in a session of its own, as
        subprocess.Popen(text=True) would start it (stdout and stderr: None, DEVNULL, PIPE, STDOUT for stderr, or an
        open file). offline: the script sets the offline switches before it imports a Hugging Face library, as
        fsdp1.py does."""
        path = self.server(self.imports_see(env, offline))
        pipes, theirs = {}, []
        for name, target in (("stdout", stdout), ("stderr", stderr)):
            if target is subprocess.STDOUT:
                theirs.append(theirs[0])
            elif target is subprocess.PIPE:
                pipes[name], write = os.pipe()
                theirs.append(write)
            elif target is subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_WRONLY))
            else:
                theirs.append(os.dup(target.fileno() if target is not None else len(theirs) + 1))
        conn = request(path, theirs, argv, str(cwd), env)
        for fd in set(theirs):
            os.close(fd)
        return WarmProcess([sys.executable, *argv], conn, pipes)

    def run(self, argv: list[str], env: dict[str, str], timeout: float, offline: bool) -> subprocess.CompletedProcess:
        """As subprocess.run(capture_output=True, text=True, timeout=timeout) reports `python ARGV`: the output read
        to its end (a worker that outlives its launcher holds it open, as it would a cold run's), then the exit."""
        proc = self.start(argv, env, offline, subprocess.PIPE, subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout)
        except BaseException:  # a timeout, or Ctrl-C: nothing of the run is left behind, as subprocess.run does
            kill_tree(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class WarmProcess:
    """A run a warm launcher started, handled as a subprocess.Popen(text=True) of it is (pid: the run's own, the
    leader of its session, torchrun's workers its children; the exit status comes from its keeper, its parent)."""

    def __init__(self, args: list[str], conn: socket.socket, pipes: dict[str, int]):
        self.args, self.conn, self.returncode, self.buffer = args, conn, None, b""
        self.pid = self.message(None)["pid"]
        self.stdout, self.stderr = (open(pipes[n], errors="backslashreplace") if n in pipes else None  # noqa: SIM115
                                    for n in ("stdout", "stderr"))

    def message(self, timeout: float | None) -> dict:
        """The keeper's next line; TimeoutExpired where none comes within timeout seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not readable([self.conn], left):
                raise subprocess.TimeoutExpired(self.args, timeout)
            more = self.conn.recv(1 << 16)
            if not more:
                raise RuntimeError(f"the warm launcher ended before it reported on {self.args}")
            self.buffer += more
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.message(timeout)["returncode"]
            self.conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read stdout and stderr (those that are pipes) to their end, then wait, within timeout seconds in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {s.fileno(): s for s in (self.stdout, self.stderr) if s is not None}
        chunks: dict[int, list[bytes]] = {fd: [] for fd in streams}
        open_fds = set(streams)
        while open_fds:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = readable(list(open_fds), left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.discard(fd)
        out, err = (b"".join(chunks[s.fileno()]).decode(errors="backslashreplace") if s is not None else None
                    for s in (self.stdout, self.stderr))
        for stream in streams.values():
            stream.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out, err


def readable(fds: list, timeout: float | None) -> list:
    """Those of fds (descriptors or objects with fileno()) readable or at their end within timeout seconds (None: no
    limit). poll, not select: select() takes no descriptor numbered 1024 or more, which a pytest worker reaches when
    process groups its earlier tests built wait for the garbage collector to close their sockets."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)}
    return [fd for fd in fds if (fd if isinstance(fd, int) else fd.fileno()) in ready]


WARM = WarmLaunchers()
