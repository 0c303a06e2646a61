"""The user's own Python (reward functions; their files at import) run inside the training processes, where it may
hang, exit or read the command line: a time limit, a stop signal that interrupts it at once, and SystemExit or
KeyboardInterrupt from it turned into one line.

Hazards: the time limit is a watchdog thread that signals the main thread (a real-time signal of its own: SIGALRM is
the user's, e.g. math_verify's timeouts call alarm(0), which would cancel a limit kept there), so only code on the
main thread has one; C code that holds the GIL and never returns is beyond any of this."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType

from pipeline.errors import UserError
from pipeline.signals import SignalInUserCode, Stopped, StopRequest

LIMIT_SIGNAL = signal.SIGRTMAX - 2
"""The watchdog's signal: a real-time one no library or scheduler sends (SLURM's preemption notices are SIGUSR1/2)."""
_deadline: list[float] = []
"""The armed limit's end (time.monotonic), empty when none is: a late signal after the call has returned is let go."""


class TimedOut(BaseException):  # noqa: N818 - a BaseException, so the user's `except Exception` lets it by
    """The time limit passed while the user's code ran."""


def _expired(_signum, _frame) -> None:
    if _deadline and time.monotonic() >= _deadline[0] - 0.05:  # (a timer's wait may end a hair early)
        _deadline.clear()
        raise TimedOut


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """TimedOut inside the block once seconds have passed (0: no limit; off the main thread: none)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(LIMIT_SIGNAL) is not _expired:
        signal.signal(LIMIT_SIGNAL, _expired)  # once per process; it acts only while a limit is armed
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, LIMIT_SIGNAL))
    timer.daemon = True
    try:
        _deadline[:] = [time.monotonic() + seconds]
        timer.start()
        yield
    finally:
        timer.cancel()
        _deadline.clear()


def call(what: str, fn: Callable, timeout: float = 0, late: str = "", limit: str = "--reward-timeout") -> object:
    """fn(), the user's (its arguments bound by the caller, e.g. functools.partial: a column of the user's data may
    be named as any of these parameters): a stop signal interrupts it (Stopped, "in WHAT"); past timeout seconds, one
    line naming WHAT, what `late` says of where it was (e.g. the prompt) and the flag that sets the limit; SystemExit
    and KeyboardInterrupt it raises, one line naming WHAT (a run that did not finish never exits 0). Its other
    exceptions are the caller's."""
    try:
        with time_limit(timeout), StopRequest.interrupting():
            return fn()
    except SignalInUserCode:
        raise Stopped(f"in {what}") from None
    except TimedOut:
        raise UserError(f"{what} did not return within {timeout:g} s{late}; make it faster, or raise "
                        f"{limit} (0: no limit)") from None
    except (SystemExit, KeyboardInterrupt) as exc:
        if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise  # Ctrl-C in a process that takes it the Python way (no stop handler): the user's, not the code's
        raise UserError(exit_line(what, exc)) from None


def exit_line(what: str, exc: BaseException) -> str:
    """The one line for code inside training that raised SystemExit or KeyboardInterrupt."""
    return f"{what} raised {_exit_named(exc)}: code run inside training must return, not end the process"


_loop: list[asyncio.AbstractEventLoop] = []
"""The process's event loop for the user's `async def` code, running on a daemon thread (as TRL runs it): one loop,
so a client an async reward keeps at module level (bound to the loop it first ran on) works on every call."""


def _event_loop() -> asyncio.AbstractEventLoop:
    if not _loop:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="user-async", daemon=True).start()
        _loop.append(loop)
    return _loop[0]


