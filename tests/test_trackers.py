"""--report-to: every tracker's own store holds the numbers metrics.jsonl holds, under its names and steps; a resumed
run continues its tracker run; a missing package is one line, a failing tracker one warning."""

import contextlib
import json
import math
import os
import signal
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, events, preflight_errors, run_script, start_torchrun, wait_for, with_root

from pipeline.errors import UserError
from pipeline.signals import Interrupted
from pipeline.train import trackers
from pipeline.train.telemetry import Telemetry, read_metrics
from pipeline.train.trackers import Trackers, check_installed, check_report_to

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml"), "-b", "2", "--log-freq", "1", "--eval-freq", "2"]


def tracked(run_dir: Path) -> list[tuple[str, int, float]]:
    """What metrics.jsonl says the trackers were given: each event's finite numbers as (EVENT/FIELD, step, value),
    a field's dict of numbers (time_ms, mem_gb) as EVENT/FIELD/KEY."""
    def leaves(name: str, value: object) -> list[tuple[str, float]]:
        if isinstance(value, dict):
            return [leaf for k, v in value.items() for leaf in leaves(f"{name}/{k}", v)]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return [(name, value)] if number else []

    return sorted((key, e["step"], v) for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] != "sample"
                  for k, value in e.items() if k not in ("event", "step", "time")
                  for key, v in leaves(f"{e['event']}/{k}", value))


