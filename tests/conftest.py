"""Shared helpers: run a stage script as a user would, in a real subprocess."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from warm import WARM, kill_tree, warm_launches  # noqa: F401 - the tests import kill_tree from here

ROOT = Path(__file__).resolve().parents[1]


def with_root(env: dict | None = None) -> dict[str, str]:
    """env (default: this process's) with the repository first on PYTHONPATH and the caller's own entries kept after
    it: on the GPU image the carried wheels (datasets, peft, torchao) are found only through the caller's PYTHONPATH,
    so a worker started with PYTHONPATH=ROOT alone could not import them. Given its own result, the same (one warm
    launcher serves both)."""
    import os

    env = dict(env if env is not None else os.environ)
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(theirs[1:] if theirs[:1] == [str(ROOT)] else theirs)])
    return env


WARM_SCRIPTS = {"fsdp1.py": True, "MODEL_DOWNLOAD.py": False, "DATA-HF.py": False}
"""The stage scripts run_script starts warm (their imports are most of a short run's time: a cold MODEL_DOWNLOAD.py
took 8.6 s of CPU here, a launcher's start 8.9 s and each warm run after it 0.7 s, so even one run in an
environment costs no more), each with whether it sets the offline switches before its first Hugging Face import.
ORGANIZE_DATA.py imports neither torch nor a Hugging Face library (0.35 s cold) and starts cold."""


def run_script(script: str, *args: object, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a top-level stage script with this interpreter; captures text output. WARM_SCRIPTS start warm as
    torchrun() does."""
    path = ROOT / script  # a stage named by its name or its whole path
    cmd = [str(path), *map(str, args)]
    if path.parent == ROOT and path.name in WARM_SCRIPTS and warm_launches():
        # PYTHONPATH as torchrun() gives it: the same launcher serves both
        return WARM.run(cmd, with_root(env), timeout, WARM_SCRIPTS[path.name])
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


OFFLINE_MODULES = ("pipeline.chat", "pipeline.export", "pipeline.evaluate")
"""The `python -m` commands that set the offline switches before their first Hugging Face import, as fsdp1.py does:
a launcher the training runs started for their environment serves them too."""


def run_module(module: str, *args: object, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` with this interpreter, from the repository, as a user runs it; captures text output
    (run_python: warm where a launcher for its environment is up)."""
    return run_python(["-m", module, *map(str, args)], with_root(env), module in OFFLINE_MODULES, timeout)


def run_python(argv: list[str], env: dict, offline: bool, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python ARGV` (a script, `-m MODULE` or `-c CODE`) from the repository with env, as a user runs it; captures
    text output. Started warm where this pytest worker's launcher for the environment is already up (the training
    runs' one, most often), else cold; it starts no launcher of its own. offline: the command sets the offline
    switches fsdp1.py sets before its first Hugging Face import (so the launcher's imports saw what its own would)."""
    if warm_launches() and WARM.running(env, offline):
        return WARM.run(argv, env, timeout, offline)
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def run_evaluate(env: dict, *args: object, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m pipeline.evaluate ARGS` (run_module's)."""
    return run_module("pipeline.evaluate", *args, env=env, timeout=timeout)


class SmallDisk:
    """A tmpfs mounted at path: a disk that really fills (ENOSPC from write(2), as on a full volume)."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir()
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                               capture_output=True, text=True)
        if mount.returncode:
            pytest.skip(f"a small disk needs a tmpfs mount, which this machine refuses ({mount.stderr.strip()})")

    def resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs at tmp_path/disk, unmounted afterwards; skipped, saying why, where mounting is not allowed."""
    disk = SmallDisk(tmp_path / "disk", 2**20)
    yield disk
    disk.unmount()


HOLD = """import sys
from pathlib import Path
from pipeline.folder_lock import beside, hold
assert hold(beside(Path(sys.argv[1])), sys.argv[2]) == ""
print("held", flush=True)
sys.stdin.readline()
"""


def hold_lock(folder: Path, what: str) -> subprocess.Popen:
    """Another process holding folder's lock as `what` does, until it is killed; returns once it holds it."""

    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), what], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=with_root())
    assert proc.stdout.readline() == "held\n"
    return proc


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (or link target) of everything under root, to prove a tree was not modified."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + str(path.readlink())
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@pytest.fixture
def script():
    return run_script


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Iterator[dict[str, Path]]:
    """The bundled tiny Llama, tied and untied, built once per test session (random weights, trained tokenizer)."""
    from pipeline.prep.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    models = {kind: build_tiny(root / kind, tied=kind == "tied") for kind in ("tied", "untied")}
    built = {kind: folder_bytes(folder) for kind, folder in models.items()}
    yield models
    # shared by every test of a worker: a test that writes into one (a weight check's record, say) changes what the
    # tests after it read, so the outcome would depend on the order tests are dealt in
    for kind, folder in models.items():
        assert folder_bytes(folder) == built[kind], f"a test wrote into the shared tiny model {folder}"


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hub_env(hf_home: Path, offline: bool = True) -> dict[str, str]:
    """Environment of a user whose HF_HOME is hf_home (offline by default)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(hf_home)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def sets_offline(script: str | Path, args: tuple) -> bool:
    """Whether `python SCRIPT ARGS` sets the offline switches before its first Hugging Face import, so that the
    launcher of its environment's training runs serves it: fsdp1.py, OFFLINE_MODULES, and the helpers that call
    switch_offline first (read from their source, so that a helper's key follows what it does)."""
    if str(script) == "-m":
        return bool(args) and str(args[0]) in OFFLINE_MODULES
    path = Path(script) if Path(script).is_absolute() else ROOT / script
    return path.name == "fsdp1.py" or (path.parent == ROOT / "tests" / "helpers"
                                       and "\nswitch_offline()" in path.read_text())


def torchrun(nproc: int, script: str | Path, *args: object, env: dict | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """Launch a script under torchrun with real gloo processes: torchrun's own agent and the script's own entry,
    started warm (tests/helpers/warm_launcher.py) unless FSDP1_TESTS_COLD=1 or a GPU is present."""
    argv = ["--standalone", "--nproc_per_node", str(nproc), str(script), *map(str, args)]
    if warm_launches():
        return WARM.run(["-m", "torch.distributed.run", *argv], with_root(env), timeout, sets_offline(script, args))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], cwd=ROOT, capture_output=True,
                          text=True, env=with_root(env), timeout=timeout)


def start_torchrun(nproc: int, script: str | Path, *args: object, env: dict | None = None, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL):
    """torchrun(), started and left running in a session of its own (for a test to signal or kill it): a
    subprocess.Popen, or its warm equivalent (stdout and stderr as Popen takes them; a pipe reads as text)."""
    argv = ["--standalone", "--nproc_per_node", str(nproc), str(script), *map(str, args)]
    if warm_launches():
        return WARM.start(["-m", "torch.distributed.run", *argv], with_root(env), sets_offline(script, args),
                          stdout, stderr)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], cwd=ROOT, env=with_root(env),
                            stdout=stdout, stderr=stderr, text=True, start_new_session=True)


def start_python(argv: list[str], env: dict, offline: bool, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, cwd: Path = ROOT):
    """`python ARGV` (a script, `-m MODULE` or `-c CODE`) in cwd (the repository unless given) with env, started and
    left running in a session of its own (for a test to signal or kill it), warm as torchrun() starts its runs: a
    subprocess.Popen (text=True), or its warm equivalent. offline: as run_python's."""
    if warm_launches():
        return WARM.start(argv, env, offline, stdout, stderr, cwd)
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True,
                            start_new_session=True)


@pytest.fixture(autouse=True)
def _launchers_of_a_test_end_with_it(request) -> Iterator[None]:
    """The warm launchers of environments that name the test's own folder are stopped after it: in test_hub, whose
    tests each have an HF_HOME of their own, they pushed the training runs' launcher out, and the next test's preflight
    checks then started cold (12.4 -> 39.9 s for one of them)."""
    yield
    if (folder := request.node.funcargs.get("tmp_path")) is not None:
        WARM.stop_naming(str(folder))


def pytest_sessionfinish(session) -> None:
    WARM.close()


def preflight_errors(argvs: list[list], env: dict) -> list[str]:
    """fsdp1.py's preflight for each command line, in one process: its one-line error, or "ok". Started warm where
    this environment's launcher is up (the training runs' environment, most often): a cold start cost 5-7 s here."""
    argv = [str(ROOT / "tests" / "helpers" / "preflight_errors.py"),
            json.dumps([[str(a) for a in argv] for argv in argvs])]
    if warm_launches() and WARM.running(with_root(env), offline=True):
        proc = WARM.run(argv, with_root(env), 600, offline=True)
    else:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=with_root(env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def root_cause(stderr: str) -> str:
    """The line torchrun's failure report ends with: its root cause's (the first failing rank's) error line, read
    from that worker's error file (pipeline.errors.say). Asserts it is the last thing printed."""
    lines = stderr.rstrip("\n").splitlines()
    assert lines[-1].startswith("=====") and lines[-2].startswith("  traceback : "), stderr[-3000:]
    assert any(line.startswith("Root Cause") for line in lines[-10:]), stderr[-3000:]
    return lines[-2].removeprefix("  traceback : ")


@pytest.fixture(scope="session")
def train_env(tmp_path_factory, tiny_models) -> dict:
    """DATA-HF datasets of the demo corpus (dataset: its text; chats: its conversations) and an HF_HOME holding the
    tiny tied model as local/tiny (with its chat template) and the untied one as local/tiny-untied."""
    import os
    import shutil

    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.prep.hub import import_local

    root = tmp_path_factory.mktemp("train_env")
    shutil.copytree(ROOT / "examples" / "raw", root / "text", ignore=shutil.ignore_patterns("chats"))
    build_dataset(CorpusConfig(root / "text", root / "dataset", num_proc=1))
    build_dataset(CorpusConfig(ROOT / "examples" / "raw" / "chats", root / "chats", num_proc=1))
    import_local(tiny_models["tied"], "local/tiny", "main", root / "hf" / "hub")
    import_local(tiny_models["untied"], "local/tiny-untied", "main", root / "hf" / "hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(root / "hf")
    return {"root": root, "dataset": root / "dataset", "chats": root / "chats", "env": env}


def events(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl events of one kind (none before the file exists). Polled while the run writes, so a
    last line not yet ended by its newline is left for the next poll; every ended line must parse."""
    import json

    path = run_dir / "metrics.jsonl"
    ended = path.read_text().split("\n")[:-1] if path.exists() else []
    return [e for e in map(json.loads, ended) if e["event"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss by step; a step logged twice (before a crash and after the resume) keeps its last value."""
    return {e["step"]: e["loss"] for e in events(run_dir, "train")}


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Poll until condition() holds, failing if the process ends first (the fault could not be injected)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before the fault could be injected"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.002)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict:
    """Tiny random models of every family the README lists (prep/tiny.FAMILIES), saved as save_pretrained saves
    them (Gemma: a scaled embedding, a non-persistent buffer no file holds; MoE: one tensor per expert), their
    persistent buffers set away from their initial values."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.prep.tiny import FAMILIES, family_config, random_buffers

    root, out = tmp_path_factory.mktemp("families"), {}
    for family in FAMILIES:
        torch.manual_seed(0)
        config = family_config(family, 512, 0, 1)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        random_buffers(model)
        model.save_pretrained(root / family)
        out[family] = root / family
    return out


@pytest.fixture
def group_of_one(monkeypatch):
    """This pytest process as a gloo group of one (the env it sets is restored afterwards)."""
    from pipeline.distributed.runtime import free_port, init_distributed

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    d = init_distributed()
    yield d
    import gc

    import torch

    gc.collect()  # the test's models and wrappers hold the group: its sockets close when they are collected
    torch.distributed.destroy_process_group()


def built_strategy(model_dir: Path, strategy: str, d):
    """The named strategy built (meta model, transforms, wrap) on model_dir's config in this process, fp32, in d (a
    group_of_one); its weights not loaded."""
    import torch
    from transformers import AutoConfig

    from pipeline.config_merge import from_flat
    from pipeline.strategies.registry import make_strategy, settle

    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(model_dir),
                            "strategy": strategy, "precision": "fp32"}))
    built = make_strategy(cfg.model, d, torch.float32)
    built.build(AutoConfig.from_pretrained(model_dir))
    return built


PROCESS_STARTS = ("torchrun(", "run_script(", "run_module(", "subprocess.", "Popen(", "script(")
"""What starting a real process looks like in a test's code (its own, its module's helpers, its fixtures')."""


def _sources(func, module, depth: int = 2) -> list[str]:
    """func's source and, depth levels down, that of the module-level functions it names."""
    import inspect

    try:
        found = [inspect.getsource(func)]
    except (OSError, TypeError):
        return []
    if depth:
        for name in getattr(getattr(func, "__code__", None), "co_names", ()):
            helper = getattr(module, name, None)
            if inspect.isfunction(helper) and helper.__module__ == module.__name__:
                found += _sources(helper, module, depth - 1)
    return found


LONG_FIRST = ("test_gpu_check.py", "test_experiments.py", "test_multinode.py", "test_lm_eval.py", "test_node_loss.py",
              "test_launch.py", "test_reward.py", "test_grpo.py", "test_token_cache.py")
"""The files holding a test of half a minute or more (`--durations 15`), dealt to the workers first: dealt last, the
reward model's 37 s test ran beside nothing in the suite's last minute (the cores 60% busy, against 95% before)."""


def pytest_collection_modifyitems(items) -> None:
    """Marks `slow` every test that starts a process (directly, through its module's helpers or a fixture), so `make
    test-fast` (`-m "not slow"`) runs the in-process ones; the full suite runs both. Then orders the files for the two
    workers, longest first: LONG_FIRST, then by their tests that start processes (a file's order within kept)."""
    here = sys.modules[__name__]
    for item in items:
        module = item.module
        code = _sources(item.function, module)
        for name in item.fixturenames:  # the module's own fixtures, then the shared ones here
            owner = module if hasattr(module, name) else here
            fixture = getattr(owner, name, None)
            if fixture is not None:
                code += _sources(getattr(fixture, "__wrapped__", fixture), owner)
        if any(start in text for text in code for start in PROCESS_STARTS):
            item.add_marker(pytest.mark.slow)
    # Longest first (the Makefile turns off xdist's own order, fewest tests last): a file whose one test runs minutes,
    # dealt last, ran alone on one worker while the other idled (the 4 minutes of a 18:33 suite's tail)
    starts = Counter(item.path.name for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (LONG_FIRST.index(item.path.name) if item.path.name in LONG_FIRST else len(LONG_FIRST),
                                 -starts[item.path.name], item.path.name))