def await_all(what: str, makers: list[Callable[[], Awaitable]], timeout: float = 0,
              late: str = "") -> list[tuple[bool, object]]:
    """Each maker()'s awaitable awaited together on the process's event loop, the main thread waiting under call()'s
    time limit and stop signal (a wait a signal interrupts; the tasks are then cancelled, not waited for: a thread an
    async reward started may never return). Returns per maker (raised, its value or what it raised): whatever it
    raised, even SystemExit, is returned, so that the loop's thread lives on."""

    async def guarded(make: Callable[[], Awaitable]) -> tuple[bool, object]:
        try:
            return False, await make()
        except BaseException as exc:  # noqa: BLE001 - the caller names it; a SystemExit here would end the loop
            return True, exc

    async def together() -> list[tuple[bool, object]]:
        return list(await asyncio.gather(*(guarded(make) for make in makers)))

    future = asyncio.run_coroutine_threadsafe(together(), _event_loop())
    try:
        return call(what, future.result, timeout=timeout, late=late)
    except BaseException:
        future.cancel()
        _loop.clear()  # a task that never awaits holds its loop for good: a later call gets a loop of its own
        raise


def _exit_named(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r})" if exc.code is not None else "SystemExit"
    return type(exc).__name__


def import_file(path: Path, module_name: str, what: str) -> tuple[ModuleType, list[ModuleType]]:
    """The user's file imported as module_name (in sys.modules from before it runs, as Python's own imports do: a
    dataclass under `from __future__ import annotations` looks itself up there), with the other modules its import
    brought in: its folder first on sys.path while it imports (where TRL users keep their helper modules) and after,
    sys.argv as if the file were run alone (a module that parses the command line at import reads none of ours),
    any exception of its import one line naming it."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    before = set(sys.modules)
    sys.modules[module_name] = module
    argv, sys.argv = sys.argv, [str(path)]
    try:
        call(what, functools.partial(loader.loader.exec_module, module))
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, (UserError, Stopped)) or not isinstance(exc, Exception):
            raise
        # the user's module: any error in it is theirs to fix, named in one line
        raise UserError(f"{what}: importing it raised {type(exc).__name__}: {exc}") from None
    finally:
        sys.argv = argv
    return module, [sys.modules[name] for name in set(sys.modules) - before - {module_name}]


HELPERS: dict[str, list[Path]] = {}
"""The modules each user file's import brought in from its own folder (or below it), by its module name."""


def load_file(path: Path, what: str) -> tuple[ModuleType, str]:
    """The user's file (a reward, tools, an environment) imported once per process as a module named by its content
    hash (one file given to two flags, e.g. a TRL script holding its environment and its reward, is one module: its
    state and classes shared), and its identity: the SHA-256 of its content and of the modules its import brought in
    from its own folder (an edited helper module beside the file changes it as an edit of the file does). what: its
    flag and file, which every message names."""
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{what}: the file cannot be read ({exc.strerror or exc})") from None
    module_name = f"_user_{hashlib.sha256(source).hexdigest()[:16]}"
    module = sys.modules.get(module_name)
    if module is None:
        module, added = import_file(path, module_name, what)
        HELPERS[module_name] = _helpers(path, added)
    return module, _digest(path, source, HELPERS.get(module_name, []), what)


def _helpers(path: Path, modules: list[ModuleType]) -> list[Path]:
    """The files of the modules a user file's import brought in from its folder or below it."""
    folder = path.resolve().parent
    found = set()
    for module in modules:
        file = getattr(module, "__file__", None)
        if file and os.path.isabs(file) and file.endswith(".py"):
            where = Path(file).resolve()
            if where.is_relative_to(folder) and where != path.resolve() and where.is_file():
                found.add(where)
    return sorted(found)


def _digest(path: Path, source: bytes, helpers: list[Path], what: str) -> str:
    """The file's content hash with its helpers' (as they are now)."""
    digest = hashlib.sha256(source)
    folder = path.resolve().parent
    for where in helpers:
        try:
            digest.update(where.relative_to(folder).as_posix().encode() + b"\0" + where.read_bytes())
        except OSError as exc:
            raise UserError(f"{what}: its helper module {where} cannot be read ({exc.strerror or exc})") from None
    return digest.hexdigest()[:16]