def mlflow_values(run_dir: Path) -> tuple[list, list]:
    """(the runs in RUN/mlflow.db, every metric value logged to them as (key, step, value)), read by MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fsdp1")
    runs = client.search_runs([experiment.experiment_id])
    values = sorted((key, m.step, m.value) for run in runs for key in run.data.metrics
                    for m in client.get_metric_history(run.info.run_id, key))
    return runs, values


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B offline file (run-ID.wandb), what `wandb sync` uploads: wandb 0.31 has no Python reader
    of its own any more. The format is LevelDB's log (blocks of 32 KiB; each record's pieces with a 7-byte header: a
    checksum, the length, and whether it is whole, first, middle or last) after a 7-byte W&B header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0:  # zeros: the end of what was written
            break
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # whole or last
            yield pieces
            pieces = b""


def wandb_values(run_dir: Path) -> tuple[set[str], list]:
    """(the run ids of RUN/wandb's offline runs, every value logged as (key, trainer/step, value)), parsed with W&B's
    own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    ids, values = set(), []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            if record.WhichOneof("record_type") == "history":
                # a text (W&B's Html) is stored as its file's description (sample/N/path, /size, ...): not a number
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                items = {k: v for k, v in items.items() if not k.startswith("sample/")}
                step = items.pop("trainer/step", None)
                assert step is not None or not [k for k in items if not k.startswith("_")], items
                values += [(k, step, v) for k, v in items.items() if not k.startswith("_") and
                           isinstance(v, (int, float))]
    return ids, sorted(values)


def trackio_values(store: Path) -> tuple[set[str], list]:
    """(the run ids in Trackio's local store of project fsdp1, every number in it as (key, step, value))."""
    with sqlite3.connect(store / "fsdp1.db") as db:
        rows = db.execute("SELECT run_id, step, metrics FROM metrics").fetchall()
    return {row[0] for row in rows}, sorted((k, step, v) for _, step, metrics in rows
                                            for k, v in json.loads(metrics).items()
                                            if not k.startswith("_") and isinstance(v, (int, float)))


def test_every_tracker_holds_the_jsonl_numbers_and_a_resume_continues_the_same_run(train_env, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The river"}\n')
    env = {**train_env["env"], "TRACKIO_DIR": str(tmp_path / "trackio")}
    args = ["-e", "r", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir", tmp_path, *DEMO,
            "--sample-prompts", prompts, "--report-to", "tensorboard,mlflow,wandb,trackio"]
    for steps in (2, 4):  # the rerun resumes at step 2 and goes on to 4
        proc = run_script("fsdp1.py", *args, "--max-steps", steps, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "r"
    expected = tracked(run)
    last = next(e for e in read_metrics(run / "metrics.jsonl") if e["event"] == "train" and e["step"] == 4)
    assert {("train/loss", 4, last["loss"]), ("train/time_ms/forward", 4, last["time_ms"]["forward"])} <= set(expected)
    runs, values = mlflow_values(run)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "r"
    assert values == expected
    config = yaml.safe_load((run / "config.yaml").read_text())
    state = json.loads((run / "state.json").read_text())
    # the config the run started with (MLflow's parameters are written once; a rerun may change --max-steps)
    assert {k: runs[0].data.params[k] for k in config} == {k: str(v) for k, v in {**config, "max_steps": 2}.items()}
    assert runs[0].data.params["fingerprint/dataset"] == state["fingerprint"]["dataset"]
    ids, values = wandb_values(run)
    assert ids == {json.loads((run / "trackers.json").read_text())["wandb"]} and values == expected
    ids, values = trackio_values(tmp_path / "trackio")
    assert len(ids) == 1 and values == expected
    # the samples as text: MLflow's artifacts, one per prompt and validation
    sample = next(e for e in read_metrics(run / "metrics.jsonl") if e["event"] == "sample" and e["step"] == 4)
    text = (run / "mlartifacts").glob(f"{runs[0].info.run_id}/artifacts/sample/0/step-00000004.txt")
    assert next(text).read_text() == f"{sample['prompt']}\n-> {sample['completion']}"


def test_report_to_names_known_trackers_and_a_missing_package_is_one_line(monkeypatch):
    for value, message in (
            ("tensorboard,comet", "--report-to: unknown tracker 'comet'; choose from none, tensorboard, mlflow, wandb, "
                                  "trackio (comma-separated)"),
            ("none,wandb", "--report-to 'none,wandb': name each tracker once, or none alone"),
            ("wandb,wandb", "--report-to 'wandb,wandb': name each tracker once, or none alone")):
        with pytest.raises(UserError) as err:
            check_report_to(value)
        assert str(err.value) == message
    check_report_to("none")
    monkeypatch.setitem(trackers.PACKAGES, "trackio", "trackio_not_installed_here")
    with pytest.raises(UserError) as err:
        check_installed("tensorboard,trackio")
    assert str(err.value) == ("--report-to trackio needs the trackio_not_installed_here package, which is not "
                              "installed here: pip install trackio_not_installed_here (or leave trackio out of "
                              "--report-to)")


def test_a_tracker_that_fails_during_the_run_is_one_warning_and_the_others_go_on(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Trackers(tmp_path, "mlflow,tensorboard", {"learning_rate": 1e-4})
    t.scalars(1, {"train/loss": 3.0})
    (tmp_path / "mlflow.db").write_bytes(b"not a database any more")  # the store gone under the run
    t.scalars(2, {"train/loss": 2.0})
    t.scalars(3, {"train/loss": 1.0})
    t.close()
    warnings = [r.getMessage() for r in caplog.records if "--report-to" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("--report-to mlflow failed at step 2 (")
    assert warnings[0].endswith("); training goes on without it")
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]


def test_fsdp1_refuses_a_missing_tracker_package_and_a_bad_report_to_in_preflight(train_env, tmp_path):
    """Before any weight or data is read (the package hidden from this interpreter by a sitecustomize)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    base = ["-e", "r", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir", tmp_path / "runs"]
    errors = preflight_errors([[*base, "--report-to", "tensorboard,wandb"], [*base, "--report-to", "wandb,"],
                               [*base, "--report-to", "none"]], {**train_env["env"], "PYTHONPATH": str(hide)})
    assert errors == ["--report-to wandb needs the wandb package, which is not installed here: pip install wandb "
                      "(or leave wandb out of --report-to)",
                      "--report-to: unknown tracker ''; choose from none, tensorboard, mlflow, wandb, trackio "
                      "(comma-separated)", "ok"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("raised", "status"), [(None, "FINISHED"), (Interrupted(15), "KILLED"),
                                                (RuntimeError("a crash"), "FAILED")])
def test_the_tracker_run_ends_with_how_the_training_ended(tmp_path, raised, status):
    from mlflow.tracking import MlflowClient

    with contextlib.suppress(type(raised) if raised else ()), \
            Telemetry(tmp_path, enabled=True, total_steps=4, start_step=0, report_to="mlflow", params={}) as t:
        t.event("train", 1, loss=3.0)
        if raised:
            raise raised
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fsdp1").experiment_id])
    assert run.info.status == status and run.data.metrics == {"train/loss": 3.0}


def test_a_tracking_server_out_of_reach_is_one_warning_and_the_other_trackers_go_on(tmp_path, caplog, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the discard port: nothing listens
    t = Trackers(tmp_path, "mlflow,tensorboard", {})
    t.scalars(1, {"train/loss": 3.0})
    t.close()
    (warning,) = [r.getMessage() for r in caplog.records if "--report-to" in r.getMessage()]
    assert warning.startswith("--report-to mlflow could not start (MlflowException: ")
    assert warning.endswith("; training goes on without it") and not (tmp_path / "mlflow.db").exists()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(1, 3.0)]


RUN = """import logging, sys
from pathlib import Path
from pipeline.train.trackers import Trackers
logging.basicConfig(level=logging.WARNING)
t = Trackers(Path(sys.argv[1]), "mlflow", {"seed": 0})
t.scalars(3, {"train/loss": 1.5})
t.close()
"""


def test_a_resumed_run_whose_mlflow_store_was_deleted_starts_a_new_mlflow_run(tmp_path):
    """Each run a process of its own, as a resume is (MLflow keeps a store open for the process's life)."""
    from mlflow.tracking import MlflowClient

    def run() -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], capture_output=True, text=True,
                              env=with_root(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run()
    old = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    (tmp_path / "mlflow.db").unlink()
    proc = run()
    new = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert new != old and client.get_run(new).data.metrics == {"train/loss": 1.5}
    assert f"--report-to mlflow: run {old} of RUN/trackers.json is not in sqlite:///" in proc.stderr


WANDB_START = """import logging, sys, time
from pathlib import Path
from pipeline.train.trackers import Trackers
logging.basicConfig(level=logging.WARNING, format="%(message)s")
start = time.monotonic()
t = Trackers(Path(sys.argv[1]), "wandb,tensorboard", {"seed": 0})
print(f"started in {time.monotonic() - start:.1f} s", flush=True)
t.scalars(1, {"train/loss": 3.0})
t.close()
"""


def test_wandb_online_out_of_reach_is_one_warning_within_seconds(tmp_path):
    """WANDB_MODE=online with no network (a host that does not resolve) or a server that is gone (a port nothing
    listens on): W&B's own retries took 101 s here before its error; one retry of each request bounds it to seconds.
    Both in processes of their own at once (W&B starts a service process and keeps it for the process's life)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    urls = {"unresolved": "http://wandb.invalid", "refused": "http://127.0.0.1:9"}  # .invalid never resolves
    procs = {}
    for case, url in urls.items():
        (tmp_path / case).mkdir()
        env = with_root({**os.environ, "WANDB_MODE": "online", "WANDB_BASE_URL": url, "WANDB_API_KEY": "0" * 40,
                         "WANDB_CONFIG_DIR": str(tmp_path / case / "config")})
        procs[case] = subprocess.Popen([sys.executable, "-c", WANDB_START, str(tmp_path / case)], env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        seconds = float(out.split("started in ")[1].split(" s")[0])
        assert seconds < 30, (case, seconds)  # 101 s before, 8 s here after
        run_id = json.loads((tmp_path / case / "trackers.json").read_text())["wandb"]
        (warning,) = [line for line in err.splitlines() if "--report-to" in line]
        assert warning.startswith(f"--report-to wandb could not start (CommError: Failed to get resume status for "
                                  f"run {run_id}: POST {urls[case]}/graphql giving up after 2 attempt(s): Post "
                                  f'"{urls[case]}/graphql": dial tcp')
        assert warning.endswith("); training goes on without it")
        if case == "refused":
            assert warning == (f"--report-to wandb could not start (CommError: Failed to get resume status for run "
                               f"{run_id}: POST {urls[case]}/graphql giving up after 2 attempt(s): Post "
                               f'"{urls[case]}/graphql": dial tcp 127.0.0.1:9: connect: connection refused); '
                               "training goes on without it")
        acc = EventAccumulator(str(tmp_path / case / "tensorboard"))  # the other tracker went on
        acc.Reload()
        assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(1, 3.0)]


def test_a_run_stopped_by_a_signal_ends_its_tracker_run_as_killed(train_env, tmp_path):
    from mlflow.tracking import MlflowClient

    proc = start_torchrun(2, ROOT / "fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", "local/tiny",
                          "--save-dir", tmp_path, *DEMO, "--max-steps", "1000", "--report-to", "mlflow",
                          env=train_env["env"])
    wait_for(lambda: events(tmp_path / "r", "train"), proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher forwards it to the workers
    proc.wait(timeout=120)
    assert "stopped by signal at step " in (tmp_path / "r" / "train.log").read_text()
    client = MlflowClient(f"sqlite:///{tmp_path / 'r' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fsdp1").experiment_id])
    assert run.info.status == "KILLED"
