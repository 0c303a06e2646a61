"""The experiments harness end to end: a spec becomes configs and commands, runs (one experiment failing), reruns
skip what finished, and the analysis compares against the baseline from the runs' own metrics."""

import csv
import json
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, WARM, warm_launches, with_root

from pipeline.errors import UserError
from pipeline.tools.experiments import main

LAUNCHER = "torchrun --standalone --nproc_per_node 2"


def spec_file(tmp_path, base: dict, experiments: dict):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"base": base, "experiments": experiments}, sort_keys=False))
    return path


def warm_launcher(env: dict) -> tuple[str, dict]:
    """The harness's --launcher and environment: torchrun, started warm where the suite's runs are (each experiment's
    command goes through tests/helpers/warm_client.py to this pytest worker's warm launcher: torchrun's own agent and
    fsdp1.py's entry, without a cold interpreter per process), else torchrun itself."""
    if not warm_launches():
        return LAUNCHER, env
    env = with_root(env)
    client = ROOT / "tests" / "helpers" / "warm_client.py"
    return (shlex.join([sys.executable, str(client), "-m", "torch.distributed.run", *LAUNCHER.split()[1:]]),
            {**env, "FSDP1_WARM_SOCKET": WARM.server(WARM.imports_see(env, offline=True))})


def harness(env: dict, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.experiments", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_experiments_run_fail_alone_resume_and_compare_with_the_baseline(train_env, tmp_path):
    base = {"dataset_name": str(train_env["dataset"]), "model_name": "local/tiny", "profile": "cpu_debug",
            "max_steps": 5, "log_freq": 1, "eval_freq": 5, "warmup_steps": 1}
    spec = spec_file(tmp_path, base, {"ddp": {"strategy": "ddp"}, "missing": {"model_name": "local/missing"},
                                      "fsdp2": {"strategy": "fsdp2"}})
    out = tmp_path / "out"
    launcher, env = warm_launcher(train_env["env"])
    first = harness(env, "run", "--spec", spec, "--output-dir", out, "--launcher", launcher, "--execute")
    assert first.returncode == 1, first.stderr[-3000:]
    assert "1 of 3 failed (missing); fix and rerun the same command: finished experiments are skipped" in first.stderr
    status = {n: json.loads((out / "status" / f"{n}.json").read_text()) for n in ("ddp", "missing", "fsdp2")}
    assert [status[n]["status"] for n in ("ddp", "missing", "fsdp2")] == ["done", "failed", "done"]
    assert status["missing"]["error"].startswith("model local/missing is not in the offline cache")
    assert f"missing: failed after {status['missing']['seconds']} s: model local/missing" in first.stdout
    config = yaml.safe_load((out / "configs" / "fsdp2.yaml").read_text())
    assert (config["experiment_name"], config["save_dir"], config["seq_length"]) == ("fsdp2", str(out), 128)
    assert (out / "commands.sh").read_text().count("fsdp1.py --config") == 3

    spec_file(tmp_path, base, {"ddp": {"strategy": "ddp"}, "missing": {"model_name": "local/missing"},
                               "fsdp2": {"strategy": "fsdp2", "eval_freq": 0}})
    again = harness(env, "run", "--spec", spec, "--output-dir", out, "--launcher", launcher, "--execute")
    assert "ddp: done before, skipped" in again.stdout and "missing: running" in again.stdout
    assert "fsdp2: its config changed since it finished; running it again" in again.stdout
    assert again.returncode == 1 and json.loads((out / "status" / "fsdp2.json").read_text())["status"] == "done"

    shown = harness(env, "analyze", "--experiment-dir", out, "--baseline", "ddp")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert (out / "summary.md").read_text() in shown.stdout
    rows = {r["name"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert float(rows["ddp"]["speedup"]) == 1.0 and float(rows["ddp"]["loss_delta"]) == 0.0
    assert abs(float(rows["fsdp2"]["loss_delta"])) < 1e-4  # fp32: the strategies agree (test_strategies: 1e-5)
    assert rows["missing"]["status"] == "failed" and rows["missing"]["step_s"] == ""

    def step_s(name: str) -> float:  # the steady state by hand: steps 3-5, each logged
        times = {e["step"]: e["time"] for e in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())
                 if e["event"] == "train"}
        return sorted(times[s] - times[s - 1] for s in (3, 4, 5))[1]

    assert float(rows["fsdp2"]["step_s"]) == pytest.approx(step_s("fsdp2"), abs=1e-9)
    assert float(rows["fsdp2"]["speedup"]) == pytest.approx(step_s("ddp") / step_s("fsdp2"), rel=1e-9)
    assert float(rows["fsdp2"]["comm_ms"]) > 0 and float(rows["ddp"]["comm_ms"]) > 0
    assert len(rows["fsdp2"]["peak_gb_by_rank"].split()) == 2
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = harness(env, "analyze", "--experiment-dir", out, "--baseline", "fsdp")
    assert missing.stderr.strip() == f"error: --baseline fsdp is not an experiment of {out}; its experiments: ddp, " \
                                     "missing, fsdp2"


def test_a_dry_run_writes_only_configs_and_commands(tmp_path, capsys):
    spec = spec_file(tmp_path, {"dataset_name": "d", "model_name": "m"}, {"a": {"lr": 1e-3}, "b": None})
    assert main(["run", "--spec", str(spec), "--output-dir", str(tmp_path / "o"), "--launcher", "python"]) == 0
    assert "not run (pass --execute" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["commands.sh", "configs", "experiments.json"]
    commands = (tmp_path / "o" / "commands.sh").read_text().splitlines()[2:]
    assert commands == [f"{sys.executable} {ROOT / 'fsdp1.py'} --config {tmp_path / 'o' / 'configs' / n}.yaml"
                        for n in ("a", "b")]
    assert yaml.safe_load((tmp_path / "o" / "configs" / "a.yaml").read_text())["lr"] == 1e-3


@pytest.mark.parametrize(("spec", "message"), [
    ({"base": {"model_name": "m"}, "experiments": {"a": {"strategy": "ddp", "sharding": "FULL_SHARD"}}},
     "experiment a: --strategy ddp replicates the whole model on every rank; --sharding FULL_SHARD needs --strategy "
     "fsdp2, fsdp1 or manual"),  # every strategy that takes FULL_SHARD, from the strategies' own facts
    ({"base": {"model_name": "m"}, "experiments": {"a": {"bogus": 1}}}, "experiment a: unknown config key: bogus"),
    ({"base": {"dataset_name": None}, "experiments": {"a": {}}}, "experiment a: --dataset-name (-d) is required"),
    ({"base": {"save_dir": "x"}, "experiments": {"a": {}}},
     "save_dir is set by the harness (the experiment's name and --output-dir); remove it"),
    ({"base": {}, "experiments": {}}, "experiments must map at least one name to its overrides"),
    ({"base": {}, "experiments": {"../a": {}}}, "experiment name '../a' cannot name a folder"),
])
def test_a_bad_spec_is_refused_in_one_line_before_anything_is_written(tmp_path, spec, message):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**spec, "base": {"dataset_name": "d", "model_name": "m", **spec["base"]}}))
    with pytest.raises(UserError) as err:
        main(["run", "--spec", str(path), "--output-dir", str(tmp_path / "o")])
    assert str(err.value).endswith(message)
    assert not (tmp_path / "o").exists()


