"""`python tests/helpers/warm_client.py ARGS`: `python ARGS` run by the warm launcher (tests/helpers/warm_launcher.py)
whose socket FSDP1_WARM_SOCKET names, with this process's standard streams, folder and environment (that variable
left out), exiting as the run did. For a command line a product starts itself, a launcher the experiments harness
takes (--launcher): each experiment's torchrun then starts warm. A signal this process gets (SIGTERM, SIGINT) is
passed to the run's session."""

from __future__ import annotations

import os
import signal
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[1:1] = [TESTS, os.path.dirname(TESTS)]  # tests/, for its warm.py, and the repository, for what warm.py imports

from warm import WarmProcess, request  # noqa: E402


def main() -> None:
    env = dict(os.environ)
    conn = request(env.pop("FSDP1_WARM_SOCKET"), [1, 2], sys.argv[1:], os.getcwd(), env)
    proc = WarmProcess([sys.executable, *sys.argv[1:]], conn, {})
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _frame: os.killpg(proc.pid, signum))
    code = proc.wait()
    if code < 0:  # killed by a signal: end the same way, as a shell would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
