"""lm-evaluation-harness, offline: named tasks (lm-eval's own, or the YAMLs of an --lm-eval-include folder) run on a
model folder, or on a base with a PEFT adapter, with no network: the Hugging Face libraries are switched offline and a
task whose data is not on this machine is one line naming it, before any model is loaded.

lm-eval is an optional dependency (requirements-lm-eval.txt, `make lm-eval`); only this module imports it.

The model is loaded here with from_pretrained and handed to lm-eval's HFLM as an object: given a path, HFLM builds an
accelerate Accelerator, which under torchrun's variables joins a process group of WORLD_SIZE ranks, and after a run
only rank 0 is left to join it (a wait of HFLM's 52-week timeout).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.config import TrainConfig
from pipeline.errors import UserError, first_line
from pipeline.offline import SWITCHES

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

INSTALL = "make lm-eval"
"""The make target that installs lm-eval (requirements-lm-eval.txt)."""
OFFLINE_SWITCHES = (*SWITCHES, "HF_EVALUATE_OFFLINE")


@dataclass(frozen=True)
class Tasks:
    names: tuple[str, ...]
    """Task, group or tag names, as lm-eval's --tasks takes them."""
    include: Path | None
    """A folder of task YAMLs searched before lm-eval's own (its --include_path)."""

    @classmethod
    def of(cls, cfg: TrainConfig) -> Tasks | None:
        """The config's --lm-eval-tasks and --lm-eval-include (checked by the config); None when no task is named."""
        names = tuple(n.strip() for n in cfg.lm_eval_tasks.split(",") if n.strip())
        return cls(names, Path(cfg.lm_eval_include) if cfg.lm_eval_include else None) if names else None

    def flags(self) -> str:
        """The flags that name these tasks again, for a message."""
        return f"--lm-eval-tasks {','.join(self.names)}" + (f" --lm-eval-include {self.include}" if self.include
                                                             else "")


def require_lm_eval() -> None:
    """lm-eval importable, else the one line naming what installs it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"--lm-eval-tasks needs lm-evaluation-harness, which is not installed: run `{INSTALL}` "
                        "(pip install -r requirements-lm-eval.txt)") from None


def go_offline() -> None:
    """Switch the Hugging Face libraries offline and check that they are: huggingface_hub and datasets read the
    switches once, at import, so one imported before them would still reach for the network."""
    import datasets
    import huggingface_hub

    for switch in OFFLINE_SWITCHES:
        os.environ[switch] = "1"
    if not (huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE):
        raise UserError("lm-eval tasks run offline only, but the Hugging Face libraries were imported online; set "
                        f"{'=1 '.join(OFFLINE_SWITCHES)}=1 before starting")


def check_tasks(tasks: Tasks) -> None:
    """Every name known, every task's data on this machine, and every task run through once on two documents by
    lm-eval's DummyLM (its prompts, targets and metrics, with random scores), or one line naming the task: before any
    training or model load. Datasets caches the documents for the real pass."""
    require_lm_eval()
    go_offline()
    manager = task_manager(tasks)
    unknown = [n for n in tasks.names if n not in manager.all_tasks and not Path(n).is_file()]
    if unknown:
        where = f"in {tasks.include} nor " if tasks.include else ""
        raise UserError(f"unknown lm-eval task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not {where}"
                        "among lm-eval's own tasks (a task's name is its YAML's `task:`)")
    for name in tasks.names:
        try:
            with quiet():  # datasets' progress bars: a refusal is one line
                manager.load([name])
        except Exception as exc:  # lm-eval and datasets raise many kinds for a task they cannot build
            raise UserError(_cannot_load(name, exc)) from None
        try:
            dry_run(manager, name)
        except Exception as exc:  # a template, target or metric that fails on a real document
            raise UserError(f"lm-eval task {name} fails on its first documents ({first_line(exc)}); fix the task "
                            "(its YAML or the functions it names)") from None


def dry_run(manager: TaskManager, name: str) -> None:
    """The task end to end on two documents with lm-eval's DummyLM (random scores, no model), quietly."""
    from lm_eval import simple_evaluate
    from lm_eval.models.dummy import DummyLM

    with one_process(), quiet():
        simple_evaluate(model=DummyLM(), tasks=[name], task_manager=manager, limit=2, bootstrap_iters=0,
                        log_samples=False)


