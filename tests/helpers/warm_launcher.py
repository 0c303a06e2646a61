"""A warm launcher for the tests' torchrun runs: one process per pytest worker (and per environment) that has imported
torch, transformers, datasets, peft and the pipeline once, then runs each `python -m torch.distributed.run ARGS` it
is asked for in a fork of itself, whose workers are forks too. What runs is torchrun's own agent and the script's own
entry (`fsdp1.py` as `__main__`); only the interpreter start and the imports (about 4.4 s of a worker's 6-7 s of CPU
here) are skipped.

What a fork must undo to look like a fresh interpreter, each done below where it happens: the caller's environment,
working folder, standard streams (buffered as a started interpreter's; unbuffered for torchrun's `python -u`
workers) and session; sys.argv and sys.path[0]; signal handlers back to those this process started with; torch's
thread count from OMP_NUM_THREADS (read once, at import); and at the end the interpreter's own exit (threading's
shutdown, atexit handlers, Python's and C's stdio flushed).

What a fork cannot undo is what a library read from the environment while importing (HF_HOME, the offline switches,
...): so a warm process serves one environment only, the one it imported under, and the client (tests/warm.py)
starts one per distinct environment; OMP_NUM_THREADS alone is left out of that, each run setting torch's thread count
from it. Nor can it change what /proc/PID/environ shows (the launcher's environment, not the run's): a test that
reads another process's environment there starts that run cold. Nor the string-hash seed: every rank of a warm run
hashes alike, so ranks that disagree only through set or dict order of strings would agree here; the suite's cold
multi-rank runs (the two-node and torchrun-restart tests, the GPU check's rehearsal) keep
that case covered. Descriptors the agent holds (its store's listening socket) stay open in its workers, where
close_fds would shut them: closing them under live Python objects could later close a reused number instead.

Protocol on a UNIX socket: the run's stdout and stderr descriptors (SCM_RIGHTS), then a JSON line {"argv" (the
interpreter's arguments: `-m MODULE ...`, `-c CODE ...` or `SCRIPT ...`), "cwd", "env"}; answered by {"pid"} (the
run, leader of a session of its own) and, once it has ended, {"returncode"} (negative: killed by that signal).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
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
import warnings
from typing import NoReturn

FRESH_HANDLERS: dict[int, object] = {}
"""Signal -> handler as this process had them when it started: what a fresh interpreter started by the same parent
has (set in __main__, before anything is imported; SIGXFSZ ignored and SIGINT's KeyboardInterrupt included)."""

FRESH_STREAMS: dict[str, tuple[str, str]] = {}
"""stdout and stderr -> (encoding, errors) as this process started with them, under the same environment."""

DEFAULT_THREADS = 0
"""torch's thread count with OMP_NUM_THREADS unset, as this process imported it (set in __main__)."""


def preload() -> None:
    """What a training worker and torchrun's agent import, imported once here (the pipeline's own modules through its
    entry's)."""
    import datasets  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.models.llama import modeling_llama  # noqa: F401

    import pipeline.prep.corpus  # noqa: F401 - DATA-HF.py's
    import pipeline.prep.hub  # noqa: F401 - MODEL_DOWNLOAD.py's
    import pipeline.train.cli  # noqa: F401

    get_checkpoint_conversion_mapping("llama")  # transformers builds its table of every family's once, on first use


def remember_fresh_state() -> None:
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            FRESH_HANDLERS[sig] = signal.getsignal(sig)
    for name in ("stdout", "stderr"):
        FRESH_STREAMS[name] = (getattr(sys, name).encoding, getattr(sys, name).errors)


def fresh_process(env: dict[str, str], cwd: str | None, unbuffered: bool) -> None:
    """In a fork: the environment, folder, signal handlers and standard streams a newly started interpreter would
    have (unbuffered: as `python -u`, or PYTHONUNBUFFERED, sets them)."""
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for sig, handler in FRESH_HANDLERS.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    import torch  # it read OMP_NUM_THREADS once, at import, where this process's environment had none

    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(max(1, int(threads)) if threads.isdigit() else DEFAULT_THREADS)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        encoding, errors = FRESH_STREAMS[name]
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding, errors=errors,
                                  write_through=unbuffered, line_buffering=name == "stderr" and not unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_as_main(argv: list[str], module: bool = False, source: str | None = None) -> NoReturn:
    """Run a script, a `-m` module or `-c` code (source, argv[0] "-c") as `__main__` with argv, then end as the
    interpreter would."""
    import runpy
    import types

    sys.argv = list(argv)
    if source is not None:
        sys.path[0] = ""  # what `python -c` puts first: the current folder
    else:
        sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(argv[0]))
    code, signum = 0, 0
    try:
        if module and argv[0] == "torch.distributed.run":
            torchrun()
        elif module:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:  # `python -c CODE` or `python SCRIPT`: the code run in a fresh __main__, as the interpreter does
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            if source is None:
                main.__file__ = os.path.abspath(argv[0])  # absolute, as Python 3.9+ sets it for `python SCRIPT`
                with open(argv[0], "rb") as script:
                    source = script.read()
            code_object = compile(source, getattr(main, "__file__", "<string>"), "exec", dont_inherit=True)
            exec(code_object, main.__dict__)  # noqa: S102 - the caller's own script or `-c` code
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # CPython prints it, then dies of SIGINT
        sys.excepthook(*sys.exc_info())
        code, signum = 1, signal.SIGINT
    except BaseException:  # what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    finish(code, signum)


