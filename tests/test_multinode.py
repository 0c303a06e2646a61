"""Several nodes on one machine: torchrun agents joined by c10d rendezvous, the plain-variable and srun launches,
the SLURM script with stand-in srun/scontrol, the Kubernetes job's arguments (node loss and storage:
test_node_loss.py)."""

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, losses, run_script, start_python, torchrun, wait_for, with_root

from pipeline.config_merge import resolve
from pipeline.distributed.launch import Launch, detect, first_host, tasks_per_node
from pipeline.distributed.liveness import watched_ranks
from pipeline.errors import UserError

pytestmark = pytest.mark.slow

# Constant learning rate: a leg stopped early by --max-steps trains like the first steps of a longer run
FAST = ["--config", str(ROOT / "configs" / "demo.yaml"), "--log-freq", "1", "--eval-freq", "0", "--ckpt-freq", "0",
        "--lr-schedule", "constant", "--warmup-steps", "0"]


def args(env: dict, save_dir: Path, *extra: object, name: str = "r") -> list[str]:
    return ["-e", name, "-d", str(env["dataset"]), "-m", "local/tiny", "--save-dir", str(save_dir), *FAST,
            *map(str, extra)]


def free_port(low: int = 20000, high: int = 35000) -> int:
    """A free TCP port in [low, high) (SLURM launches derive theirs from the job id into that range)."""
    for port in range(low + os.getpid() % 1000, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_node(env: dict, port: int, nproc: int, script_args: list[str], log: Path, cwd: Path = ROOT,
               nnodes: int = 2, warm: bool = False):
    """One node's torchrun agent, in its own session so the whole node can be killed at once: a subprocess.Popen, or
    start_python's warm equivalent where warm (the two-node tests here keep multi-rank runs of interpreters started
    apart, each with its own string-hash seed)."""
    argv = ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
            str(ROOT / "fsdp1.py"), *script_args]
    if warm:
        return start_python(argv, with_root(env["env"]), True, log.open("w"), subprocess.STDOUT, cwd)
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=with_root(env["env"]), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def two_nodes(env: dict, nproc: int, script_args: list[str], tmp: Path, cwds: tuple[Path, Path] = (ROOT, ROOT),
              timeout: float = 600, warm: bool = False) -> list[tuple[int, str]]:
    """Both nodes to the end: (exit code, output) of each. The first agent hosts the rendezvous store."""
    port = free_port()
    first = start_node(env, port, nproc, script_args, tmp / "node0.log", cwds[0], warm=warm)
    wait_for(lambda: listening(port), first, timeout=60)
    second = start_node(env, port, nproc, script_args, tmp / "node1.log", cwds[1], warm=warm)
    for proc in (first, second):
        proc.wait(timeout=timeout)
    return [(p.returncode, (tmp / f"node{i}.log").read_text()) for i, p in enumerate((first, second))]


def test_launch_variables_are_read_and_checked():
    plain = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}
    assert detect(plain) == Launch("env", 5, 8, 1, None, "10.0.0.1", 29500)
    slurm = {"SLURM_STEP_NUM_TASKS": "6", "SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NODELIST": "gpu[007-009]", "SLURM_JOB_ID": "123456"}
    assert detect(slurm) == Launch("slurm", 4, 6, 0, 2, "gpu007", 15000 + 123456 % 20000)
    assert detect({**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}).master_addr == "head"
    assert detect({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}).launcher == "single"  # srun of one task
    assert first_host("node1,node2") == "node1" and first_host("a[09-12,20]b") == "a09b"
    assert tasks_per_node("4(x2),3") == [4, 4, 3]
    cases = [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT, LOCAL_RANK not set: a launch without torchrun "
         "or srun must set all of MASTER_ADDR MASTER_PORT WORLD_SIZE RANK LOCAL_RANK in every process"),
        ({**plain, "RANK": "8"}, "inconsistent launch variables: RANK=8 is not below WORLD_SIZE=8"),
        ({**plain, "LOCAL_WORLD_SIZE": "1"}, "inconsistent launch variables: LOCAL_RANK=1 and LOCAL_WORLD_SIZE=1 do "
         "not fit WORLD_SIZE=8"),
        ({**plain, "MASTER_PORT": "http"}, "MASTER_PORT='http': not a whole number"),
        ({**slurm, "SLURM_NODEID": "3"}, "SLURM_NODEID 3 is not a node of SLURM_STEP_TASKS_PER_NODE 2(x3)"),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, "SLURM_STEP_NUM_TASKS is 2 but SLURM_LOCALID, "
         "SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST (or MASTER_ADDR) not set: launch with srun "
         "(one task per process), or torchrun inside srun"),
    ]
    for env, message in cases:
        with pytest.raises(UserError) as err:
            detect(env)
        assert str(err.value) == message


