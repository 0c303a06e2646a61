"""One clear line instead of a traceback for every mistake a user can make."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user can fix (bad path, bad flag, missing model). Printed as one line, exit code 2."""


def run_cli(main: Callable[[], int | None]) -> None:
    """Run a stage's main function, turning UserError into one stderr line and a non-zero exit."""
    try:
        code = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