def torchrun() -> None:
    """`python -m torch.distributed.run` as the `torchrun` command runs it (its main, imported here), not through
    runpy: torchrun's rendezvous names its caller in each event through inspect.stack(), where a frame whose file is
    no loaded module's (runpy's frozen ones) makes inspect scan all of sys.modules, twice per frame per event, which
    took a third of a tiny warm run's CPU with this process's 5,000 modules."""
    import torch.distributed.run

    sys.argv[0] = torch.distributed.run.__file__
    torch.distributed.run.main()


def finish(code: int, signum: int = 0) -> NoReturn:
    """The interpreter's own shutdown, then exit: threading's shutdown (non-daemon threads joined, its atexit calls
    such as concurrent.futures'), atexit handlers, Python's and C's stdio flushed. Not garbage collection and static
    destructors: fsdp1.py leaves through errors.leave (os._exit) before any of this, as it must with gloo threads
    alive; a script that ends normally skips them here (the cold runs of the suite still go through them)."""
    threading._shutdown()  # private, and the one call that is the interpreter's own thread shutdown
    atexit._run_exitfuncs()  # the interpreter's own exit runs them; os._exit below would not
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
    if signum:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code & 0xFF)


def fork() -> int:
    """os.fork, without the warning Python 3.12+ prints when the process has threads (torchrun's agent hosts its
    store's): a started interpreter prints no such line, and tests read stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


class WarmPopen(subprocess.Popen):
    """torchrun's worker start (`python -u SCRIPT ARGS`, or `python -u -m MODULE ARGS` for `torchrun -m`) as a fork
    of this warm process; any other command is started as usual. The worker is torchrun's child in a session of its
    own, as a started one is, so the agent's signals, waits and kills reach it unchanged."""

    def _execute_child(self, *args, **kwargs):
        bound = inspect.signature(super()._execute_child).bind(*args, **kwargs)
        a = bound.arguments
        argv = [str(x) for x in a["args"]]
        if not (len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-u"
                and (argv[2].endswith(".py") or (argv[2] == "-m" and len(argv) >= 4))):
            return super()._execute_child(*args, **kwargs)
        pid = fork()
        if pid == 0:
            try:
                if a["start_new_session"]:
                    os.setsid()
                for fd, target in ((a["p2cread"], 0), (a["c2pwrite"], 1), (a["errwrite"], 2)):
                    if fd != -1 and fd != target:
                        os.dup2(fd, target)
                fresh_process(dict(a["env"]) if a["env"] is not None else dict(os.environ), a["cwd"], True)
                if argv[2] == "-m":
                    run_as_main(argv[3:], module=True)
                else:
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


def agent(request: dict, out: int, err: int) -> NoReturn:
    """In a fork: the requested run (torchrun's agent, or a script), its workers forks of this process, its stdout
    and stderr the descriptors the caller passed. A session of its own, so that the caller can kill it and all
    below it as one group (a cold run started with start_new_session is the same)."""
    os.setsid()
    for fd, target in ((out, 1), (err, 2)):
        os.dup2(fd, target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (out, err, null):
        os.close(fd)
    fresh_process(request["env"], request["cwd"], False)
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    # where torchrun's agent (and fsdp1.py --nproc-per-node's) starts each worker: a fork instead of an interpreter
    subprocess_handler.Popen = WarmPopen
    argv = request["argv"]
    if argv[0] == "-m":
        run_as_main(argv[1:], module=True)
    elif argv[0] == "-c":
        run_as_main(["-c", *argv[2:]], source=argv[1])
    else:
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
        if fork() == 0:
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
    line = b""
    while not line.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            return
        line += more
    if len(fds) != 2:
        return
    request = json.loads(line)
    pid = fork()
    if pid == 0:
        conn.close()  # no descriptor of the launcher's own reaches the run
        try:
            agent(request, *fds)
        except BaseException:  # said on the run's stderr, which the caller reads
            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    remember_fresh_state()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the pytest worker that started it
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    preload()
    import torch

    DEFAULT_THREADS = torch.get_num_threads()
    inspect.getmodule(sys._getframe())  # inspect's file -> module map of all loaded modules, built once for every fork
    # What is loaded now is kept out of the collector's passes, in every fork: a fork's first full collection walked
    # every object inherited (torch's, transformers'), which copied each page it touched: over a second of each run.
    gc.freeze()
    serve(sys.argv[1])