def test_the_first_rank_of_each_node_watches_the_next_node():
    assert [watched_ranks(r, 12, 4) for r in (0, 4, 8)] == [[4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]
    assert all(watched_ranks(r, 12, 4) == [] for r in (1, 2, 3, 5, 11))
    assert watched_ranks(0, 3, 3) == [1, 2] and watched_ranks(0, 1, 1) == []  # one node: its own other ranks


def test_plain_variables_and_srun_variables_train_like_torchrun(train_env, tmp_path):
    reference = torchrun(2, ROOT / "fsdp1.py", *args(train_env, tmp_path / "torchrun", "--max-steps", 2),
                         env=train_env["env"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    port = free_port()
    plain = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(r),
              "LOCAL_RANK": str(r)} for r in range(2)]  # no LOCAL_WORLD_SIZE: counted by host name
    port = free_port()
    srun = [{"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": str(port - 15000)}
            for r in range(2)]
    for name, variables in (("plain", plain), ("srun", srun)):  # started warm, as torchrun()'s workers are
        procs = [start_python([str(ROOT / "fsdp1.py"), *args(train_env, tmp_path / name, "--max-steps", 2)],
                              with_root({**train_env["env"], **v}), offline=True, stderr=subprocess.STDOUT)
                 for v in variables]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
        assert "world size 2" in (tmp_path / name / "r" / "train.log").read_text()
        assert losses(tmp_path / name / "r") == losses(tmp_path / "torchrun" / "r")  # the same ranks, bitwise
    missing = run_script("fsdp1.py", *args(train_env, tmp_path / "x"), env={**train_env["env"], "RANK": "1"})
    assert missing.returncode == 2
    assert missing.stderr.splitlines()[-1] == (
        "error: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, LOCAL_RANK not set: a launch without torchrun or srun must set "
        "all of MASTER_ADDR MASTER_PORT WORLD_SIZE RANK LOCAL_RANK in every process")


def stand_in_slurm(bin_dir: Path) -> None:
    """srun and scontrol for a job of SLURM_NNODES nodes that all live on this machine."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && for _ in $(seq "$SLURM_NNODES")'
                                      '; do echo localhost; done\n[ "$1" = requeue ] && echo "$2" >> "$REQUEUED"\n'
                                      'exit 0\n')
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\npids=()\n'
                                  'for node in $(seq 0 $((SLURM_NNODES - 1))); do\n'
                                  '  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &\n'
                                  '  pids+=($!)\n'
                                  '  [ "$node" = 0 ] && until (exec 3<>/dev/tcp/127.0.0.1/"$MASTER_PORT") 2>/dev/null'
                                  '; do sleep 0.2; done\n'  # the first node hosts the rendezvous, as on a cluster
                                  'done\ncode=0\nfor p in "${pids[@]}"; do wait "$p" || code=$?; done\nexit $code\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)


def test_two_nodes_train_like_one_and_resume_across_node_counts(train_env, tmp_path):
    # One node of 4 processes, uninterrupted: the reference
    ref = torchrun(4, ROOT / "fsdp1.py", *args(train_env, tmp_path / "one", "--max-steps", 6), env=train_env["env"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = losses(tmp_path / "one" / "r")
    run = tmp_path / "chain" / "r"
    # Leg 1: two nodes of 2, HYBRID_SHARD (replicate across the nodes, shard within)
    nodes = two_nodes(train_env, 2, args(train_env, tmp_path / "chain", "--max-steps", 2, "--sharding",
                                         "HYBRID_SHARD"), tmp_path)
    assert [code for code, _ in nodes] == [0, 0], nodes[0][1][-3000:] + nodes[1][1][-3000:]
    # Leg 2: one node of 2 with two micro-steps: the same global batch of 8 blocks
    one = torchrun(2, ROOT / "fsdp1.py", *args(train_env, tmp_path / "chain", "--max-steps", 4, "--grad-accum", 2),
                   env=train_env["env"])
    assert one.returncode == 0, one.stderr[-3000:]
    # Leg 3: two nodes of 2, FULL_SHARD over 4, launched by the SLURM script with stand-ins for srun and scontrol
    stand_in_slurm(tmp_path / "bin")
    slurm_env = {**with_root(train_env["env"]),
                 "PATH": f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                 "PROJECT_DIR": str(ROOT), "SLURM_JOB_ID": "42", "SLURM_NNODES": "2",
                 "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(free_port()), "GPUS_PER_NODE": "2",
                 "REQUEUED": str(tmp_path / "requeued")}
    sbatch = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch"),
                             *args(train_env, tmp_path / "chain", "--max-steps", 6)],
                            cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=600)
    assert sbatch.returncode == 0, sbatch.stdout[-3000:] + sbatch.stderr[-3000:]
    assert not (tmp_path / "requeued").exists()
    got = losses(run)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:  # resharded between legs: equal up to the reduction order
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    resumes = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"resume"' in x]
    assert [e["from_step"] for e in resumes] == [2, 4]
    assert "world size 4" in (run / "train.log").read_text()


def test_the_kubernetes_job_runs_fsdp1_with_arguments_it_accepts():
    job = yaml.safe_load((ROOT / "examples" / "kubernetes" / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["template"] == specs["Worker"]["template"]
    (container,) = specs["Master"]["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["command"] == ["torchrun"]
    script, *script_args = container["args"]
    assert script == "fsdp1.py"
    cfg = resolve(script_args)
    assert cfg.data.cache_dir.startswith("/local/") and cfg.run.save_dir.startswith("/shared/")
    assert cfg.model.sharding == "HYBRID_SHARD"  # the multi_node profile
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/shared", "/local", "/dev/shm"} <= mounts
