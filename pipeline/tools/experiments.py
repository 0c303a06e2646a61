"""Named experiments on the user's own model and data: a spec of a base config and per-experiment overrides becomes
one config file and one command per experiment, run one after another; `analyze` (pipeline/tools/analysis.py) compares
their metrics against a baseline.

    python -m pipeline.experiments run --spec configs/experiments/compare.yaml --output-dir runs/compare \\
        --launcher "torchrun --standalone --nproc_per_node 2" --execute
    python -m pipeline.experiments analyze --experiment-dir runs/compare --baseline ddp_fp32

Layout of the output folder: `experiments.json` (names in spec order, launcher), `configs/NAME.yaml` (the resolved
config, every key), `commands.sh`, `status/NAME.json` (done or failed, with the error), `logs/NAME.log` (the
launch's output) and `NAME/` (the run folder fsdp1.py writes). A failed experiment does not stop the others; a
rerun skips the finished ones and resumes the rest from their checkpoints.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config_merge import from_flat, load_profile, require_dataset, save
from pipeline.errors import ArgumentParser, UserError
from pipeline.fsutil import read_yaml, write_text_atomic

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "fsdp1.py"
RESERVED = ("experiment_name", "save_dir")
"""Keys the harness sets itself: each experiment is named by its key in the spec and saved under --output-dir."""


@dataclass(frozen=True)
class Experiment:
    name: str
    config: Path
    command: list[str]


def launcher_argv(launcher: str) -> list[str]:
    """The launcher as argv, its `torchrun` or `python` this interpreter's (the environment the harness runs in, on
    PATH or not)."""
    argv = shlex.split(launcher)
    if not argv:
        raise UserError("--launcher is empty; e.g. \"torchrun --standalone --nproc_per_node 2\" or \"python\"")
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    return [sys.executable, *argv[1:]] if argv[0] in ("python", "python3") else argv


def read_spec(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The spec's base config and its experiments (name -> overrides), with one clear line for each thing wrong."""
    spec = read_yaml(path, "--spec")
    if not isinstance(spec, dict) or set(spec) - {"base", "experiments"}:
        raise UserError(f"--spec {path} must be a mapping with the keys base and experiments")
    base, experiments = spec.get("base") or {}, spec.get("experiments")
    if not isinstance(base, dict):
        raise UserError(f"--spec {path}: base must be a mapping of config keys to values")
    if not isinstance(experiments, dict) or not experiments:
        raise UserError(f"--spec {path}: experiments must map at least one name to its overrides")
    for name, overrides in experiments.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise UserError(f"--spec {path}: experiment name {name!r} cannot name a folder")
        if overrides is not None and not isinstance(overrides, dict):
            raise UserError(f"--spec {path}: experiment {name} must map config keys to values")
        given = sorted((set(base) | set(overrides or {})) & set(RESERVED))
        if given:
            raise UserError(f"--spec {path}: {', '.join(given)} is set by the harness (the experiment's name and "
                            "--output-dir); remove it")
    if "profile" in base:  # a named profile under the base's own keys, as in a --config file
        base = {**load_profile(str(base["profile"])), **{k: v for k, v in base.items() if k != "profile"}}
    return base, {name: overrides or {} for name, overrides in experiments.items()}


def materialise(spec: Path, out: Path, launcher: str) -> list[Experiment]:
    """Check every experiment's config (all before any is written), then write configs, commands.sh and the
    manifest. A config error names its experiment."""
    base, experiments = read_spec(spec)
    launch = launcher_argv(launcher)
    out = out.resolve()
    from pipeline.strategies.registry import settle  # the strategies import torch: only once configs are written

    configs = {}
    for name, overrides in experiments.items():
        try:
            cfg = from_flat({**base, **overrides, "experiment_name": name, "save_dir": str(out)})
            configs[name] = settle(require_dataset(cfg))
        except UserError as exc:
            raise UserError(f"experiment {name}: {exc}") from None
    (out / "configs").mkdir(parents=True, exist_ok=True)
    result = []
    for name, cfg in configs.items():
        path = out / "configs" / f"{name}.yaml"
        save(cfg, path)
        result.append(Experiment(name, path, [*launch, str(TRAIN_SCRIPT), "--config", str(path)]))
    write_text_atomic(out / "commands.sh", "#!/bin/sh\n# one experiment after another; see status/ for what ran\n"
                      + "".join(shlex.join(e.command) + "\n" for e in result))
    (out / "commands.sh").chmod(0o755)
    write_text_atomic(out / "experiments.json", json.dumps(
        {"spec": str(spec.resolve()), "launcher": launcher, "experiments": [e.name for e in result]}, indent=1))
    return result