def test_the_steady_state_leaves_out_the_first_steps_and_the_restart_of_a_resumed_run():
    from pipeline.tools.analysis import summarise

    def train(step: int, t: float, loss: float) -> dict:
        return {"event": "train", "step": step, "time": t, "loss": loss, "tokens_per_s": 100.0 * step,
                "time_ms": {"comm": 10.0 * step}, "mem_gb": {"peak_by_rank": [1.0 + step, 2.0]}}

    events = [train(1, 0.0, 5.0), train(2, 3.0, 4.0), train(3, 4.0, 3.9),  # killed after step 3
              {"event": "resume", "time": 60.0}, train(3, 62.0, 3.8), train(4, 63.5, 3.5), train(5, 65.0, 3.0),
              {"event": "eval", "step": 5, "time": 66.0, "loss": 3.2}]
    s = summarise("x", "done", "", events, skip_steps=2)
    # windows 3->4 and 4->5 (2->3 spans the restart; 1->2 is warm-up), each 1.5 s
    assert (s.step_s, s.step_s_stdev, s.steps) == (1.5, 0.0, 5)
    assert (s.tokens_per_s, s.comm_ms, s.peak_gb_by_rank) == (400.0, 40.0, (6.0, 2.0))
    assert (s.train_loss, s.eval_loss) == (3.0, 3.2)
