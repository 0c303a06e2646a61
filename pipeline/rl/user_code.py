"""The user's own Python (reward functions; their files at import) run inside the training processes, where it may
hang, exit or read the command line: a time limit, a stop signal that interrupts it at once, and SystemExit or
KeyboardInterrupt from it turned into one line. Hazard: the time limit is SIGALRM (ITIMER_REAL), which only the main
thread can take; elsewhere (none of ours) the code runs without one. C code that holds the GIL and never returns is
beyond any of this."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from pipeline.errors import UserError
from pipeline.signals import SignalInUserCode, Stopped, StopRequest


class TimedOut(BaseException):  # noqa: N818 - a BaseException, so the user's `except Exception` lets it by
    """The time limit passed while the user's code ran."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """TimedOut inside the block once seconds have passed (0: no limit; off the main thread: none)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_signum, _frame):
        raise TimedOut

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call(what: str, fn: Callable, *args: object, timeout: float = 0, late: str = "", **kwargs: object) -> object:
    """fn(*args, **kwargs), the user's: a stop signal interrupts it (Stopped, "in WHAT"); past timeout seconds, one
    line naming WHAT and what `late` says of where it was (e.g. the prompt); SystemExit and KeyboardInterrupt it
    raises, one line naming WHAT (a run that did not finish never exits 0). Its other exceptions are the caller's."""
    try:
        with StopRequest.interrupting(), time_limit(timeout):
            return fn(*args, **kwargs)
    except SignalInUserCode:
        raise Stopped(f"in {what}") from None
    except TimedOut:
        raise UserError(f"{what} did not return within {timeout:g} s{late}; make it faster, or raise "
                        "--reward-timeout (0: no limit)") from None
    except (SystemExit, KeyboardInterrupt) as exc:
        if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise  # Ctrl-C in a process that takes it the Python way (no stop handler): the user's, not the code's
        raise UserError(f"{what} raised {_exit_named(exc)}: code run inside training must return, not end the "
                        "process") from None


def _exit_named(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r})" if exc.code is not None else "SystemExit"
    return type(exc).__name__


def import_file(path: Path, module_name: str, what: str) -> ModuleType:
    """The user's file imported as module_name (kept in sys.modules): its folder first on sys.path while it imports
    (where TRL users keep their helper modules) and after, sys.argv as if the file were run alone (a module that
    parses the command line at import reads none of ours), any exception of its import one line naming it."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    argv, sys.argv = sys.argv, [str(path)]
    try:
        call(what, loader.loader.exec_module, module)
    except (UserError, Stopped):
        raise
    except Exception as exc:  # the user's module: any error in it is theirs to fix, named in one line
        raise UserError(f"{what}: importing it raised {type(exc).__name__}: {exc}") from None
    finally:
        sys.argv = argv
    sys.modules[module_name] = module
    return module
