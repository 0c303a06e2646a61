"""The experiment trackers a run's metrics go to besides metrics.jsonl (--report-to): TensorBoard, MLflow, Weights &
Biases and Trackio, each offline unless the user's own variables point it elsewhere.

One tracker run per run folder: its id is kept in RUN/trackers.json, so a resumed run continues the same tracker run
instead of starting another. Metrics keep metrics.jsonl's names (`EVENT/FIELD`: train/loss, eval/loss) and its step
(the optimizer step); a resumed run logs the steps after its checkpoint again, as metrics.jsonl does. A tracker that
fails mid-run (a full disk, a server gone) is one warning and is dropped; training goes on. Rank 0 only.
"""

from __future__ import annotations

import html
import importlib.util
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import UserError, first_line
from pipeline.fsutil import write_text_atomic

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")
"""What --report-to accepts, besides none."""
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
"""The pip requirement of each tracker."""
IDS_FILE = "trackers.json"
"""RUN/trackers.json: each tracker's run id, so a resume continues it."""
PROJECT = "fsdp1"
"""The MLflow experiment, W&B project and Trackio project when the tracker's own variable names none."""

log = logging.getLogger("pipeline")


def named(report_to: str) -> tuple[str, ...]:
    """--report-to's names, in order, as given (none included)."""
    return tuple(name.strip() for name in report_to.split(","))


def chosen(report_to: str) -> tuple[str, ...]:
    """--report-to's trackers, in order (none: no tracker)."""
    names = named(report_to)
    return () if names == ("none",) else names


def check_report_to(report_to: str) -> None:
    """--report-to names known trackers, each once; none stands alone."""
    names = named(report_to)
    unknown = [n for n in names if n not in (*TRACKERS, "none")]
    if unknown:
        raise UserError(f"--report-to: unknown tracker {unknown[0]!r}; choose from none, {', '.join(TRACKERS)} "
                        "(comma-separated)")
    if len(set(names)) != len(names) or ("none" in names and len(names) > 1):
        raise UserError(f"--report-to {report_to!r}: name each tracker once, or none alone")


