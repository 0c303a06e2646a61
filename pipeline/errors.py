"""One clear line instead of a traceback for every mistake a user can make; flags in either spelling."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn


class UserError(Exception):
    """A problem the user can fix (bad path, bad flag, missing model). Printed as one line, exit code 2."""


class PeerFailed(Exception):
    """This process stops because another one failed and said why in its own line (a collective it was in failed
    with it): exit 1, and only this message, if any (a peer on another node, whose line is not on this console)."""


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
"""What the machine, not our code, refuses a write for: a full disk or quota, a read-only mount, no permission."""


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for a one-line error (its type's name when it has none), at most 300
    characters."""
    return (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]


def disk_problem(exc: BaseException) -> str:
    """One line for an OSError in DISK_ERRNOS (or a name too long for the file system), naming the path (and for a
    full disk the space left there); "" for any other exception. Nothing is lost by it: every writer of ours writes
    to a temporary name and renames."""
    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        return (f"file name too long for its file system: {exc.filename or 'a path'} (most allow 255 bytes per name); "
                "choose a shorter name")
    if not isinstance(exc, OSError) or exc.errno not in DISK_ERRNOS:
        return ""
    path = exc.filename or "a file"
    how = "fix it or choose another output folder, then rerun the same command (what is finished is kept)"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return f"cannot write {path}: {what}{_space_left(exc.filename)}; {how}"
    if exc.errno == errno.EROFS:
        return f"cannot write {path}: read-only file system; {how}"
    return f"permission denied on {path}; {how}"


def _space_left(filename: str | None) -> str:
    """The space left on the file system holding filename (its nearest existing folder), else ""."""
    if not filename:
        return ""
    folder = Path(filename).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return ""
    return f" (its file system has {usage.free / 2**20:,.1f} MB of {usage.total / 2**20:,.1f} MB free now)"


@contextlib.contextmanager
def naming(path: Path | str, *, unnamed_only: bool = False) -> Iterator[None]:
    """Writing path: an OSError raised without a file name (ENOSPC comes from write(2) on an open file), or a full or
    read-only disk's naming another file (shutil.copy names the source), names path, so disk_problem says where.
    unnamed_only: only a nameless one (around work whose inner writes name their own files)."""
    try:
        yield
    except OSError as exc:
        if exc.errno is not None and (exc.filename is None or (
                not unnamed_only and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))):
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise


def run_cli(main: Callable[[], int | None], *, finalize: bool = True) -> None:
    """Run a stage's main function, turning UserError into one stderr line and a non-zero exit. finalize=False, for
    stages that join a process group: leave through leave() however main ends (an unexpected exception prints its
    traceback first, exit code 1)."""
    # a file name that is not UTF-8 (a byte Python keeps as a surrogate) is printed escaped instead of failing print
    sys.stdout.reconfigure(errors="backslashreplace")
    if not sys.stderr.isatty():  # progress bars are for a terminal: in a log file they are lines of noise
        no_progress_bars()
    try:
        code = main()
    except UserError as exc:
        say(f"error: {exc}")
        code = 2
    except PeerFailed as exc:
        if str(exc):
            say(f"error: {exc}")
        code = 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except SystemExit:  # argparse's --help and usage errors: before any process group exists
        raise
    except BaseException as exc:
        if problem := disk_problem(exc):
            say(f"error: {problem}")
            code = 2
        elif finalize:
            raise
        else:
            traceback.print_exc()
            say(f"{type(exc).__name__}: {exc}", traceback.format_exc())
            code = 1
    if not finalize:
        leave(code or 0)
    sys.exit(code or 0)


def no_progress_bars() -> None:
    """Progress bars off, in this process and those it starts: tqdm's own (TQDM_DISABLE) and those of the Hugging
    Face libraries, by the switch each reads at import and, where one is imported already, by its own call."""
    for switch in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(switch, "1")
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def say(line: str, details: str = "") -> None:
    """A failure's line, on stderr; under torchrun, instead, in this worker's error file (TORCHELASTIC_ERROR_FILE).
    Why: torchrun's failure report, printed after every worker's output, names the first failing rank as its root
    cause, last, and shows that rank's error file (or, without one, only a link to its docs): the line is then where
    the user reads, once per failing rank inside the report, not once per rank above it. details (a traceback) is
    shown instead of the line where there is one; it is printed on stderr by the caller. The file's format is the
    one torch's own @record writes (torch.distributed.elastic.multiprocessing.errors), written here because @record
    would show the traceback of a UserError too."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        extra = {"py_callstack": details or line, "timestamp": str(int(time.time()))}
        try:
            Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": extra}}))
            return
        except OSError:  # no room for even this: say it the plain way
            pass
    if not details:
        print(line, file=sys.stderr)


def leave(code: int) -> NoReturn:
    """Exit at once, without interpreter finalization, once the logs, stdout and stderr are flushed. Why: a process
    group's gloo threads still alive when the interpreter tears itself down (the default group, or one a DDP reducer,
    a DeviceMesh or an exception's traceback keeps) abort the process ("terminate called without an active
    exception", pytorch PR 179291) or block it forever, and torchrun then waits on a rank that already said its last
    line. Hazard: atexit handlers do not run, so whatever must reach the disk is closed before this (the trainer's
    telemetry, checkpoints and export are)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing more can be said anyway
            stream.flush()
    with contextlib.suppress(Exception):  # what C and C++ libraries wrote through stdio (NCCL_DEBUG's lines)
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that takes every long flag in kebab-case and in snake_case (`--src-dir` and `--src_dir`), whichever
    spelling the flag was declared with: the seed documents snake_case, the trainer's YAML keys are snake_case and
    its flags kebab-case, so users type both."""

    def __init__(self, *args, **kwargs):
        self.spellings: dict[str, str] = {}
        """Flag with `_` read as `-` -> the flag as declared (set first: argparse's __init__ adds --help)."""
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs) -> argparse.Action:
        action = super().add_argument(*names, **kwargs)
        self.spellings.update({_spelling(o): o for o in action.option_strings if o.startswith("--")})
        return action

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else [str(a) for a in args]
        end = args.index("--") if "--" in args else len(args)  # after a bare --, everything is a value
        return super().parse_known_args([self._declared(a) for a in args[:end]] + args[end:], namespace)

    def _check_value(self, action: argparse.Action, value: object) -> None:
        """A value outside a flag's choices: one line (exit 2), not argparse's usage block first. argparse's hook for
        it is private (no public one exists); tests/test_config.py checks that it is still called."""
        if action.choices is not None and value not in action.choices:
            name = next((o for o in action.option_strings if o.startswith("--")), action.dest)
            raise UserError(f"{name} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
        super()._check_value(action, value)

    def _declared(self, token: str) -> str:
        if not token.startswith("--"):
            return token
        name, eq, value = token.partition("=")
        return self.spellings.get(_spelling(name), name) + eq + value


def _spelling(flag: str) -> str:
    return "--" + flag[2:].replace("_", "-")
