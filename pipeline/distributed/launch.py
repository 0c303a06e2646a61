"""Which launcher started this process, and so which rank it is, read from the environment before any process group.

Four ways in, checked in this order:
- torchrun (TORCHELASTIC_RUN_ID set): its variables as they are.
- any launcher that sets the plain variables (MASTER_ADDR MASTER_PORT WORLD_SIZE RANK LOCAL_RANK, e.g. mpirun or
  a cluster's own): LOCAL_WORLD_SIZE may be left out, then the ranks on each host are counted after joining.
- `srun python fsdp1.py ...` under SLURM: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the step's tasks per
  node, and the first host of the step's node list as the master (MASTER_ADDR/MASTER_PORT win where set).
- none of these: one process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.errors import UserError

PLAIN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
"""What a launcher other than torchrun or srun must set (the env:// rendezvous of torch.distributed)."""


@dataclass(frozen=True)
class Launch:
    launcher: str
    """torchrun, env (plain variables), slurm, single, or spawn (fsdp1.py --nproc-per-node's parent, planning for
    the workers it starts)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    """Ranks on this host; None where the launcher did not say (counted by host name after joining)."""
    master_addr: str
    master_port: int

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous reads (a no-op for torchrun's own)."""
        os.environ.update(MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank))
        if self.local_world_size is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)


SINGLE = Launch("single", 0, 1, 0, 1, "127.0.0.1", 0)


def detect(env: Mapping[str, str] = os.environ) -> Launch:
    """The launch this environment describes; UserError naming the variables that are missing or inconsistent."""
    if "TORCHELASTIC_RUN_ID" in env:
        return _plain(env, "torchrun")
    if "RANK" in env or "WORLD_SIZE" in env:
        return _plain(env, "env")
    if int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        return _slurm(env)
    return SINGLE


def _plain(env: Mapping[str, str], launcher: str) -> Launch:
    missing = [v for v in PLAIN_VARS if not env.get(v)]
    if missing:
        raise UserError(f"{', '.join(missing)} not set: a launch without torchrun or srun must set all of "
                        f"{' '.join(PLAIN_VARS)} in every process")
    local_world = env.get("LOCAL_WORLD_SIZE")
    return _checked(launcher, env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], local_world, env["MASTER_ADDR"],
                    env["MASTER_PORT"], names=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"))


def _slurm(env: Mapping[str, str]) -> Launch:
    needed = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE")
    missing = [v for v in needed if not env.get(v)]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist and not env.get("MASTER_ADDR"):
        missing.append("SLURM_STEP_NODELIST (or MASTER_ADDR)")
    if missing:
        raise UserError(f"SLURM_STEP_NUM_TASKS is {env['SLURM_STEP_NUM_TASKS']} but {', '.join(missing)} not set: "
                        "launch with srun (one task per process), or torchrun inside srun")
    per_node = tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
    node = int(env["SLURM_NODEID"]) if env["SLURM_NODEID"].isdigit() else -1
    if not 0 <= node < len(per_node):
        raise UserError(f"SLURM_NODEID {env['SLURM_NODEID']} is not a node of SLURM_STEP_TASKS_PER_NODE "
                        f"{env['SLURM_STEP_TASKS_PER_NODE']}")
    addr = env.get("MASTER_ADDR") or first_host(nodelist)
    port = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000)
    return _checked("slurm", env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"], env["SLURM_LOCALID"],
                    str(per_node[node]), addr, port,
                    names=("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE",
                           "MASTER_PORT"))


def _checked(launcher: str, rank: str, world: str, local_rank: str, local_world: str | None, addr: str, port: str,
             names: tuple[str, ...]) -> Launch:
    values = (rank, world, local_rank, local_world, port)
    bad = [f"{n}={v!r}" for n, v in zip(names, values, strict=True) if v is not None and not v.isdigit()]
    if bad:
        raise UserError(f"{', '.join(bad)}: not a whole number")
    r, w, lr, port_n = int(rank), int(world), int(local_rank), int(port)
    lw = None if local_world is None else int(local_world)
    rank_n, world_n, local_n, local_world_n, port_name = names
    problems = []
    if w < 1 or r >= w:
        problems.append(f"{rank_n}={r} is not below {world_n}={w}")
    if lw is not None and not (1 <= lw <= w and lr < lw):
        problems.append(f"{local_n}={lr} and {local_world_n}={lw} do not fit {world_n}={w}")
    if not 0 < port_n < 65536:
        problems.append(f"{port_name}={port_n} is not a TCP port")
    if problems:
        raise UserError(f"inconsistent launch variables: {'; '.join(problems)}")
    return Launch(launcher, r, w, lr, lw, addr, port_n)


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed counts, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UserError(f"cannot read SLURM's tasks per node {spec!r} (expected e.g. '2(x3),1')")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: 'gpu[007-010,12],cpu1' -> 'gpu007' (what `scontrol show hostnames`
    would print first)."""
    first = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip())[0]
    return re.sub(r"\[([^\],-]*)[^\]]*\]", r"\1", first)