def modules(name: str) -> tuple[str, ...]:
    """What the tracker imports: MLflow's local store is a SQLite database, which mlflow-skinny alone cannot open
    (the full mlflow package brings SQLAlchemy and Alembic); a tracking server needs the client only."""
    if name == "mlflow" and (os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:").startswith("sqlite:"):
        return ("mlflow", "sqlalchemy", "alembic")
    return (PACKAGES[name],)


def check_installed(report_to: str) -> None:
    """Before any heavy work: every chosen tracker's modules import here."""
    for name in chosen(report_to):
        missing = [m for m in modules(name) if importlib.util.find_spec(m) is None]
        if not missing:
            continue
        package = PACKAGES[name]
        what = (f"the {package} package, which is" if missing == [package] else
                f"{', '.join(missing)}, which the full {package} package brings and are")
        raise UserError(f"--report-to {name} needs {what} not installed here: pip install {package} (or leave "
                            f"{name} out of --report-to)")


def mlflow_uri(run_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, else a SQLite store in the run folder (MLflow's local backend: its file store refuses to
    start since 3.x unless told to)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path, ids: dict, params: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def text(self, tag: str, step: int, text: str) -> None:
        # indented as a markdown code block, so TensorBoard's text tab shows it as written
        self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step)

    def close(self, status: str) -> None:
        self.writer.close()


class MLflow:
    """A local store, RUN/mlflow.db, unless MLFLOW_TRACKING_URI names another; MLFLOW_EXPERIMENT_NAME or fsdp1."""

    name = "mlflow"

    def __init__(self, run_dir: Path, ids: dict, params: dict):
        # a tracking server that is gone costs the training seconds, not minutes of MLflow's retries at every call
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(mlflow_uri(run_dir))
        if (run_id := ids.get(self.name)) and self.known(run_id):
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = self.client.get_experiment_by_name(experiment_name)
        # a local store's artifacts beside it (MLflow's default is the working directory's ./mlartifacts)
        artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (run_dir / "mlartifacts").resolve().as_uri()
        experiment_id = (experiment.experiment_id if experiment else
                         self.client.create_experiment(experiment_name, artifact_location=artifacts))
        self.run_id = ids[self.name] = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def known(self, run_id: str) -> bool:
        """Whether the store holds the run (a store deleted, or another MLFLOW_TRACKING_URI: a new run starts)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            log.warning("--report-to mlflow: run %s of RUN/trackers.json is not in %s; starting a new one", run_id,
                        self.client.tracking_uri)
            return False
        return True

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def text(self, tag: str, step: int, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step-{step:08d}.txt")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


class WandB:
    """Offline (RUN/wandb, `wandb sync` uploads it) unless WANDB_MODE is set; WANDB_PROJECT or fsdp1. W&B's own step
    only grows, while a resumed run logs the steps after its checkpoint again: every value is logged against
    `trainer/step`, the optimizer step (the HF Trainer's way)."""

    name = "wandb"

    def __init__(self, run_dir: Path, ids: dict, params: dict):
        # online with no network (or a server that is gone) costs the training seconds, not the 100 s of W&B's
        # retries within its 90 s init timeout: one retry of each request, each at most 10 s, as MLflow's
        os.environ.setdefault("WANDB__GRAPHQL_RETRY_MAX", "1")
        os.environ.setdefault("WANDB_HTTP_TIMEOUT", "10")
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        run_id = ids.setdefault(self.name, uuid.uuid4().hex[:12])
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=run_dir.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=params)
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"trainer/step": step, **values})

    def text(self, tag: str, step: int, text: str) -> None:
        self.run.log({"trainer/step": step, tag: self.wandb.Html(f"<pre>{html.escape(text, quote=False)}</pre>")})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class Trackio:
    """Trackio's local store (TRACKIO_DIR, else its own default); TRACKIO_PROJECT or fsdp1."""

    name = "trackio"

    def __init__(self, run_dir: Path, ids: dict, params: dict):
        import trackio

        ids[self.name] = run_dir.name
        # no system-metric threads: the run logs its own memory and speed
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or PROJECT, name=run_dir.name,
                                resume="allow", config=params, auto_log_cpu=False, auto_log_gpu=False)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, step: int, text: str) -> None:
        self.run.log({tag: text}, step=step)

    def close(self, status: str) -> None:
        self.run.finish()


KINDS = {cls.name: cls for cls in (TensorBoard, MLflow, WandB, Trackio)}


class Trackers:
    """The run's trackers (rank 0 only): each call goes to every tracker still working."""

    def __init__(self, run_dir: Path, report_to: str, params: dict[str, Any]):
        ids_file = run_dir / IDS_FILE
        ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
        self.active: list = []
        for name in chosen(report_to):
            try:
                self.active.append(KINDS[name](run_dir, ids, params))
            except Exception as exc:  # noqa: BLE001 (a tracker that cannot start must not stop the training)
                log.warning("--report-to %s could not start (%s: %s); training goes on without it", name,
                            type(exc).__name__, first_line(exc))
        if ids:
            write_text_atomic(ids_file, json.dumps(ids, indent=1, sort_keys=True) + "\n")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if values:
            self._each(f"step {step}", lambda t: t.scalars(step, values))

    def text(self, tag: str, step: int, text: str) -> None:
        self._each(f"step {step}", lambda t: t.text(tag, step, text))

    def close(self, status: str = "FINISHED") -> None:
        """End every tracker's run: FINISHED, KILLED (stopped by a signal; a rerun resumes it) or FAILED."""
        self._each("the end", lambda t: t.close(status))
        self.active = []

    def _each(self, when: str, call: Callable[[Any], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 (a tracker's failure is its own: the run and the others go on)
                self.active.remove(tracker)
                log.warning("--report-to %s failed at %s (%s: %s); training goes on without it", tracker.name, when,
                            type(exc).__name__, first_line(exc))
