"""A node lost mid-run and a run folder one node cannot see, with two torchrun agents on this machine (split from
test_multinode.py so both pytest workers run multi-node tests at once), started warm (the two-node test in
test_multinode.py keeps nodes started cold)."""

import json
import socket
import time
from pathlib import Path

import pytest
from conftest import kill_tree, losses, wait_for
from test_multinode import args, free_port, listening, start_node, two_nodes

pytestmark = pytest.mark.slow


def test_a_lost_node_is_named_within_a_minute_and_the_rerun_resumes(train_env, tmp_path):
    # Each node keeps its token cache on its own disk (a relative --cache-dir from its own working folder)
    cwds = (tmp_path / "a", tmp_path / "b")
    for d in cwds:
        d.mkdir()
    port = free_port()
    run_args = args(train_env, tmp_path / "shared", "--max-steps", 100000, "--ckpt-freq", 2, "--cache-dir", "cache",
                    "--peer-timeout-s", 6)
    first = start_node(train_env, port, 1, run_args, tmp_path / "node0.log", cwds[0], warm=True)
    wait_for(lambda: listening(port), first, timeout=60)
    second = start_node(train_env, port, 1, run_args, tmp_path / "node1.log", cwds[1], warm=True)
    run = tmp_path / "shared" / "r"
    wait_for(lambda: max(losses(run), default=0) >= 3, first)
    assert all(len(list((d / "cache").glob("*/meta.json"))) == 1 for d in cwds)  # one copy per node
    kill_tree(second)  # the whole node: its agent and its worker, no chance to say anything
    lost_at = time.monotonic()
    first.wait(timeout=120)
    waited = time.monotonic() - lost_at
    out = (tmp_path / "node0.log").read_text()
    assert first.returncode != 0 and waited < 60, (waited, out[-3000:])
    assert f"error: rank 0: rank(s) 1 on {socket.gethostname()} stopped responding for 6 s (a lost node or a killed " \
           "process); exiting. Rerun the same command on every node to resume from the last complete checkpoint" \
           in out, out[-3000:]
    assert "ERROR error: rank 0: rank(s) 1 on" in (run / "train.log").read_text()  # the reason stays with the run
    last = json.loads((run / "state.json").read_text())["step"]
    rerun = args(train_env, tmp_path / "shared", "--max-steps", last + 2, "--ckpt-freq", 2, "--cache-dir", "cache")
    nodes = two_nodes(train_env, 1, rerun, tmp_path, cwds, warm=True)
    assert [code for code, _ in nodes] == [0, 0], nodes[0][1][-3000:] + nodes[1][1][-3000:]
    resumes = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"resume"' in x]
    assert resumes[-1]["from_step"] == last and max(losses(run)) == last + 2


def test_a_run_folder_that_one_node_cannot_see_is_refused_at_start(train_env, tmp_path):
    cwds = (tmp_path / "a", tmp_path / "b")
    for d in cwds:
        d.mkdir()
    # The same relative --save-dir names a different folder on each "node": as a node-local disk would
    nodes = two_nodes(train_env, 1, args(train_env, Path("outputs")), tmp_path, cwds, warm=True)
    assert all(code != 0 for code, _ in nodes)
    for _, out in nodes:
        assert f"error: outputs/r is not on storage every node sees: rank(s) 1 on {socket.gethostname()} cannot read " \
               "a file rank 0 wrote there; put --save-dir on a shared file system (NFS, Lustre, ...) with the same " \
               "path on every node" in out, out[-3000:]
    assert not list((cwds[0] / "outputs" / "r" / "checkpoints").glob("*"))