def _cannot_load(name: str, exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError | ConnectionError) or "Offline" in type(exc).__name__:
        return (f"lm-eval task {name}: its data could not be read on this offline machine ({first_line(exc)}); give "
                "the task local files (dataset_path: json with dataset_kwargs.data_files, paths from the current "
                "folder) or put its dataset in the datasets cache")
    return f"lm-eval task {name} could not be built ({first_line(exc)}); fix its YAML"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """What lm-eval and datasets print (tables, progress bars) while checking, kept from the terminal."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """LOCAL_RANK 0 while lm-eval runs: simple_evaluate returns its results only where LOCAL_RANK is 0, and global
    rank 0 (the one process that runs the tasks, its process group gone) may have another local rank under a
    launcher that numbers them so."""
    local = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if local is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = local


def task_manager(tasks: Tasks) -> TaskManager:
    """lm-eval's index of the tasks. Indexing lm-eval's own thousands of YAMLs takes seconds (4.4 s against 0.7 s
    for the bundled example's folder alone, measured on the 2-core CPU machine), and every command builds it at
    least twice (the check, the run): when every name is a plain task of the include folder (no group or tag, which
    may name lm-eval's own tasks), that folder's index is the whole index needed. Each index is built once per
    process (the check and the run share it; a task's YAML is read again at each load, so an edit still counts)."""
    include = str(tasks.include) if tasks.include else None
    if include:
        local = _index(include, False)
        if set(tasks.names) <= set(local.all_subtasks):
            return local
    return _index(include, True)


@functools.cache
def _index(include: str | None, defaults: bool) -> TaskManager:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def run_tasks(tasks: Tasks, model_dir: Path, *, adapter_dir: Path | None, device: torch.device, dtype: torch.dtype,
              batch_size: int) -> dict[str, Any]:
    """lm-eval's simple_evaluate of the tasks on the model (with the adapter on it), in this process alone; what the
    JSON reports hold under "lm_eval" (results, groups, n-shot and versions as lm-eval gives them). Prints lm-eval's
    table."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import make_table
    from transformers import AutoModelForCausalLM, AutoTokenizer

    go_offline()
    gc.collect()  # a run's or the held-out pass's model is gone; its cached device blocks go back before this load
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(device).eval()
    handed = logging.getLogger(HFLM.__module__)
    handed.addFilter(_handed_a_model)
    try:
        lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), batch_size=batch_size)
    finally:
        handed.removeFilter(_handed_a_model)
    with one_process():
        out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=task_manager(tasks),
                                      log_samples=False)
    print(make_table(out), flush=True)
    if out.get("groups"):
        print(make_table(out, "groups"), flush=True)
    report = {"tasks": list(tasks.names), "include": str(tasks.include) if tasks.include else None,
              "dtype": str(dtype).removeprefix("torch."), "lm_eval_version": lm_eval.__version__}
    return {**report, **{key: _json_safe(out.get(key, {})) for key in ("results", "groups", "n-shot", "versions")}}


HANDED_A_MODEL = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")
"""lm-eval's warnings on being given a model object: we give it one on purpose (the module's docstring says why)."""


def _handed_a_model(record: logging.LogRecord) -> bool:
    """A logging filter: False (dropped) for HANDED_A_MODEL's warnings."""
    return not record.getMessage().startswith(HANDED_A_MODEL)


def _json_safe(value: Any) -> Any:
    """lm-eval's figures with NaN and infinities as text (strict JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
