"""A warm launcher for the tests' torchrun runs: one process per pytest worker (and per environment) that has imported
torch, transformers, datasets, peft and the pipeline once, then runs each `python -m torch.distributed.run ARGS` it
is asked for in a fork of itself, whose workers are forks too. What runs is torchrun's own agent and the script's own
entry (`fsdp1.py` as `__main__`); only the interpreter start and the imports (about 4.4 s of a worker's 6-7 s of CPU
here) are skipped.

What a fork must undo to look like a fresh interpreter, each done below where it happens: the caller's environment,
working folder, standard streams (unbuffered, as torchrun's `python -u`) and session; sys.argv and sys.path[0];
signal handlers back to a fresh interpreter's; torch's thread count from OMP_NUM_THREADS (read once, at import);
and at the end the interpreter's own exit (non-daemon threads joined, atexit handlers, streams flushed).

What a fork cannot undo is what a library read from the environment while importing (HF_HOME, the offline switches,
...): so a warm process serves one environment only, the one it imported under, and the client (conftest.WARM)
starts one per distinct environment; OMP_NUM_THREADS alone is left out of that, each run setting torch's thread count
from it. Nor can it change what /proc/PID/environ shows (the launcher's environment, not the run's): a test that
reads another process's environment there starts that run cold.

Protocol on a UNIX socket: the run's stdout and stderr descriptors (SCM_RIGHTS), then a JSON line {"argv" (the
interpreter's arguments: `-m MODULE ...` or `SCRIPT ...`), "cwd", "env"}; answered by {"pid"} (the run, leader of a
session of its own) and, once it has ended, {"returncode"} (negative: killed by that signal).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback

FRESH_SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}
"""Handlers a fresh CPython installs itself (every other signal starts at SIG_DFL)."""


DEFAULT_THREADS = 0
"""torch's thread count with OMP_NUM_THREADS unset, as this process imported it (set in __main__)."""


def preload() -> None:
    """What a training worker imports, imported once here (the pipeline's own modules through its entry's)."""
    import datasets  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import pipeline.train.cli  # noqa: F401


def fresh_process(env: dict[str, str], cwd: str | None = None) -> None:
    """In a fork: the environment, folder and signal handlers a newly started interpreter would have."""
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if signal.getsignal(sig) not in (signal.SIG_DFL, None, FRESH_SIGNALS.get(sig, signal.SIG_DFL)):
                signal.signal(sig, FRESH_SIGNALS.get(sig, signal.SIG_DFL))
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    import torch  # it read OMP_NUM_THREADS once, at import, where this process's environment had none

    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(max(1, int(threads)) if threads.isdigit() else DEFAULT_THREADS)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    for fd, name in ((1, "stdout"), (2, "stderr")):  # unbuffered, as `python -u`
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                  errors="backslashreplace" if fd == 2 else "strict")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_as_main(argv: list[str], module: bool = False) -> int:
    """Run a script (or `-m` module) as `__main__` with argv, ending as the interpreter would: its exit code."""
    import runpy

    sys.argv = list(argv)
    sys.path[0] = "" if module else os.path.dirname(os.path.abspath(argv[0]))
    code = 0
    try:
        if module:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    return finish(code)


def finish(code: int) -> int:
    """The interpreter's own shutdown, then exit: non-daemon threads joined, atexit handlers run, streams flushed."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the interpreter's own exit runs them; os._exit below would not
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:  # died of a signal it did not handle, as CPython re-raises an uncaught SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


class WarmPopen(subprocess.Popen):
    """torchrun's worker start (`python -u SCRIPT ARGS`) as a fork of this warm process; any other command is
    started as usual. The worker is torchrun's child in a session of its own, as a started one is, so the agent's
    signals, waits and kills reach it unchanged."""

    def _execute_child(self, *args, **kwargs):
        bound = inspect.signature(super()._execute_child).bind(*args, **kwargs)
        a = bound.arguments
        argv = [str(x) for x in a["args"]]
        if not (len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-u" and argv[2].endswith(".py")):
            return super()._execute_child(*args, **kwargs)
        pid = os.fork()
        if pid == 0:
            try:
                if a["start_new_session"]:
                    os.setsid()
                for fd, target in ((a["p2cread"], 0), (a["c2pwrite"], 1), (a["errwrite"], 2)):
                    if fd != -1 and fd != target:
                        os.dup2(fd, target)
                fresh_process(dict(a["env"]) if a["env"] is not None else dict(os.environ), a["cwd"])
                run_as_main(argv[2:])
            finally:
                os._exit(1)  # run_as_main exits itself; this is reached only if setting up the fork failed
        self.pid, self._child_created = pid, True
        for mine, theirs in ((a["p2cread"], a["p2cwrite"]), (a["c2pwrite"], a["c2pread"]),
                             (a["errwrite"], a["errread"])):
            if mine != -1 and theirs != -1 and mine != getattr(self, "_devnull", None):
                os.close(mine)
        if hasattr(self, "_devnull"):
            os.close(self._devnull)
        self._closed_child_pipe_fds = True


def agent(request: dict, out: int, err: int) -> None:
    """In a fork: the requested run (torchrun's agent, or a script), its workers forks of this process, its stdout
    and stderr the descriptors the caller passed."""
    os.setsid()
    for fd, target in ((out, 1), (err, 2)):
        os.dup2(fd, target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (out, err, null):
        os.close(fd)
    fresh_process(request["env"], request["cwd"])
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess_handler.Popen = WarmPopen  # torchrun's workers, and those fsdp1.py --nproc-per-node starts
    argv = request["argv"]
    if argv[0] == "-m":
        run_as_main(argv[1:], module=True)
    run_as_main(argv)


def serve(path: str) -> None:
    """Each request in a keeper of its own (a fork that starts the run and waits on it), so that runs overlap as
    started ones do: a test's second job while its first still runs."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers reap themselves
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                keep(conn)
            finally:
                os._exit(0)
        conn.close()


def keep(conn: socket.socket) -> None:
    """Start the run conn asks for and report its pid, then how it ended."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 2)  # the run's stdout and stderr, then the request
    stream = conn.makefile("rw")
    line = stream.readline()
    if len(fds) != 2 or not line:
        return
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        conn.close()
        try:
            agent(request, *fds)
        except BaseException:  # noqa: BLE001 - said on the run's stderr, which the caller reads
            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    stream.write(json.dumps({"pid": pid}) + "\n")
    stream.flush()
    _, status = os.waitpid(pid, 0)
    stream.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    stream.flush()


if __name__ == "__main__":
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the pytest worker that started it
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    preload()
    import torch

    DEFAULT_THREADS = torch.get_num_threads()
    serve(sys.argv[1])
