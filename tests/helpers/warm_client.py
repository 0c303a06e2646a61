"""`python tests/helpers/warm_client.py ARGS`: `python ARGS` run by the warm launcher (tests/helpers/warm_launcher.py)
whose socket FSDP1_WARM_SOCKET names, with this process's standard streams, folder and environment (that variable
left out), exiting as the run did. For a command line a product starts itself, a launcher the experiments harness
takes (--launcher): each experiment's torchrun then starts warm. A signal this process gets (SIGTERM, SIGINT) is
passed to the run's session."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def main() -> None:
    env = dict(os.environ)
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(env.pop("FSDP1_WARM_SOCKET"))
    socket.send_fds(conn, [b"F"], [1, 2])
    conn.sendall(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": env}).encode() + b"\n")
    reader = conn.makefile("rb")
    pid = json.loads(reader.readline())["pid"]

    def forward(signum: int, _frame: object) -> None:
        os.killpg(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    line = reader.readline()
    if not line:
        raise SystemExit("error: the warm launcher ended before the run did")
    code = json.loads(line)["returncode"]
    if code < 0:  # killed by a signal: end the same way, as a shell would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