def status(out: Path, name: str) -> dict[str, Any] | None:
    """What the last execution of an experiment recorded (None: never run)."""
    path = out / "status" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def error_line(log: str, returncode: int) -> str:
    """The run's own one-line error if it printed one, else the last line of its output. Under torchrun the line is
    in torchrun's failure report, as its root cause's `traceback : error: ...`, last (pipeline.errors.say)."""
    lines = [x.strip().removeprefix("traceback : ") for x in log.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    if errors:
        return errors[-1].removeprefix("error: ")
    return f"exit status {returncode}" + (f": {lines[-1]}" if lines else "")


def execute(out: Path, experiment: Experiment) -> dict[str, Any]:
    """Run one experiment to its end, its output to logs/NAME.log; record done or failed in status/NAME.json."""
    (out / "logs").mkdir(exist_ok=True)
    (out / "status").mkdir(exist_ok=True)
    log = out / "logs" / f"{experiment.name}.log"
    started = time.monotonic()
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(experiment.command)}\n")
        fh.flush()
        try:
            # in the caller's folder, as commands.sh runs: relative dataset paths mean the same in both
            code = subprocess.run(experiment.command, stdout=fh, stderr=subprocess.STDOUT).returncode
        except FileNotFoundError:
            code = 127
            fh.write(f"error: launcher {experiment.command[0]!r} was not found\n")
    record = {"name": experiment.name, "status": "done" if code == 0 else "failed", "returncode": code,
              "seconds": round(time.monotonic() - started, 1), "command": experiment.command,
              "config": experiment.config.read_text(encoding="utf-8")}
    if code:
        record["error"] = error_line(log.read_text(encoding="utf-8", errors="replace"), code)
    write_text_atomic(out / "status" / f"{experiment.name}.json", json.dumps(record, indent=1))
    return record


def run(spec: Path, out: Path, launcher: str, run_them: bool) -> int:
    experiments = materialise(spec, out, launcher)
    print(f"wrote {len(experiments)} configs to {out / 'configs'} and their commands to {out / 'commands.sh'}")
    if not run_them:
        print("not run (pass --execute to run them one after another)")
        return 0
    failed = []
    for e in experiments:
        previous = status(out, e.name)
        if previous and previous["status"] == "done":
            if previous.get("config") == e.config.read_text(encoding="utf-8"):
                print(f"{e.name}: done before, skipped")
                continue
            print(f"{e.name}: its config changed since it finished; running it again (fsdp1.py resumes or refuses)")
        print(f"{e.name}: running ({out / 'logs' / (e.name + '.log')})", flush=True)
        record = execute(out, e)
        if record["status"] == "failed":
            failed.append(e.name)
            print(f"{e.name}: failed after {record['seconds']} s: {record['error']}", flush=True)
        else:
            print(f"{e.name}: done in {record['seconds']} s", flush=True)
    if failed:
        print(f"{len(failed)} of {len(experiments)} failed ({', '.join(failed)}); fix and rerun the same command: "
              "finished experiments are skipped", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m pipeline.experiments", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="write each experiment's config and command; with --execute, run them")
    r.add_argument("--spec", type=Path, required=True, help="YAML with base: (config keys) and experiments: "
                   "(name -> overrides)")
    r.add_argument("--output-dir", type=Path, required=True)
    r.add_argument("--launcher", default="torchrun --standalone --nproc_per_node 2",
                   help="command that starts fsdp1.py (default: %(default)s); \"python\" for one process")
    r.add_argument("--execute", action="store_true", help="run the experiments one after another")
    a = sub.add_parser("analyze", help="compare finished experiments against a baseline")
    a.add_argument("--experiment-dir", type=Path, required=True)
    a.add_argument("--baseline", required=True, help="the experiment the others are compared with")
    a.add_argument("--skip-steps", type=int, default=2,
                   help="first steps left out of the steady state (default: %(default)s)")
    args = p.parse_args(argv)
    if args.command == "run":
        return run(args.spec, args.output_dir, args.launcher, args.execute)
    from pipeline.tools.analysis import analyze

    return analyze(args.experiment_dir, args.baseline, args.skip_steps)
